// ldmatrix from SmemTile-swizzled row-major tiles with hand-computed addresses.
//
// CuTe's ldmatrix copies apply the swizzle to each full (thread + static k-slice/tile) offset; XOR does not
// commute with the static part, so every (tile, k-slice) address is a separate runtime value that the compiler
// hoists into a live register (about 50 of them in the forward main loop). Here a lane's swizzled offset is
// computed once and shared by all operands; each ldmatrix adds at most one XOR with a constant, and the rest
// (tile bases, atoms, row tiles) are uniform registers and LDSM immediates.
//
// The fragments filled are the CuTe mma.sync m16n8k16 fragments A ((2,2,2), MMA_M, MMA_K) and B ((2,2), MMA_N,
// MMA_K) of a TiledMMA with atom layout (wm, wn, 1) and tile (16 wm, 16 wn, 16): warp (w_m, w_n) owns the m16
// tiles w_m + wm * j and the n8 tiles w_n + wn * j. tests/test_ldsm_model.py checks the addressing against
// CuTe's swizzled layouts and the MMA fragment layouts on the CPU.
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
// Every operand is read with ldmatrix.x4, lane l supplying row l % 8 of matrix q = l / 8 of a block whose four
// 8x8 matrices are (rows 0-7, cols 0-7), (rows kDr.., cols 0-7), (rows 0-7, cols kDc..), (rows kDr.., cols kDc..)
// from the block's origin (matrices 1 and 2 swapped with kColFirst): kDr = kDc = 8 makes it a 16x16 block. The
// order is chosen so that the four destination registers, which ldmatrix writes to consecutive registers, are
// in fragment order: HMMA reads A as four and B as two consecutive registers, and any other order costs moves.
// The per-thread part of all addresses of one
// operand is then one `thread_offset`, computed once (with the warp's column offset folded in, which the
// swizzle does not let a uniform base carry); the block at (row, col) from there, row a multiple of 8, is
// (offset ^ 2 * (col % kAtomCols)) + a constant + the tile base (warp-uniform). This holds while col's bits
// below kAtomCols are disjoint from those of the thread's own column (and whole atoms above it add up), which
// the col steps used here ensure: the XOR then equals the swizzled sum, and whole atoms and rows keep the
// swizzle and are plain adds. The XOR acts on an offset, never on the base, so any 16-byte aligned base works.
template <int kCols, int kRows>
struct LdsmTile {
  static constexpr int kAtomCols = SmemTile<kCols>::kAtomCols;
  static constexpr int kBits = SmemTile<kCols>::kSwizzleBits;
  static constexpr int kRowBytes = 2 * kAtomCols;  // one row of one atom

  // Byte offset of element (row, col), col a multiple of 8: Swizzle<kBits,3,3> on the element offset
  // row*kAtomCols + col XORs the 16-byte chunk with row bits [3-kBits, 3).
  static __host__ __device__ __forceinline__ uint32_t offset(int row, int col) {
    const int chunk = col % kAtomCols / 8;
    return row * kRowBytes + ((chunk ^ ((row >> (3 - kBits)) & ((1 << kBits) - 1))) << 4) +
           col / kAtomCols * kRows * kRowBytes;
  }
  // The row this thread supplies to a (kDr, kDc) block at (row0, col0).
  template <int kDr = 8, int kDc = 8, bool kColFirst = false>
  static __host__ __device__ __forceinline__ uint32_t thread_offset(int tidx, int row0 = 0, int col0 = 0) {
    const int q = tidx % 32 / 8, qr = kColFirst ? q / 2 : q % 2, qc = kColFirst ? q % 2 : q / 2;
    return offset(row0 + tidx % 8 + kDr * qr, col0 + kDc * qc);
  }
  // The 16x16 block's thread offset, shared by every operand of a tile that needs no warp column offset.
  static __host__ __device__ __forceinline__ uint32_t lane_offset(int tidx) { return thread_offset(tidx); }
  // Byte offset of the block at (row, col) for a thread at thread offset `lane`.
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
  // The same for an A fragment stored [k][m] (P^T, dS^T), transposed by ldmatrix, with the thread offset
  // thread_offset<8, 8, true> carrying the warp's first column; the row tiles lie kColStep columns apart.
  template <int kColStep, class Frag>
  static __device__ __forceinline__ void load_at(Frag& frag, uint32_t base, uint32_t lane, int i) {
    Tensor r = recast<uint32_t>(frag);
    CUTE_UNROLL
    for (int m = 0; m < size<1>(frag); ++m) {
      ldsm_x4_trans(base + block(lane, 16 * i, m * kColStep), r(0, m, i), r(1, m, i), r(2, m, i), r(3, m, i));
    }
  }
  // n8 tiles n and n+1 (n even) of k-slice i of a B fragment ((2,2), MMA_N, MMA_K) stored [n][k], its n8
  // tiles kNStep rows apart. The thread offset is thread_offset<kNStep, 8, kColFirst>; kColFirst = false (the
  // forward's 16x16 lane_offset) leaves the registers of n and n+1 interleaved.
  template <int kNStep = 8, bool kColFirst = false, class Frag>
  static __device__ __forceinline__ void load_b(Frag& frag, uint32_t base, uint32_t lane, int i, int n) {
    Tensor r = recast<uint32_t>(frag);  // ((1,2), MMA_N, MMA_K): registers k, k+8
    const uint32_t addr = base + block(lane, kNStep * n, 16 * i);
    if constexpr (kColFirst) {
      ldsm_x4(addr, r(0, n, i), r(1, n, i), r(0, n + 1, i), r(1, n + 1, i));
    } else {
      ldsm_x4(addr, r(0, n, i), r(0, n + 1, i), r(1, n, i), r(1, n + 1, i));
    }
  }
  // The same for a B fragment stored [k][n] (V for P@V), transposed by ldmatrix; n8 tiles kNStep columns
  // apart, thread offset thread_offset<8, kNStep> with the warp's first column.
  template <int kNStep = 8, class Frag>
  static __device__ __forceinline__ void load_bt(Frag& frag, uint32_t base, uint32_t lane, int i, int n) {
    Tensor r = recast<uint32_t>(frag);
    ldsm_x4_trans(base + block(lane, 16 * i, kNStep * n), r(0, n, i), r(1, n, i), r(0, n + 1, i), r(1, n + 1, i));
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
