// The two memory-bound kernels around the main backward kernel. They take the head dim at run time, so one
// compile per (arch, dtype) serves every head dim, and they include no CuTe (seconds to compile, not a minute).
//  - bwd_preprocess: dsum = rowsum(dO * O) and lse in base 2, padded to the main kernel's row tiling, and
//    zeroes the fp32 dQ accumulator and the determinism semaphores (so no separate fill kernel runs).
//  - bwd_convert_dq: dQ = softmax_scale * dq_accum, in the input dtype, written through dQ's strides.
#pragma once
#include "flash_gen/bwd_params.cuh"
#include "flash_gen/half_bits.cuh"
#include "flash_gen/seq_info.cuh"

namespace flash_gen {

constexpr int kAuxThreads = 128;
constexpr int kAuxRows = 32;  // rows per CTA: grid = (ceil(rows / kAuxRows), nheads, batch), or over entries

// Sum over the 8 elements packed in a 16-byte vector of a*b.
template <bool kBf16>
__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
  const unsigned* wa = reinterpret_cast<const unsigned*>(&a);
  const unsigned* wb = reinterpret_cast<const unsigned*>(&b);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    s += to_float<kBf16>(wa[i] & 0xffff) * to_float<kBf16>(wb[i] & 0xffff);
    s += to_float<kBf16>(wa[i] >> 16) * to_float<kBf16>(wb[i] >> 16);
  }
  return s;
}

// The (batch, kAuxRows-row block) this CTA serves and its entry's rows. Dense: the grid's (z, x). Varlen: the
// grid's x runs over every entry's blocks of `rows_of(seqlen_q)` rows. Returns false for a CTA past the last.
template <class RowsOf>
__device__ __forceinline__ bool aux_block(BwdParams const& p, RowsOf rows_of, int& batch, int& row_begin,
                                          SeqInfo& seq) {
  batch = blockIdx.z;
  int block = blockIdx.x;
  if (p.cu_seqlens_q != nullptr) {
    const int2 tile = varlen_tile(p.cu_seqlens_q, p.batch, p.seqlen_q, block,
                                  [&](int len) { return (rows_of(len) + kAuxRows - 1) / kAuxRows; });
    if (tile.x < 0) return false;
    batch = tile.x;
    block = tile.y;
    seq = seq_info<true>(p, batch);
  } else {
    seq = seq_info<false>(p, batch);
  }
  row_begin = block * kAuxRows;
  return true;
}

template <bool kBf16>
__device__ __forceinline__ void bwd_preprocess(BwdParams const& p) {
  const int head = blockIdx.y;
  const int bm = p.block_m;
  auto rounded = [bm](int len) { return (len + bm - 1) / bm * bm; };  // rows the main kernel touches
  int batch, row_begin;
  SeqInfo seq;
  if (!aux_block(p, rounded, batch, row_begin, seq)) return;
  const int64_t acc0 = acc_row0(p, p.cu_seqlens_q != nullptr, batch, head, seq.q_start);
  const int rows_total = rounded(seq.seqlen_q);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int chunks = p.head_dim / 8;  // 16-byte vectors per row; head_dim is a multiple of 8, <= 256

  // A row's vectors go to a group of lanes (the power of two >= chunks), so a warp reads 32 / group rows at once:
  // with one row per warp, head dim 64 kept 8 lanes busy and ran 1.5x longer than FlashAttention-4's preprocess
  // on the same bytes (H200, 2026-12-04: 214 against 139 us at 4 x 8k x 32 heads).
  int group = 1;
  while (group < chunks) group *= 2;
  const int sub = lane / group, vec = lane % group, per_pass = kAuxThreads / group;
  for (int r0 = 0; r0 < kAuxRows; r0 += per_pass) {  // warp-uniform: every lane reaches the shuffles
    const int r = r0 + warp * (32 / group) + sub, row = row_begin + r;
    const bool owned = r < kAuxRows && row < rows_total, valid = owned && row < seq.seqlen_q;
    const int64_t q_row = seq.q_start + row;
    float s = 0.f;
    if (valid && vec < chunks) {
      const auto* o = static_cast<const unsigned short*>(p.o) + batch * p.o_batch_stride + q_row * p.o_row_stride +
                      head * p.o_head_stride;
      const auto* d = static_cast<const unsigned short*>(p.dout) + batch * p.do_batch_stride +
                      q_row * p.do_row_stride + head * p.do_head_stride;
      s = dot8<kBf16>(reinterpret_cast<const uint4*>(o)[vec], reinterpret_cast<const uint4*>(d)[vec]);
    }
    for (int off = group / 2; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffff, s, off);
    if (owned && vec == 0) {
      p.dsum[acc0 + row] = s;
      // lse is +inf for rows that saw no key; exp2(score - inf) = 0 keeps them out of every gradient.
      p.lse_log2[acc0 + row] = valid ? p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + q_row] *
                                           1.4426950408889634f
                                     : __int_as_float(0x7f800000);
      if (p.dq_semaphore != nullptr) p.dq_semaphore[acc0 + row] = 0;
    }
  }

  // Zero this CTA's rows of the dQ accumulator (dq_accum_cols is a multiple of 16: float4 stores).
  const int rows = min(kAuxRows, rows_total - row_begin);
  float4* acc = reinterpret_cast<float4*>(p.dq_accum + (acc0 + row_begin) * p.dq_accum_cols);
  for (int i = threadIdx.x; i < rows * p.dq_accum_cols / 4; i += kAuxThreads) acc[i] = make_float4(0, 0, 0, 0);
}

template <bool kBf16>
__device__ __forceinline__ void bwd_convert_dq(BwdParams const& p) {
  const int head = blockIdx.y;
  int batch, row_begin;
  SeqInfo seq;
  if (!aux_block(p, [](int len) { return len; }, batch, row_begin, seq)) return;
  const int64_t acc0 = acc_row0(p, p.cu_seqlens_q != nullptr, batch, head, seq.q_start);
  const int chunks = p.head_dim / 8;
  for (int i = threadIdx.x; i < kAuxRows * chunks; i += kAuxThreads) {
    const int row = row_begin + i / chunks, chunk = i % chunks;
    if (row >= seq.seqlen_q) break;
    const float4* src = reinterpret_cast<const float4*>(p.dq_accum + (acc0 + row) * p.dq_accum_cols) + 2 * chunk;
    const float4 a = src[0], b = src[1];
    const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    unsigned w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[j] = from_float<kBf16>(f[2 * j] * p.softmax_scale) |
             (static_cast<unsigned>(from_float<kBf16>(f[2 * j + 1] * p.softmax_scale)) << 16);
    }
    auto* dq = static_cast<unsigned short*>(p.dq) + batch * p.dq_batch_stride + (seq.q_start + row) * p.dq_row_stride +
               head * p.dq_head_stride;
    reinterpret_cast<uint4*>(dq)[chunk] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

}  // namespace flash_gen
