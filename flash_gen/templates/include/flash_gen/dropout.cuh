// Attention dropout on score tiles in the m16n8 MMA accumulator layout (the portable kernels): which scores are
// kept (philox.cuh draws the bits), for the forward's P before P V and the backward's P and dS.
#pragma once
#include <cute/tensor.hpp>

#include "flash_gen/philox.cuh"

namespace flash_gen {

// The call's seed, the keep threshold and the (entry, query head) whose scores a CTA draws.
struct DropoutRng {
  uint32_t k0, k1, threshold;
  int b, h;
};

template <bool kDropout, class Params>
__device__ __forceinline__ DropoutRng make_dropout_rng(Params const& p, int batch, int head) {
  if constexpr (kDropout) {
    const uint64_t seed = uint64_t(p.rng_state[0]);
    return DropoutRng{uint32_t(seed), uint32_t(seed >> 32), p.dropout_threshold, batch, head};
  } else {
    return DropoutRng{0, 0, 0, batch, head};
  }
}

// keep(s(r, c), kept) for every score of s (rows, cols), an acc_rowcol view of an m16n8 accumulator whose
// coordinates rc are relative to the tile at (row0, col0) of the entry: rows r = half + 2 * m16 block, cols
// c = pair element + 2 * n8 block. One Philox block serves the eight scores a lane holds of a 16 x 16 tile;
// kPairedN8: this thread's n8 blocks 2t and 2t + 1 are the two halves of one such tile (warps that do not split
// the tile's columns), else each n8 block draws its own block and takes its half.
template <bool kPairedN8, class S, class RC, class Keep>
__device__ __forceinline__ void dropout_scores(S& s, RC const& rc, int row0, int col0, DropoutRng const& rng,
                                               Keep&& keep) {
  using namespace cute;
  constexpr int kM16 = decltype(size<0>(s))::value / 2, kN8 = decltype(size<1>(s))::value / 2;
  constexpr int kStep = kPairedN8 ? 2 : 1;
  static_assert(!kPairedN8 || kN8 % 2 == 0, "paired n8 blocks");
  CUTE_UNROLL
  for (int m = 0; m < kM16; ++m) {
    CUTE_UNROLL
    for (int t = 0; t < kN8; t += kStep) {
      const int i = row0 + get<0>(rc(2 * m, 2 * t)), j = col0 + get<1>(rc(2 * m, 2 * t));
      const PhiloxBlock block = dropout_block(rng.k0, rng.k1, rng.b, rng.h, i, j);
      CUTE_UNROLL
      for (int u = 0; u < kStep; ++u) {
        // Words 2 * half + row half of the block: a half known at compile time when paired, else j's (selects,
        // not a dynamic index into the block, which would put it in local memory).
        const bool high = kPairedN8 ? u == 1 : (j / 8) % 2 == 1;
        CUTE_UNROLL
        for (int hh = 0; hh < 2; ++hh) {
          const uint32_t word = high ? block.w[2 + hh] : block.w[hh];
          CUTE_UNROLL
          for (int e = 0; e < 2; ++e) {
            keep(s(2 * m + hh, 2 * (t + u) + e), ((word >> (16 * e)) & 0xFFFFu) < rng.threshold);
          }
        }
      }
    }
  }
}

// The probabilities the dV GEMM takes, in `To`: kept ones scaled, dropped ones (sign bit set by the backward's
// keep function) 0.
template <class To, class Engine, class Layout>
__device__ __forceinline__ auto kept_probs(cute::Tensor<Engine, Layout> const& t, float scale) {
  using namespace cute;
  Tensor out = make_tensor<To>(t.layout());
  CUTE_UNROLL
  for (int i = 0; i < size(t); ++i) out(i) = static_cast<To>(fmaxf(t(i), 0.f) * scale);
  return out;
}

}  // namespace flash_gen
