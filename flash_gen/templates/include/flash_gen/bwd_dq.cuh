// How the backward kernels add a query tile's dQ partial into the fp32 dq_accum rows (shared by bwd_sm80.cuh and
// bwd_sm90.cuh).
#pragma once
#include <cute/tensor.hpp>

#include "flash_gen/bwd_params.cuh"

namespace flash_gen {

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// dst += acc for an MMA accumulator and its gmem partition, with reductions (no return value). Elements 2i and
// 2i+1 of an mma.sync or wgmma accumulator are adjacent columns of one row, so Hopper and newer add them as one
// 8-byte vector, halving the reductions the LSU pipe issues.
template <class Acc, class Dst>
__device__ __forceinline__ void red_add(Dst&& dst, Acc const& acc) {
  CUTE_UNROLL
  for (int i = 0; i < cute::size(acc); i += 2) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(&dst(i)), "f"(acc(i)), "f"(acc(i + 1)) : "memory");
#else
    atomicAdd(&dst(i), acc(i));
    atomicAdd(&dst(i + 1), acc(i + 1));
#endif
  }
}

// red_add of the dQ partial of the query tile whose first row is tile_row in the padded buffers. Deterministic
// kernels make the CTAs adding into one tile take turns in key-tile order, from the first key tile that sees the
// tile's first row (diag_row0 = that row + seqlen_k - seqlen_q), through the tile's semaphore, so every run adds in
// the same order. Every thread of the CTA calls it.
template <bool kDeterministic, bool kLeftBound, int kBlockN, class Acc, class Dst>
__device__ __forceinline__ void add_dq(BwdParams const& p, Dst&& dst, Acc const& acc, int64_t tile_row, int n_block,
                                       int diag_row0) {
  int* semaphore = nullptr;
  if constexpr (kDeterministic) {
    semaphore = p.dq_semaphore + tile_row;
    const int first = kLeftBound ? max(0, diag_row0 - p.window_left) / kBlockN : 0;
    if (threadIdx.x == 0) {
      while (ld_acquire(semaphore) != n_block - first) {
      }
    }
    __syncthreads();
  }
  red_add(dst, acc);
  if constexpr (kDeterministic) {
    __syncthreads();  // every thread's additions are issued before the turn passes on
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(semaphore, 1);
    }
  }
}

}  // namespace flash_gen
