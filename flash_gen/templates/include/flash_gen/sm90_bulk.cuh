// Bulk asynchronous copies (sm_90a): loads from global to shared memory completing on an mbarrier, and reductions
// of a TMA map's box from shared to global memory in the bulk groups of sm90_sync.cuh (which the TMA stores share).
// Kept out of sm90_sync.cuh, which every Hopper kernel includes: only the backward uses these.
#pragma once
#include "flash_gen/sm90_sync.cuh"  // MBarrier, smem_u32, uint32_t

namespace flash_gen {

// smem[i] = gmem[i] over `bytes` (a multiple of 16; both addresses 16-byte aligned), counted on `bar`.
__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, uint32_t bytes, MBarrier& bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(smem)),
               "l"(gmem), "r"(bytes), "r"(smem_u32(&bar.word))
               : "memory");
}

// TMA, 4-D: the map's box at (c0, c1, 0, 0) += the box in shared memory (fp32 adds), in this thread's current
// bulk group.
__device__ __forceinline__ void tma_reduce_add_4d(const TensorMap& map, const void* smem, int c0, int c1) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %4}], [%1];" ::"l"(
          &map),
      "r"(smem_u32(smem)), "r"(c0), "r"(c1), "r"(0)
      : "memory");
}

// Wait until this thread's committed bulk groups have completed, their global writes included.
__device__ __forceinline__ void bulk_wait_done() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

}  // namespace flash_gen
