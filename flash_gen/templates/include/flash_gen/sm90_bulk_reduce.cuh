// Bulk asynchronous reductions from shared to global memory (sm_90a) and the per-thread groups that track them.
// Kept out of sm90_sync.cuh, which every Hopper kernel includes: only the backward's bulk dQ uses these.
#pragma once
#include "flash_gen/sm90_sync.cuh"  // smem_u32, uint32_t

namespace flash_gen {

// gmem[i] += smem[i] over `bytes` (a multiple of 16; both addresses 16-byte aligned) of fp32, in this thread's
// current bulk group.
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem, const float* smem, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(gmem),
               "r"(smem_u32(smem)), "r"(bytes)
               : "memory");
}

// Close this thread's current bulk group (its bulk operations since the last commit).
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Wait until this thread's committed bulk groups have read their shared memory (it may then be rewritten).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// Wait until this thread's committed bulk groups have completed, their global writes included.
__device__ __forceinline__ void bulk_wait_done() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

}  // namespace flash_gen
