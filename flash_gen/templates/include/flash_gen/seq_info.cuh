// Where one batch entry's rows live, for dense and packed ragged (varlen) batches. Shared by the forward,
// backward and helper kernels; includes no CuTe.
//
// Dense: every entry has params.seqlen_q / seqlen_k rows and is reached through the batch strides.
// Varlen: tensors are packed (total_rows, heads, head_dim) with batch stride 0; cu_seqlens_q/k (batch + 1
// prefix sums) give entry b the rows [cu[b], cu[b+1]) and params.seqlen_q / seqlen_k hold the totals. The
// offsets are clamped to the totals, so malformed cu_seqlens can give wrong results but never an access
// outside the tensors.
#pragma once

namespace flash_gen {

struct SeqInfo {
  int q_start = 0, k_start = 0;  // first row of the entry in the packed tensors (0 when dense)
  int seqlen_q, seqlen_k;
};

__device__ __forceinline__ void packed_range(const int* cu_seqlens, int batch, int total, int& start, int& len) {
  start = min(max(cu_seqlens[batch], 0), total);
  len = min(max(cu_seqlens[batch + 1], start), total) - start;
}

template <bool kVarlen, class Params>
__device__ __forceinline__ SeqInfo seq_info(Params const& p, int batch) {
  SeqInfo s{0, 0, p.seqlen_q, p.seqlen_k};
  if constexpr (kVarlen) {
    packed_range(p.cu_seqlens_q, batch, p.seqlen_q, s.q_start, s.seqlen_q);
    packed_range(p.cu_seqlens_k, batch, p.seqlen_k, s.k_start, s.seqlen_k);
  }
  return s;
}

// The tile_index-th work tile of a varlen batch whose entry b (rows [cu[b], cu[b+1])) splits into
// tiles_of(length) tiles, entries in order: returns {entry, tile within it}, or entry -1 past the last tile.
// A grid of sum-over-entries-of-tiles CTAs (bounded on the host by the totals) then has no idle CTAs and needs
// no per-entry maximum on the host. Each warp scans 32 entries per step with shuffles (no smem, no barrier),
// so every warp of a CTA can call it independently.
template <class TilesOf>
__device__ __forceinline__ int2 varlen_tile(const int* cu_seqlens, int batch, int total, int tile_index,
                                            TilesOf tiles_of) {
  const int lane = threadIdx.x % 32;
  int before = 0;  // tiles of the entries already scanned
  for (int b0 = 0; b0 < batch; b0 += 32) {
    int tiles = 0;
    if (b0 + lane < batch) {
      int start, len;
      packed_range(cu_seqlens, b0 + lane, total, start, len);
      tiles = tiles_of(len);
    }
    int incl = tiles;  // inclusive prefix sum over the lanes
#pragma unroll
    for (int off = 1; off < 32; off *= 2) {
      const int t = __shfl_up_sync(0xffffffff, incl, off);
      if (lane >= off) incl += t;
    }
    const unsigned hit = __ballot_sync(0xffffffff, before + incl > tile_index);
    if (hit != 0) {
      const int l = __ffs(hit) - 1;
      const int first = before + __shfl_sync(0xffffffff, incl - tiles, l);
      return make_int2(b0 + l, tile_index - first);
    }
    before += __shfl_sync(0xffffffff, incl, 31);
  }
  return make_int2(-1, 0);
}

}  // namespace flash_gen
