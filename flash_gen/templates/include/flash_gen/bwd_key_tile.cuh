// The work of one backward CTA (shared by bwd_sm80.cuh and bwd_sm90.cuh): the key tile it owns, for which entry
// of a packed batch, and the query tiles whose rows see a key of it.
#pragma once
#include <cute/tensor.hpp>

#include "flash_gen/attn_mask.cuh"
#include "flash_gen/bwd_params.cuh"
#include "flash_gen/seq_info.cuh"

namespace flash_gen {

struct BwdKeyTile {
  int batch, n_block;
  SeqInfo seq;
  int diag;          // seqlen_k - seqlen_q: bottom-right alignment of causal/local masks
  int m_min, m_max;  // query tiles [m_min, m_max) (query i sees key j iff i + diag - wl <= j <= i + diag + wr)

  // The (kBlockN, kD) tile of K, V, dK or dV (b, s, h_k, d) this CTA owns.
  template <int kBlockN, int kD, class Element>
  __device__ __forceinline__ auto kv(Element* base, int64_t batch_stride, int64_t row_stride, int64_t head_stride,
                                     int head_k) const {
    using namespace cute;
    Element* ptr = base + batch * batch_stride + seq.k_start * row_stride + head_k * head_stride;
    return local_tile(make_tensor(make_gmem_ptr(ptr), make_shape(seq.seqlen_k, Int<kD>{}), make_stride(row_stride, _1{})),
                      Shape<Int<kBlockN>, Int<kD>>{}, make_coord(n_block, 0));
  }
};

// False when a packed batch's grid has more CTAs than key tiles (the CTA then returns at once).
template <bool kVarlen, Mask kMask, int kBlockM, int kBlockN>
__device__ __forceinline__ bool bwd_key_tile(BwdParams const& p, BwdKeyTile& t) {
  t.n_block = blockIdx.x;
  t.batch = blockIdx.z;
  if constexpr (kVarlen) {  // the grid's x runs over every entry's key tiles
    const int2 tile = varlen_tile(p.cu_seqlens_k, p.batch, p.seqlen_k, t.n_block,
                                  [](int len) { return (len + kBlockN - 1) / kBlockN; });
    if (tile.x < 0) return false;
    t.batch = tile.x;
    t.n_block = tile.y;
  }
  t.seq = seq_info<kVarlen>(p, t.batch);
  t.diag = t.seq.seqlen_k - t.seq.seqlen_q;
  const int col0 = t.n_block * kBlockN;
  t.m_min = 0;
  t.m_max = (t.seq.seqlen_q + kBlockM - 1) / kBlockM;
  if constexpr (MaskBounds<kMask>::kRight) t.m_min = max(0, col0 - t.diag - p.window_right) / kBlockM;
  if constexpr (MaskBounds<kMask>::kLeft) {
    const int last_row = col0 + kBlockN - 1 - t.diag + p.window_left;
    t.m_max = last_row < 0 ? 0 : min(t.m_max, last_row / kBlockM + 1);
  }
  return true;
}

}  // namespace flash_gen
