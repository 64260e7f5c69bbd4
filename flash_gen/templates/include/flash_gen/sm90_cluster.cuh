// Thread-block cluster primitives (sm_90a) for kernels whose CTAs share TMA loads: multicast tile loads, arrivals
// on another CTA's mbarrier, the CTA's rank and a cluster-wide barrier.
#pragma once
#include "flash_gen/sm90_sync.cuh"

namespace flash_gen {

// This CTA's rank in its cluster.
__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// A barrier over every thread of every CTA in the cluster (threads arrive one by one, not as whole warps;
// release/acquire order shared-memory accesses across the CTAs).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

// One arrival on the barrier at `bar`'s offset in the shared memory of cluster CTA `cta`. Default semantics
// (release at CTA scope, as CUTLASS's cluster barriers use): what it orders are wgmma reads this thread has already
// waited for, against that CTA's producer's next TMA writes; a cluster-scope release would fence every arrival.
__device__ __forceinline__ void arrive_in_cta(MBarrier& bar, uint32_t cta) {
  asm volatile(
      "{\n .reg .b32 remote;\n mapa.shared::cluster.u32 remote, %0, %1;\n"
      " mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(smem_u32(&bar.word)),
      "r"(cta)
      : "memory");
}

// TMA multicast: the box at (c0 .. c3) into shared memory at `smem`'s offset in every cluster CTA of `cta_mask`,
// each counting the bytes on its barrier at `bar`'s offset.
__device__ __forceinline__ void tma_load_4d_multicast(const TensorMap& map, MBarrier& bar, void* smem, int c0, int c1,
                                                      int c2, int c3, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, "
      "%4, %5, %6}], [%2], %7;" ::"r"(smem_u32(smem)),
      "l"(&map), "r"(smem_u32(&bar.word)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "h"(cta_mask)
      : "memory");
}

}  // namespace flash_gen
