// fp32 register tensors to fp16/bf16 two elements per instruction (cvt.rn.{f16,bf16}x2.f32, one F2FP each).
// In the Hopper forward, per-element casts (sm80_utils' convert_to) compiled to one F2FP per element plus the
// PRMT/LOP3 that pack the halves: about four instructions per pair, a fifth of all issued instructions. (In the
// portable kernels ptxas pairs the casts itself: their SASS is the same either way, 2026-11-30.)
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace flash_gen {

// Two fp32 values as one 32-bit register of 16-bit elements, `lo` in the low half.
template <class To>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  uint32_t d;
  if constexpr (cute::is_same_v<To, cutlass::bfloat16_t>) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  } else {
    static_assert(cute::is_same_v<To, cutlass::half_t>, "fp16 or bf16");
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  }
  return d;
}

// dst = src element by element, for register tensors of one layout (storage index i of dst gets storage index i of
// src, so any layout works as long as both share it).
template <class SrcEngine, class DstEngine, class Layout>
__device__ __forceinline__ void convert_pairs(cute::Tensor<SrcEngine, Layout> const& src,
                                              cute::Tensor<DstEngine, Layout>& dst) {
  using To = typename DstEngine::value_type;
  constexpr int kSize = decltype(cute::size(Layout{}))::value;
  static_assert(kSize % 2 == 0 && decltype(cute::cosize(Layout{}))::value == kSize, "compact, even-sized");
  uint32_t* out = reinterpret_cast<uint32_t*>(cute::raw_pointer_cast(dst.data()));
  CUTE_UNROLL
  for (int i = 0; i < kSize / 2; ++i) out[i] = pack_pair<To>(src.data()[2 * i], src.data()[2 * i + 1]);
}

}  // namespace flash_gen
