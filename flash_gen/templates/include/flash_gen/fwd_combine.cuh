// Split-KV combine: merges the num_splits partial results of the split forward kernel into the output and its
// lse. Split s holds O_s normalised over its own keys and lse_s (-inf when it saw none), so
//   lse = log(sum_s exp(lse_s)),   O = sum_s exp(lse_s - lse) * O_s,
// with the largest lse_s subtracted first for range. Takes the head dim at run time (one compile per dtype
// serves every head dim) and includes no CuTe. One warp per query row; lane i owns head-dim elements
// [8i, 8i + 8).
#pragma once
#include "flash_gen/fwd_params.cuh"
#include "flash_gen/half_bits.cuh"

namespace flash_gen {

constexpr int kCombineThreads = 128;
constexpr int kCombineRows = kCombineThreads / 32;  // grid = (ceil(seqlen_q / kCombineRows), nheads, batch)

template <bool kBf16>
__device__ __forceinline__ void fwd_combine(FwdParams const& p) {
  const int head_dim = p.head_dim;
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kCombineRows + threadIdx.x / 32;
  const int head = blockIdx.y, batch = blockIdx.z;
  if (row >= p.seqlen_q) return;
  const int64_t split_stride = int64_t(p.batch) * p.nheads * p.seqlen_q;  // rows per split
  const int64_t bhr = (int64_t(batch) * p.nheads + head) * p.seqlen_q + row;

  float lse_max = -__int_as_float(0x7f800000);
  for (int s = lane; s < p.num_splits; s += 32) lse_max = fmaxf(lse_max, p.lse_partial[s * split_stride + bhr]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffff, lse_max, off));
  const bool empty = lse_max == -__int_as_float(0x7f800000);  // no split saw a key
  float sum = 0.f;
  if (!empty) {
    for (int s = lane; s < p.num_splits; s += 32) sum += __expf(p.lse_partial[s * split_stride + bhr] - lse_max);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
  const float lse = empty ? __int_as_float(0x7f800000) : lse_max + __logf(sum);

  float acc[8] = {};
  const int col = lane * 8;
  if (!empty && col < head_dim) {
    for (int s = 0; s < p.num_splits; ++s) {
      const float lse_s = p.lse_partial[s * split_stride + bhr];
      if (lse_s == -__int_as_float(0x7f800000)) continue;  // its O was never written
      const float w = __expf(lse_s - lse);
      const float4* src = reinterpret_cast<const float4*>(p.o_partial + (s * split_stride + bhr) * head_dim + col);
      const float4 a = src[0], b = src[1];
      acc[0] += w * a.x, acc[1] += w * a.y, acc[2] += w * a.z, acc[3] += w * a.w;
      acc[4] += w * b.x, acc[5] += w * b.y, acc[6] += w * b.z, acc[7] += w * b.w;
    }
  }
  if (col < head_dim) {
    unsigned w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[j] = from_float<kBf16>(acc[2 * j]) | (static_cast<unsigned>(from_float<kBf16>(acc[2 * j + 1])) << 16);
    }
    auto* o = static_cast<unsigned short*>(p.o) + batch * p.o_batch_stride + row * p.o_row_stride +
              head * p.o_head_stride + col;
    *reinterpret_cast<uint4*>(o) = make_uint4(w[0], w[1], w[2], w[3]);
  }
  if (lane == 0) p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + row] = lse;
}

}  // namespace flash_gen
