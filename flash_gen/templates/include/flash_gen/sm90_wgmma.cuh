// wgmma helpers shared by the Hopper forward and backward kernels: issuing one GEMM's wgmmas as a batch, and views
// of a wgmma accumulator as (rows, cols) and as the register A operand of the next wgmma.
#pragma once
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

namespace flash_gen {
using namespace cute;

// Issue the wgmmas of one GEMM as one batch (waited for with warpgroup_wait). kZeroInit overwrites the accumulator;
// kSteps > 0 computes only the first kSteps k-blocks of the operands' partitions (A, B: (MMA, M or N, K)).
template <bool kZeroInit, int kSteps = 0, class Mma, class A, class B, class C>
__device__ __forceinline__ void wgmma_issue(Mma& mma, A const& a, B const& b, C& c) {
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < (kSteps > 0 ? kSteps : int(size<2>(a))); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
}

// A wgmma accumulator ((2, 2, N/8), M, N) as (rows, cols) = ((2, M), (2, N/8, N)).
template <class Layout>
__device__ __forceinline__ auto gmma_rowcol(Layout const& l) {
  return make_layout(make_layout(layout<0, 1>(l), layout<1>(l)),
                     make_layout(layout<0, 0>(l), layout<0, 2>(l), layout<2>(l)));
}

// The same accumulator as the register A operand ((2, 2, 2), M, K/16) of the next wgmma: two adjacent n8 column
// groups hold one k16 slice.
template <class Layout>
__device__ __forceinline__ auto gmma_acc_as_a(Layout const& l) {
  auto cols = logical_divide(layout<0, 2>(l), Shape<_2>{});  // ((2, N/16))
  return make_layout(make_layout(layout<0, 0>(l), layout<0, 1>(l), layout<0, 0>(cols)), layout<1>(l),
                     make_layout(layout<0, 1>(cols), layout<2>(l)));
}

}  // namespace flash_gen
