// Split-KV combine: merges the num_splits partial results of the split forward kernel into the output and its
// lse. Split s holds O_s normalised over its own keys and lse_s (-inf when it saw none), so
//   lse = log(sum_s exp(lse_s)),   O = sum_s exp(lse_s - lse) * O_s,
// with the largest lse_s subtracted first for range. Takes the head dim at run time (one compile per dtype
// serves every head dim) and includes no CuTe. Lane i owns head-dim elements [8i, 8i + 8). Decoding has few
// rows and many splits: one CTA per query row, whose warps share out the splits (warp w sums splits w,
// w + kCombineWarps, ...) and meet in shared memory. From kCombineWarps rows on (dense calls split over a
// short chunk of queries) each warp merges a row of its own, so CTAs do not idle on one row's load latency.
#pragma once
#include "flash_gen/fwd_params.cuh"
#include "flash_gen/half_bits.cuh"

namespace flash_gen {

constexpr int kCombineThreads = 256;
constexpr int kCombineWarps = kCombineThreads / 32;  // grid = (seqlen_q, nheads, batch)
constexpr int kCombineMaxHeadDim = 32 * 8;
constexpr int kMaxSplits = 128;                       // flash_gen.runtime.fwd._MAX_SPLITS

// Warps that share a query row (kCombineWarps / that many rows per CTA: the grid's x is seqlen_q over the rows per
// CTA, rounded up, as flash_gen.runtime.fwd._launch_split launches it).
__device__ __forceinline__ int combine_warps_per_row(int seqlen_q) {
  return seqlen_q >= kCombineWarps ? 1 : kCombineWarps;
}

template <bool kBf16>
__device__ __forceinline__ void fwd_combine(FwdParams const& p) {
  __shared__ float4 warp_sums[kCombineWarps - 1][kCombineMaxHeadDim / 4];  // warps 1.. hand theirs to warp 0
  const int head_dim = p.head_dim;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int warps_per_row = combine_warps_per_row(p.seqlen_q);
  const int row = blockIdx.x * (kCombineWarps / warps_per_row) + warp / warps_per_row, part = warp % warps_per_row;
  const int head = blockIdx.y, batch = blockIdx.z;
  if (row >= p.seqlen_q) return;  // only with a row per warp, which never meets at the barrier below
  const int64_t split_stride = int64_t(p.batch) * p.nheads * p.seqlen_q;  // rows per split
  const int64_t bhr = (int64_t(batch) * p.nheads + head) * p.seqlen_q + row;

  // Every warp works out the weights (a few L2-resident floats): lane l owns splits l, l + 32, ...
  const float kNegInf = -__int_as_float(0x7f800000);
  float lse_s[kMaxSplits / 32];
  float lse_max = kNegInf;
#pragma unroll
  for (int j = 0; j < kMaxSplits / 32; ++j) {
    const int s = lane + 32 * j;
    lse_s[j] = s < p.num_splits ? p.lse_partial[s * split_stride + bhr] : kNegInf;
    lse_max = fmaxf(lse_max, lse_s[j]);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffff, lse_max, off));
  const bool empty = lse_max == kNegInf;  // no split saw a key
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxSplits / 32; ++j) sum += empty || lse_s[j] == kNegInf ? 0.f : __expf(lse_s[j] - lse_max);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
  const float lse = empty ? __int_as_float(0x7f800000) : lse_max + __logf(sum);
  float weight[kMaxSplits / 32];  // 0 for a split that saw no key (its O was never written)
#pragma unroll
  for (int j = 0; j < kMaxSplits / 32; ++j) weight[j] = empty || lse_s[j] == kNegInf ? 0.f : __expf(lse_s[j] - lse);

  // This warp's share of the splits' weighted rows; the weights come by shuffle, so the O loads of consecutive
  // splits are independent and the unrolled loop keeps several in flight.
  float acc[8] = {};
  const int col = lane * 8;
  const bool active = col < head_dim;
#pragma unroll 4
  for (int s = part; s < p.num_splits; s += warps_per_row) {
    float w = 0.f;  // split s's weight, from lane s % 32's slot s / 32 (a static index: no local memory)
#pragma unroll
    for (int j = 0; j < kMaxSplits / 32; ++j) {
      const float wj = __shfl_sync(0xffffffff, weight[j], s % 32);
      w = s / 32 == j ? wj : w;
    }
    if (active) {
      const float4* src = reinterpret_cast<const float4*>(p.o_partial + (s * split_stride + bhr) * head_dim + col);
      const float4 a = src[0], b = src[1];
      const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += w == 0.f ? 0.f : w * v[i];  // select: never 0 * (unwritten NaN)
    }
  }
  if (warps_per_row > 1) {  // the CTA's one row: warps 1.. hand their sums to warp 0
    if (warp > 0 && active) {
      warp_sums[warp - 1][2 * lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      warp_sums[warp - 1][2 * lane + 1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
    __syncthreads();
    if (warp > 0) return;
    if (active) {
#pragma unroll
      for (int w = 0; w < kCombineWarps - 1; ++w) {
        const float4 a = warp_sums[w][2 * lane], b = warp_sums[w][2 * lane + 1];
        const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += v[i];
      }
    }
  }
  if (active) {
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
