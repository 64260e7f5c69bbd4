// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) and where attention
// dropout draws each score's random bits from. Plain C++ with no CUDA dependency beyond __umulhi, so the host
// compiler builds it too: tests/test_dropout_rng.py checks it against flash_gen.reference.dropout_keep.
//
// Score (b, h, i, j) (entry, query head, query row, key column) takes 16 of the 128 bits of one Philox block:
//   counter = (j / 16, (i / 16) * 32 + (i % 8) * 4 + (j % 8) / 2, h, b), key = the call's 64-bit seed,
//   slot    = ((j % 16) / 8) * 4 + ((i % 16) / 8) * 2 + j % 2, bits [16 * (slot % 2), +16) of word slot / 2,
// and is kept when those bits are below keep_threshold = round((1 - dropout_p) * 65536). A block covers the
// eight scores one lane holds of a 16 x 16 score tile in the m16n8 MMA accumulator layout (second counter word:
// lane = (i % 8) * 4 + (j % 8) / 2), so a kernel holding both n8 halves of the tile draws once per 8 scores.
#pragma once
#if defined(__CUDACC_RTC__)
#include <cuda/std/cstdint>
using cuda::std::uint32_t;
using cuda::std::uint64_t;
#else
#include <cstdint>
#endif

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define FLASH_GEN_HD __host__ __device__ __forceinline__
#else
#define FLASH_GEN_HD inline
#endif

namespace flash_gen {

struct PhiloxBlock {
  uint32_t w[4];
};

FLASH_GEN_HD uint32_t mul_hi_u32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return uint32_t((uint64_t(a) * b) >> 32);
#endif
}

FLASH_GEN_HD PhiloxBlock philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                       uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = mul_hi_u32(kMul0, c0), lo0 = kMul0 * c0;
    const uint32_t hi1 = mul_hi_u32(kMul1, c2), lo1 = kMul1 * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return PhiloxBlock{{c0, c1, c2, c3}};
}

// The block holding score (b, h, i, j)'s bits (see the top of this file); seed = (k1 << 32) | k0.
FLASH_GEN_HD PhiloxBlock dropout_block(uint32_t k0, uint32_t k1, int b, int h, int i, int j) {
  const uint32_t lane = uint32_t(i % 8) * 4 + uint32_t(j % 8) / 2;
  return philox4x32_10(uint32_t(j / 16), uint32_t(i / 16) * 32 + lane, uint32_t(h), uint32_t(b), k0, k1);
}

FLASH_GEN_HD int dropout_slot(int i, int j) { return ((j % 16) / 8) * 4 + ((i % 16) / 8) * 2 + j % 2; }

FLASH_GEN_HD uint32_t dropout_bits(PhiloxBlock const& block, int slot) {
  return (block.w[slot / 2] >> (16 * (slot % 2))) & 0xFFFFu;
}

}  // namespace flash_gen
