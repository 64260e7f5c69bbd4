// Attention dropout on the Hopper backward's transposed score tiles (S^T: keys as the wgmma's rows): the keep
// decisions of dropout.cuh's rule as bits, drawn once per 8 scores as the forward draws them.
#pragma once
#include "flash_gen/dropout.cuh"

namespace flash_gen {

// keep(v) of every element v of a transposed score tile (S^T: keys as rows, queries as columns) in a wgmma
// accumulator, as bits: bit v % 32 of keep[v / 32]. cS: the elements' (key, query) coordinates within the tile at
// (query row0, key col0) of the entry. A lane holds keys j and j + 8 and, per 16 queries, queries i, i + 8 (i even)
// and i + 1, i + 9: two Philox blocks (i % 8 is in the counter), each of whose 8 slots the lane needs 4 (j % 2 is
// fixed). Lanes r and r ^ 1 of the accumulator's row groups (lane ^ 4) hold keys j ^ 1, j ^ 1 + 8 of the same
// blocks, so each draws one block (query i + j % 2) and passes the other the halves it needs: a block per 8 scores,
// as in the forward.
template <int kWords, class CS>
__device__ __forceinline__ void dropout_keep_bits_t(uint32_t (&keep)[kWords], CS const& cS, int row0, int col0,
                                                    DropoutRng const& rng) {
  using namespace cute;
  constexpr int kN = decltype(size(cS))::value;
  static_assert(kWords * 32 >= kN);
  const int key0 = get<0>(cS(0)), q0 = get<1>(cS(0));
  const uint32_t odd = uint32_t(key0 & 1);
  // __byte_perm selectors: the low (even keys) or high (odd keys) halves of two words, packed into one.
  const uint32_t mine = odd ? 0x7632u : 0x5410u, theirs = odd ? 0x5410u : 0x7632u;
  CUTE_UNROLL
  for (int w = 0; w < kWords; ++w) keep[w] = 0;
  int i0 = row0 + q0 + int(odd);
  CUTE_UNROLL
  for (int c = 0; c < (kN + 7) / 8; ++c) {  // 16 queries: 8 of the lane's elements
    const PhiloxBlock block = dropout_block(rng.k0, rng.k1, rng.b, rng.h, i0 + 16 * c, col0 + key0);
    // Packed pairs (word 0 or 2 in the low half, 1 or 3 in the high): word 2 * (key offset / 8) + (query offset / 8)
    // % 2 of the block of queries with the offset's parity.
    const uint32_t own01 = __byte_perm(block.w[0], block.w[1], mine), own23 = __byte_perm(block.w[2], block.w[3], mine);
    const uint32_t got01 = __shfl_xor_sync(0xffffffffu, __byte_perm(block.w[0], block.w[1], theirs), 4);
    const uint32_t got23 = __shfl_xor_sync(0xffffffffu, __byte_perm(block.w[2], block.w[3], theirs), 4);
    const uint32_t even01 = odd ? got01 : own01, even23 = odd ? got23 : own23;
    const uint32_t odd01 = odd ? own01 : got01, odd23 = odd ? own23 : got23;
    CUTE_UNROLL
    for (int v = 0; v < kN; ++v) {
      const int dq = get<1>(cS(v)) - q0, dk = get<0>(cS(v)) - key0;  // constants once unrolled
      if (dq / 16 != c) continue;
      const uint32_t pair = dk >= 8 ? (dq % 2 ? odd23 : even23) : (dq % 2 ? odd01 : even01);
      const uint32_t bits = (dq / 8) % 2 ? pair >> 16 : pair & 0xFFFFu;
      keep[v / 32] |= uint32_t(bits < rng.threshold) << (v % 32);
    }
    // The next block's counter through an opaque dependence on this one's bits: one block at a time, as the
    // compiler would otherwise interleave them, at a Philox state's registers each, beside in-flight accumulators.
    asm volatile("" : "+r"(i0) : "r"(keep[0]));
  }
}

__device__ __forceinline__ bool kept_bit(uint32_t const* keep, int v) { return (keep[v / 32] >> (v % 32)) & 1u; }

}  // namespace flash_gen
