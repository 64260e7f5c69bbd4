// One key tile of the online softmax for kernels that rescale O themselves, after their P V GEMM (the Hopper
// forward), tuned for instruction count:
// - Base 2 with the scale folded into one FFMA per element; the row max and the row sum each run in four
//   independent chains, so FMNMX/FADD latency overlaps instead of forming one 32-long dependency chain.
// - Lazy maximum: a row's reference maximum is raised only when the tile's maximum exceeds it by more than
//   2^kMaxSlackLog2 after scaling. Below that, exp2 stays <= 2^8 (no overflow in the fp32 sums nor in fp16/bf16 P)
//   and O and the row sum keep their scale, so after the first few key tiles a warp skips the O rescale entirely.
//   The result is exact: O and the row sum always share one reference, which the final normalisation and the lse
//   use.
#pragma once
#include "flash_gen/sm80_utils.cuh"

namespace flash_gen {

constexpr float kMaxSlackLog2 = 8.f;

// s (rows, cols) becomes P = exp2(s * scale_log2 - row_max * scale_log2); row_sum accumulates thread-partial sums
// (the quad is summed once at the end). o_scale[r] is what O's row r must be multiplied by before P is added to it
// (1 unless the row's maximum was raised). Returns whether this thread raised any row's maximum.
template <int kRows, class S>
__device__ __forceinline__ bool online_softmax_lazy(S& s, float (&row_max)[kRows], float (&row_sum)[kRows],
                                                    float (&o_scale)[kRows], float scale_log2) {
  constexpr int kCols = decltype(size<1>(s))::value;
  static_assert(kCols % 4 == 0, "four reduction chains");
  bool raised = false;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    float m[4] = {s(r, 0), s(r, 1), s(r, 2), s(r, 3)};
    CUTE_UNROLL
    for (int c = 4; c < kCols; ++c) m[c % 4] = fmaxf(m[c % 4], s(r, c));
    const float tile_max = quad_max(fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3])));
    // A row with nothing visible yet (max -inf) is raised by the first finite score; -inf - -inf is NaN, so a
    // fully masked tile leaves it at -inf.
    const bool raise = (tile_max - row_max[r]) * scale_log2 > kMaxSlackLog2;
    o_scale[r] = raise ? fast_exp2((row_max[r] - tile_max) * scale_log2) : 1.f;
    if (raise) row_max[r] = tile_max;
    raised |= raise;
    // Subtract 0 rather than -inf for a row still at -inf, so exp2 gives 0, not NaN.
    const float m_scaled = row_max[r] == -inf() ? 0.f : row_max[r] * scale_log2;
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      s(r, c) = fast_exp2(s(r, c) * scale_log2 - m_scaled);
      sum[c % 4] += s(r, c);
    }
    row_sum[r] = row_sum[r] * o_scale[r] + ((sum[0] + sum[1]) + (sum[2] + sum[3]));
  }
  return raised;
}

// A key tile without its maximum (kMaxFree, fwd_sm90.cuh): P = exp2(s * scale_log2 - row_max * scale_log2) with the
// reference maxima as they stand, one FMNMX per element less, and the thread's partial sums of its rows in tile_sum
// (to add to the row sums once every thread that shares the tile's fate agrees). Exact while every element stays
// below 2^kFreeMaxLog2 (fp16 P: 65504), which those sums bound; where one does not, or a row without a reference
// (-inf, taken as 0 here) sees a key, returns false with s destroyed: the caller computes S again, raises the
// maxima (raise_row_max) and repeats.
constexpr float kFreeMaxLog2 = 15.f;

template <int kRows, class S>
__device__ __forceinline__ bool online_softmax_max_free(S& s, float const (&row_max)[kRows], float (&tile_sum)[kRows],
                                                        float scale_log2) {
  constexpr int kCols = decltype(size<1>(s))::value;
  bool ok = true;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const bool has_max = row_max[r] != -inf();
    const float m_scaled = has_max ? row_max[r] * scale_log2 : 0.f;
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      s(r, c) = fast_exp2(s(r, c) * scale_log2 - m_scaled);
      sum[c % 4] += s(r, c);
    }
    tile_sum[r] = (sum[0] + sum[1]) + (sum[2] + sum[3]);
    // False for NaN too (a NaN score).
    ok &= tile_sum[r] <= exp2f(kFreeMaxLog2) && (has_max || tile_sum[r] == 0.f);
  }
  return ok;
}

// A max-free step's repair, on S computed again: each row's reference rises to the tile's maximum where that exceeds
// it, o_scale[r] bringing O and the row sum along (1 where it stays). Then every element of the step is at most 1.
// Returns whether this thread raised any row.
template <int kRows, class S>
__device__ __forceinline__ bool raise_row_max(S const& s, float (&row_max)[kRows], float (&o_scale)[kRows],
                                              float scale_log2) {
  constexpr int kCols = decltype(size<1>(s))::value;
  bool raised = false;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    float m = s(r, 0);
    CUTE_UNROLL
    for (int c = 1; c < kCols; ++c) m = fmaxf(m, s(r, c));
    const float tile_max = quad_max(m);
    const bool raise = tile_max > row_max[r];
    o_scale[r] = raise ? fast_exp2((row_max[r] - tile_max) * scale_log2) : 1.f;  // 0 for a row without a reference
    if (raise) row_max[r] = tile_max;
    raised |= raise;
  }
  return raised;
}

}  // namespace flash_gen
