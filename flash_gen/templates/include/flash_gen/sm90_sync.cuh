// Hopper synchronisation and data-movement primitives as thin PTX wrappers (sm_90a): mbarriers with transaction
// counts, TMA tile loads completing on them, named barriers between warpgroups, and register reallocation.
#pragma once
#include <cute/config.hpp>
#include <cute/numeric/int.hpp>

#include "flash_gen/fwd_sm90_params.cuh"  // TensorMap

namespace flash_gen {

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// An mbarrier in shared memory. Phases alternate 0, 1, 0...; wait(parity) returns once the phase with that
// parity has completed, so a fresh barrier's wait(1) returns at once (the "previous" phase counts as done).
struct MBarrier {
  uint64_t word;

  __device__ __forceinline__ void init(int arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(&word)), "r"(arrivals));
  }
  // One arrival that also announces `bytes` of TMA traffic the phase waits for.
  __device__ __forceinline__ void arrive_expect_tx(uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&word)), "r"(bytes)
                 : "memory");
  }
  __device__ __forceinline__ void arrive() {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(&word)) : "memory");
  }
  __device__ __forceinline__ bool try_wait(uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_u32(&word)), "r"(parity)
        : "memory");
    return done;
  }
  __device__ __forceinline__ void wait(uint32_t parity) {
    while (!try_wait(parity)) {
    }
  }
};

// Makes mbarrier.init visible to the async proxy (TMA) before any thread uses the barriers.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void prefetch_tensor_map(const TensorMap& map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(&map) : "memory");
}

// TMA: the box of a 4-D tensor map at coordinates (c0 innermost .. c3) into shared memory, counted on `bar`.
// Rows past the tensor's extent arrive as zeros and still count toward the transaction bytes.
__device__ __forceinline__ void tma_load_4d(const TensorMap& map, MBarrier& bar, void* smem, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];" ::"r"(smem_u32(smem)),
      "l"(&map), "r"(smem_u32(&bar.word)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// TMA, 5-D: the box at (c0 .. c4) into shared memory, counted on `bar`. The forward's Q map is 5-D
// (head_dim, heads of a group, seqlen, groups, batch) so that one box can stack a GQA group's heads row by row.
__device__ __forceinline__ void tma_load_5d(const TensorMap& map, MBarrier& bar, void* smem, int c0, int c1, int c2,
                                            int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, "
      "%7}], [%2];" ::"r"(smem_u32(smem)),
      "l"(&map), "r"(smem_u32(&bar.word)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

// TMA: a box of shared memory to a 5-D tensor map at (c0 .. c4); elements past the tensor's extent are not written.
__device__ __forceinline__ void tma_store_5d(const TensorMap& map, const void* smem, int c0, int c1, int c2, int c3,
                                             int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];" ::"l"(&map),
      "r"(smem_u32(smem)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

// Close this thread's current bulk group (its TMA stores and bulk copies since the last commit).
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Wait until this thread's committed bulk groups have read their shared memory (it may then be rewritten).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// Orders this thread's generic-proxy shared-memory writes before later async-proxy (TMA, wgmma) reads.
__device__ __forceinline__ void fence_smem_for_async_proxy() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Named barriers (ids 1..15; 0 is __syncthreads) over `threads` threads, a multiple of 32.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Hand registers between warpgroups: the producer gives up what it does not need, the consumers take it.
template <int kRegs>
__device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

}  // namespace flash_gen
