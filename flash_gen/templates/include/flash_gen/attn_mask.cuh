// Score masking and ALiBi on an MMA accumulator tile, shared by the forward and backward kernels.
// Query row i sees key column j iff i + diag - window_left <= j <= i + diag + window_right, with
// diag = seqlen_k - seqlen_q (bottom-right alignment); the host turns an unbounded side into a bound past the
// sequence. Coordinates come from an identity tensor partitioned like the accumulator; only offsets relative to
// the thread's first element are used, so they fold into compile-time constants and no per-element coordinate
// stays live in registers.
#pragma once
#include <cute/tensor.hpp>

namespace flash_gen {
using namespace cute;

enum class Mask { kNone = 0, kCausal = 1, kLocal = 2 };

template <Mask kMask>
struct MaskBounds {
  static constexpr bool kRight = kMask != Mask::kNone;
  static constexpr bool kLeft = kMask == Mask::kLocal;
};

// Whether the tile [row0, row0 + rows) x [col0, col0 + cols) holds an element that the sequence end or a mask
// boundary hides; tiles where it does not skip per-element masking.
template <Mask kMask>
__device__ __forceinline__ bool tile_is_cut(int row0, int rows, int col0, int cols, int seqlen_k, int diag,
                                            int window_left, int window_right) {
  bool cut = col0 + cols > seqlen_k;
  if constexpr (MaskBounds<kMask>::kRight) cut |= col0 + cols - 1 > row0 + diag + window_right;
  if constexpr (MaskBounds<kMask>::kLeft) cut |= col0 < row0 + rows - 1 + diag - window_left;
  return cut;
}

// Set hidden elements of `s` ((rows, cols) view of an accumulator) to -inf. `rc` holds each element's (row, col)
// within the tile; (row0, col0) is the tile's origin in the full (seqlen_q, seqlen_k) matrix. kPacked: tile rows
// stack `group` heads per query position (pack-GQA), so row R is query position R / group.
template <Mask kMask, bool kPacked = false, class S, class RC>
__device__ __forceinline__ void mask_tile(S& s, RC const& rc, int row0, int col0, int seqlen_k, int diag,
                                          int window_left, int window_right, int group = 1) {
  const int base_row = get<0>(rc(0, 0)), base_col = get<1>(rc(0, 0));
  const int first_col = col0 + base_col;
  const int col_end = seqlen_k - first_col;  // offsets >= this are past the sequence
  CUTE_UNROLL
  for (int r = 0; r < size<0>(s); ++r) {
    const int pos = kPacked ? (row0 + get<0>(rc(r, 0))) / group : row0 + base_row + (get<0>(rc(r, 0)) - base_row);
    const int row = pos + diag - first_col;
    // Offsets > last are masked (the sequence end and the right bound folded into one compare per element),
    // and with a left bound offsets < left.
    const int last = MaskBounds<kMask>::kRight ? min(col_end - 1, row + window_right) : col_end - 1;
    const int left = row - window_left;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) {
      const int off = get<1>(rc(r, c)) - base_col;
      bool masked = off > last;
      if constexpr (MaskBounds<kMask>::kLeft) masked |= off < left;
      if (masked) s(r, c) = -__int_as_float(0x7f800000);
    }
  }
}

// s -= slope * |i + diag - j| (slope already in score units).
template <class S, class RC>
__device__ __forceinline__ void add_alibi(S& s, RC const& rc, int row0, int col0, int diag, float slope) {
  const int base_col = get<1>(rc(0, 0));
  const int first_col = col0 + base_col;
  CUTE_UNROLL
  for (int r = 0; r < size<0>(s); ++r) {
    const int row = row0 + get<0>(rc(r, 0)) + diag;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) {
      s(r, c) -= slope * float(abs(row - (first_col + get<1>(rc(r, c)) - base_col)));
    }
  }
}

}  // namespace flash_gen
