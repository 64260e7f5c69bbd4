// Parameters of the Hopper forward kernel (fwd_sm90.cuh); mirrored by flash_gen.runtime.fwd.Sm90FwdParams.
#pragma once
#include "flash_gen/fwd_params.cuh"

namespace flash_gen {

// A CUtensorMap as filled on the host by cuTensorMapEncodeTiled (flash_gen/runtime/tma.py), passed inside a
// __grid_constant__ parameter so that TMA instructions can address it.
struct alignas(64) TensorMap {
  unsigned char bytes[128];
};

// The portable kernel's parameters after TMA maps of q, k, v, o (b, s, h, d) with boxes of 64 columns by one
// consumer warpgroup's 64 rows (q, o) or by a key tile's rows (k, v).
struct Sm90FwdParams {
  TensorMap tma_q, tma_k, tma_v, tma_o;
  FwdParams base;
  // Aligned-rows kernels (kAlign): whether KV head h's rows of K (shift Q and K) and of V (shift V, and O back)
  // start 16 bytes into a 32-byte sector, as bit 0 ^ (bit 1 & h) (bit 0: head 0; bit 1: the head stride is an odd
  // number of 16-byte chunks); 0 where the sequence or batch stride would make it vary by row (sm90_col_shift).
  int qk_shift_bits, v_shift_bits;
  // Stream-K kernels (kStreamK, fwd_sm90.cuh sm90_work_of_round): a flag per (CTA, consumer warpgroup) counting
  // the writers and readers of its partial; the rounds of whole tiles, the tiles left after them, every tile's key
  // steps and each CTA's share of the left tiles' steps (0: whole tiles only, the launch's tiles then being
  // sk_rounds x the grid + sk_tiles).
  unsigned* sk_flags;
  int sk_rounds, sk_tiles, sk_steps, sk_chunk;
  // Persistent kernels under right-bounded masks (Sm90Tile): the width in (batch, head) pairs of the sections
  // their tiles are taken by length in; 0: the kernel's own (kL2SectionBytes, at least a round of tiles).
  int section_pairs;
};

// Columns to shift KV head `head`'s boxes by: 8 (16 bytes) where its rows start mid-sector, so the boxes after the
// first start on a sector. Any shift is correct when Q and K share it, and when O's columns are moved back by V's:
// it moves columns into the computed head dim's zero padding.
__device__ __forceinline__ int sm90_col_shift(int bits, int head) { return ((bits ^ ((bits >> 1) & head)) & 1) * 8; }

}  // namespace flash_gen
