// The two memory-bound kernels around the main backward kernel. They take the head dim at run time, so one
// compile per (arch, dtype) serves every head dim, and they include no CuTe (seconds to compile, not a minute).
//  - bwd_preprocess: dsum = rowsum(dO * O) and lse in base 2, padded to the main kernel's row tiling, and
//    zeroes the fp32 dQ accumulator and the determinism semaphores (so no separate fill kernel runs).
//  - bwd_convert_dq: dQ = softmax_scale * dq_accum, in the input dtype, written through dQ's strides.
#pragma once
#include "flash_gen/bwd_params.cuh"

namespace flash_gen {

constexpr int kAuxThreads = 128;
constexpr int kAuxRows = 32;  // rows per CTA: grid = (ceil(rows / kAuxRows), nheads, batch)

// 16-bit element <-> fp32 for bf16 (kBf16) or fp16, on raw bits so no cuda_fp16/cuda_bf16 header is needed.
template <bool kBf16>
__device__ __forceinline__ float to_float(unsigned short bits) {
  if constexpr (kBf16) {
    return __uint_as_float(static_cast<unsigned>(bits) << 16);
  } else {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
    return f;
  }
}

template <bool kBf16>
__device__ __forceinline__ unsigned short from_float(float f) {
  unsigned short bits;
  if constexpr (kBf16) {
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(f));
  } else {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(f));
  }
  return bits;
}

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

template <bool kBf16>
__device__ __forceinline__ void bwd_preprocess(BwdParams const& p) {
  const int head = blockIdx.y, batch = blockIdx.z;
  const int row_begin = blockIdx.x * kAuxRows;
  const int64_t bh = int64_t(batch) * p.nheads + head;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int chunks = p.head_dim / 8;  // 16-byte vectors per row; head_dim is a multiple of 8, <= 256

  // One warp per row: lane i reads vector i of dO and O, then the warp reduces.
  for (int r = warp; r < kAuxRows; r += kAuxThreads / 32) {
    const int row = row_begin + r;
    if (row >= p.seqlen_q_rounded) break;
    float s = 0.f;
    if (row < p.seqlen_q && lane < chunks) {
      const auto* o = static_cast<const unsigned short*>(p.o) + batch * p.o_batch_stride + row * p.o_row_stride +
                      head * p.o_head_stride;
      const auto* d = static_cast<const unsigned short*>(p.dout) + batch * p.do_batch_stride +
                      row * p.do_row_stride + head * p.do_head_stride;
      s = dot8<kBf16>(reinterpret_cast<const uint4*>(o)[lane], reinterpret_cast<const uint4*>(d)[lane]);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffff, s, off);
    if (lane == 0) {
      const bool valid = row < p.seqlen_q;
      p.dsum[bh * p.seqlen_q_rounded + row] = s;
      // lse is +inf for rows that saw no key; exp2(score - inf) = 0 keeps them out of every gradient.
      p.lse_log2[bh * p.seqlen_q_rounded + row] =
          valid ? p.lse[bh * p.seqlen_q + row] * 1.4426950408889634f : __int_as_float(0x7f800000);
    }
  }

  // Zero this CTA's rows of the dQ accumulator (dq_accum_cols is a multiple of 16: float4 stores).
  const int rows = min(kAuxRows, p.seqlen_q_rounded - row_begin);
  float4* acc = reinterpret_cast<float4*>(p.dq_accum + (bh * p.seqlen_q_rounded + row_begin) * p.dq_accum_cols);
  for (int i = threadIdx.x; i < rows * p.dq_accum_cols / 4; i += kAuxThreads) acc[i] = make_float4(0, 0, 0, 0);

  // Semaphore m of this (batch, head) is zeroed by the CTA whose row range holds index m (there are fewer
  // m blocks than rows, so every one is covered).
  if (p.dq_semaphore != nullptr) {
    for (int m = row_begin + threadIdx.x; m < row_begin + rows && m < p.num_m_blocks; m += kAuxThreads) {
      p.dq_semaphore[bh * p.num_m_blocks + m] = 0;
    }
  }
}

template <bool kBf16>
__device__ __forceinline__ void bwd_convert_dq(BwdParams const& p) {
  const int head = blockIdx.y, batch = blockIdx.z;
  const int row_begin = blockIdx.x * kAuxRows;
  const int64_t bh = int64_t(batch) * p.nheads + head;
  const int chunks = p.head_dim / 8;
  for (int i = threadIdx.x; i < kAuxRows * chunks; i += kAuxThreads) {
    const int row = row_begin + i / chunks, chunk = i % chunks;
    if (row >= p.seqlen_q) break;
    const float4* src =
        reinterpret_cast<const float4*>(p.dq_accum + (bh * p.seqlen_q_rounded + row) * p.dq_accum_cols) + 2 * chunk;
    const float4 a = src[0], b = src[1];
    const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    unsigned w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[j] = from_float<kBf16>(f[2 * j] * p.softmax_scale) |
             (static_cast<unsigned>(from_float<kBf16>(f[2 * j + 1] * p.softmax_scale)) << 16);
    }
    auto* dq = static_cast<unsigned short*>(p.dq) + batch * p.dq_batch_stride + row * p.dq_row_stride +
               head * p.dq_head_stride;
    reinterpret_cast<uint4*>(dq)[chunk] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

}  // namespace flash_gen
