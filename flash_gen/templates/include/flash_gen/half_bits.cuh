// 16-bit floating-point elements as raw bits, for the small kernels that include neither CuTe nor cuda_fp16 /
// cuda_bf16 (they compile in seconds): conversions to and from fp32 for bf16 (kBf16) or fp16.
#pragma once

namespace flash_gen {

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

}  // namespace flash_gen
