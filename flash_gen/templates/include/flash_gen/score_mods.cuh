// What the forward kernels apply to a score tile before masking: softcap and ALiBi.
#pragma once
#include "flash_gen/attn_mask.cuh"

namespace flash_gen {

// tanh on the SFU (MUFU.TANH, relative error about 2^-11), as FlashAttention-3 caps scores: tanhf takes two MUFU
// operations and a polynomial per score, beside the softmax's one exp2. The forward and the backward both use it,
// so the backward recomputes the very P the forward normalised.
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// s (rows, cols) of the tile at (row0, col0), rc its coordinates: with kSoftcap s = tanh(s * score_scale) (the
// softmax's scale_log2 then carries the cap), with kAlibi s -= slope * |i + diag - j|.
template <bool kSoftcap, bool kAlibi, class S, class RC>
__device__ __forceinline__ void apply_score_mods(S& s, RC const& rc, int row0, int col0, int diag, float score_scale,
                                                 float slope) {
  if constexpr (kSoftcap) {
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) s(i) = fast_tanh(s(i) * score_scale);
  }
  if constexpr (kAlibi) add_alibi(s, rc, row0, col0, diag, slope);
}

}  // namespace flash_gen
