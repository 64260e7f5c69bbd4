// S = Q K^T again for one warp's 16 rows of a key tile, by mma.sync from the Hopper forward's tiles in shared memory:
// the rare repair of a max-free step (fwd_sm90.cuh), which each warp decides alone, where a wgmma would need all
// four warps of the warpgroup to agree on it (a warpgroup vote cost the 192-row tilings their spill-free form).
//
// An m16n8k16 accumulator has the per-warp layout of the wgmma one: s_rc(r, c) (gmma_rowcol) is row 8 r + lane / 4
// of the warp's 16 and column 8 (c / 2) + 2 (lane % 4) + c % 2 of the key tile, i.e. register 2 r + c % 2 of the
// c / 2-th n8 tile. Q (rows x head dim) and K (keys x head dim) are K-major and swizzled in 16-byte chunks, so each
// 8x8 ldmatrix row is one 16-byte chunk at a swizzled address the tensors' layouts give.
#pragma once
#include "flash_gen/sm80_ldsm.cuh"
#include "flash_gen/sm80_utils.cuh"

namespace flash_gen {

template <class SQ, class SK, class S>
__device__ __forceinline__ void warp_scores(SQ const& sQ, SK const& sK, int row0, S& s_rc) {
  using Element = typename SQ::value_type;
  using Mma = typename Sm80MmaAtom<Element>::MMA_Op;
  constexpr int kD = decltype(size<1>(sQ))::value;
  constexpr int kBlockN = decltype(size<0>(sK))::value;
  static_assert(kD % 16 == 0 && kBlockN % 16 == 0);
  static_assert(decltype(size<0>(s_rc))::value == 2 && decltype(size<1>(s_rc))::value == kBlockN / 4);
  const int lane = threadIdx.x % 32;
  auto smem_addr = [](auto const& element) { return uint32_t(__cvta_generic_to_shared(&element)); };
  CUTE_UNROLL
  for (int i = 0; i < size(s_rc); ++i) s_rc(i) = 0.f;
#pragma unroll 1
  for (int k0 = 0; k0 < kD; k0 += 16) {
    // A: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15), lane l giving
    // row l % 8 of matrix l / 8.
    uint32_t a[4];
    ldsm_x4(smem_addr(sQ(row0 + lane % 16, k0 + 8 * (lane / 16))), a[0], a[1], a[2], a[3]);
    CUTE_UNROLL
    for (int n16 = 0; n16 < kBlockN / 16; ++n16) {
      // B of two n8 tiles: (keys 0-7, k 0-7), (keys 0-7, k 8-15), then keys 8-15.
      uint32_t b[4];
      ldsm_x4(smem_addr(sK(16 * n16 + lane % 8 + 8 * (lane / 16), k0 + 8 * (lane / 8 % 2))), b[0], b[1], b[2], b[3]);
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int c = 2 * (2 * n16 + h);
        Mma::fma(s_rc(0, c), s_rc(0, c + 1), s_rc(1, c), s_rc(1, c + 1), a[0], a[1], a[2], a[3], b[2 * h],
                 b[2 * h + 1], s_rc(0, c), s_rc(0, c + 1), s_rc(1, c), s_rc(1, c + 1));
      }
    }
  }
}

}  // namespace flash_gen
