// ldmatrix from SmemTile-swizzled row-major tiles with hand-computed addresses.
//
// CuTe's ldmatrix copies apply the swizzle to each full (thread + static k-slice/tile) offset; XOR does not
// commute with the static part, so every (tile, k-slice) address is a separate runtime value that the compiler
// hoists into a live register (about 50 of them in the forward main loop). Here a lane's swizzled offset is
// computed once and shared by all operands; each ldmatrix adds at most one XOR with a constant, and the rest
// (tile bases, atoms, row tiles) are uniform registers and LDSM immediates.
//
// The fragments filled are the CuTe mma.sync m16n8k16 fragments of a TiledMMA whose warps tile M and share N
// and K (FwdTraits::TiledMma): A ((2,2,2), MMA_M, MMA_K) and B ((2,2), MMA_N, MMA_K). tests/test_ldsm_model.py
// checks the addressing against CuTe's swizzled layouts and the MMA fragment layouts on the CPU.
#pragma once
#include "flash_gen/sm80_utils.cuh"

namespace flash_gen {

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& d0, uint32_t& d1, uint32_t& d2, uint32_t& d3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t& d0, uint32_t& d1, uint32_t& d2,
                                              uint32_t& d3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3)
               : "r"(addr));
}

// Addressing of a row-major SmemTile<kCols> tile of 16-bit elements with kRows rows (per stage): atoms of
// 8 rows x kAtomCols, stacked down the rows first, then across the columns.
//
// Every operand is read in 16x16 blocks: lane l supplies row l % 16, 16-byte chunk l / 16 of the block, so
// the four 8x8 matrices are (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15,
// cols 8-15). The per-thread part of all addresses is then the same `lane_offset` for Q, K and V; a block
// at (row, col) with row a multiple of 8 and col a multiple of 16 is (lane_offset ^ 2 * (col % kAtomCols))
// + a constant + the tile base (warp-uniform). Within an atom, col flips chunk bits >= 1 while the lane's own chunk is
// bit 0, so the XOR equals the swizzled sum; whole atoms and rows keep the swizzle and are plain adds.
// The XOR acts on an offset, never on the base, so any 16-byte aligned base works.
template <int kCols, int kRows>
struct LdsmTile {
  static constexpr int kAtomCols = SmemTile<kCols>::kAtomCols;
  static constexpr int kBits = SmemTile<kCols>::kSwizzleBits;
  static constexpr int kRowBytes = 2 * kAtomCols;  // one row of one atom

  // Swizzle<kBits,3,3> on the element offset row*kAtomCols + 8*chunk XORs the chunk with row bits [3-kBits, 3).
  static __host__ __device__ __forceinline__ uint32_t lane_offset(int tidx) {
    const int row = tidx % 16, chunk = tidx % 32 / 16;
    return row * kRowBytes + ((chunk ^ ((row >> (3 - kBits)) & ((1 << kBits) - 1))) << 4);
  }
  // Byte offset of the 16x16 block at (row, col) for a lane at lane_offset `lane`.
  static __host__ __device__ __forceinline__ uint32_t block(uint32_t lane, int row, int col) {
    return (lane ^ uint32_t(2 * (col % kAtomCols))) + row * kRowBytes + col / kAtomCols * kRows * kRowBytes;
  }

  // k-slice i of an A fragment ((2,2,2), MMA_M, MMA_K) whose row tiles lie kRowStep rows apart from `base`.
  template <int kRowStep, class Frag>
  static __device__ __forceinline__ void load_a(Frag& frag, uint32_t base, uint32_t lane, int i) {
    Tensor r = recast<uint32_t>(frag);  // ((1,2,2), MMA_M, MMA_K): registers (m, k), (m+8, k), (m, k+8), (m+8, k+8)
    CUTE_UNROLL
    for (int m = 0; m < size<1>(frag); ++m) {
      ldsm_x4(base + block(lane, m * kRowStep, 16 * i), r(0, m, i), r(1, m, i), r(2, m, i), r(3, m, i));
    }
  }
  // n8 tiles n and n+1 (n even) of k-slice i of a B fragment ((2,2), MMA_N, MMA_K) stored [n][k].
  template <class Frag>
  static __device__ __forceinline__ void load_b(Frag& frag, uint32_t base, uint32_t lane, int i, int n) {
    Tensor r = recast<uint32_t>(frag);  // ((1,2), MMA_N, MMA_K): registers k, k+8
    ldsm_x4(base + block(lane, 8 * n, 16 * i), r(0, n, i), r(0, n + 1, i), r(1, n, i), r(1, n + 1, i));
  }
  // The same for a B fragment stored [k][n] (V for P@V), transposed by ldmatrix.
  template <class Frag>
  static __device__ __forceinline__ void load_bt(Frag& frag, uint32_t base, uint32_t lane, int i, int n) {
    Tensor r = recast<uint32_t>(frag);
    ldsm_x4_trans(base + block(lane, 16 * i, 8 * n), r(0, n, i), r(1, n, i), r(0, n + 1, i), r(1, n + 1, i));
  }
};

// acc += A * B over the k-mode, with load_a(i) filling k-slice i of A (a no-op if A is already in registers)
// and load_b(i, n) the n8 tiles n, n+1 of k-slice i of B. Loads are issued one k-slice ahead of the MMAs, so
// ldmatrix latency overlaps them, each B tile pair of the next slice as the same pair of the current slice
// is consumed (ptxas reschedules within the barrier-free stretch anyway). Each accumulator sums its k-slices
// in order, as cute::gemm does.
template <class Acc, class RA, class RB, class Mma, class LoadA, class LoadB>
__device__ __forceinline__ void gemm_pipelined(Acc& acc, RA const& rA, RB const& rB, Mma const& mma,
                                               LoadA&& load_a, LoadB&& load_b) {
  constexpr int M = decltype(size<1>(rA))::value, N = decltype(size<1>(rB))::value;
  constexpr int K = decltype(size<2>(rA))::value;
  load_a(0);
  CUTE_UNROLL
  for (int n = 0; n < N; n += 2) load_b(0, n);
  CUTE_UNROLL
  for (int i = 0; i < K; ++i) {
    if (i + 1 < K) load_a(i + 1);
    CUTE_UNROLL
    for (int n = 0; n < N; n += 2) {
      if (i + 1 < K) load_b(i + 1, n);
      CUTE_UNROLL
      for (int m = 0; m < M; ++m) {
        cute::gemm(mma, rA(_, m, i), rB(_, n, i), acc(_, m, n));
        cute::gemm(mma, rA(_, m, i), rB(_, n + 1, i), acc(_, m, n + 1));
      }
    }
  }
}

}  // namespace flash_gen
