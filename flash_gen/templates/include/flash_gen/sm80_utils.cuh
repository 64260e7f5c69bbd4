// Building blocks of the portable (mma.sync + ldmatrix + cp.async) kernels: fragment layouts, predicated
// zero-filling tile loads, and warp-quad reductions.
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cutlass/numeric_types.h>

namespace flash_gen {
using namespace cute;

// mma.sync m16n8k16 with fp32 accumulation, for the element type.
template <class Element>
using Sm80MmaAtom = MMA_Atom<cute::conditional_t<cute::is_same_v<Element, cutlass::half_t>,
                                                SM80_16x8x16_F32F16F16F32_TN,
                                                SM80_16x8x16_F32BF16BF16F32_TN>>;

// Row-major smem tile of `Rows` x `Cols` elements, swizzled so that ldmatrix phases (8 rows x 16 bytes) hit
// distinct banks. The swizzle atom is as wide as Cols allows (64, 32 or 16 elements).
template <int Cols>
struct SmemTile {
  static constexpr int kAtomCols = Cols % 64 == 0 ? 64 : (Cols % 32 == 0 ? 32 : 16);
  static constexpr int kSwizzleBits = kAtomCols == 64 ? 3 : (kAtomCols == 32 ? 2 : 1);
  using Atom = decltype(composition(Swizzle<kSwizzleBits, 3, 3>{},
                                    Layout<Shape<_8, Int<kAtomCols>>, Stride<Int<kAtomCols>, _1>>{}));
  // Threads per row for 16-byte global<->smem copies: one swizzle atom row per group of threads.
  static constexpr int kThreadsPerRow = kAtomCols / 8;
};

// 16-byte global<->smem copies of a (rows x Cols) row-major tile stored with SmemTile<Cols>'s swizzle: each group
// of threads covers one swizzle-atom row, a pass of all threads covers kNThreads / kThreadsPerRow rows. Load is
// cp.async with zero-fill (see copy_zfill), Store plain 16-byte stores (see copy_predicated).
template <class Element, int kNThreads, int Cols>
struct GmemCopy {
  static constexpr int kThreadsPerRow = SmemTile<Cols>::kThreadsPerRow;
  using Threads = Layout<Shape<Int<kNThreads / kThreadsPerRow>, Int<kThreadsPerRow>>, Stride<Int<kThreadsPerRow>, _1>>;
  using Load = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>, Element>{}, Threads{},
                                        Layout<Shape<_1, _8>>{}));
  using Store = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<uint128_t>, Element>{}, Threads{},
                                         Layout<Shape<_1, _8>>{}));
};

// View an MMA accumulator ((2,2), MMA_M, MMA_N) as (rows, cols) = ((2, MMA_M), (2, MMA_N)).
template <class Layout>
__device__ __forceinline__ auto acc_rowcol(Layout const& l) {
  static_assert(decltype(rank<0>(l))::value == 2);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

// Reinterpret an m16n8k16 accumulator ((2,2), MMA_M, MMA_N) as the A operand ((2,2,2), MMA_M, MMA_N/2) of
// the next GEMM: two adjacent n8 accumulator tiles are exactly one k16 slice of A.
template <class Layout>
__device__ __forceinline__ auto acc_as_a_operand(Layout const& l) {
  auto d = logical_divide(l, Shape<Underscore, Underscore, _2>{});  // ((2,2), MMA_M, (2, MMA_N/2))
  return make_layout(make_layout(get<0, 0>(d), get<0, 1>(d), get<2, 0>(d)), get<1>(d), get<2, 1>(d));
}

// Element-wise conversion of a register tensor (fp32 -> fp16/bf16). Plain per-element casts keep the
// fragment in registers (a reinterpret_cast to an Array would push it to the stack); ptxas pairs them into
// packed cvt instructions.
template <class To, class Engine, class Layout>
__device__ __forceinline__ auto convert_to(Tensor<Engine, Layout> const& t) {
  Tensor out = make_tensor<To>(t.layout());
  CUTE_UNROLL
  for (int i = 0; i < size(t); ++i) out(i) = static_cast<To>(t(i));
  return out;
}

// cp.async a partitioned gmem tile into smem, zero-filling every 16-byte vector whose (row, col) lies outside
// [0, max_row) x [0, max_col): ragged sequence ends and the columns that pad the head dim to the MMA k-step.
// With src-size 0 the hardware reads nothing, so out-of-range addresses are never dereferenced.
template <class TiledCopy, class Src, class Dst, class Coord>
__device__ __forceinline__ void copy_zfill(TiledCopy const& tiled_copy, Src const& src, Dst&& dst,
                                           Coord const& coord, int max_row, int max_col) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    const bool row_ok = get<0>(coord(0, m, 0)) < max_row;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(src); ++k) {
      const bool ok = row_ok && get<1>(coord(0, m, k)) < max_col;
      copy(tiled_copy.with(ok), src(_, m, k), dst(_, m, k));
    }
  }
}

// Copy a partitioned smem tile to gmem, 16-byte vector by vector, skipping vectors whose (row, col) lies outside
// [0, max_row) x [0, max_col).
template <class TiledCopy, class Src, class Dst, class Coord>
__device__ __forceinline__ void copy_predicated(TiledCopy const& tiled_copy, Src const& src, Dst&& dst,
                                                Coord const& coord, int max_row, int max_col) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    if (get<0>(coord(0, m, 0)) >= max_row) continue;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(src); ++k) {
      if (get<1>(coord(0, m, k)) < max_col) copy(tiled_copy, src(_, m, k), dst(_, m, k));
    }
  }
}

__device__ __forceinline__ float inf() { return __int_as_float(0x7f800000); }

// 2^x on the SFU (MUFU.EX2); -inf gives 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Reductions over the 4 threads of a quad, which together hold one accumulator row.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 2);
  return x + __shfl_xor_sync(0xffffffff, x, 1);
}

// One key tile of the online softmax, in base 2 with the scale folded into one FFMA per element: scores `s`
// (rows, cols) become exp2(s*scale_log2 - max*scale_log2), the output accumulator `o` (rows, cols) is rescaled
// to the new row maxima, `row_sum` accumulates thread-partial sums (the quad is summed once at the end).
template <int kRows, class S, class O>
__device__ __forceinline__ void online_softmax_step(S& s, O& o, float (&row_max)[kRows], float (&row_sum)[kRows],
                                                    float scale_log2) {
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    float m = row_max[r];
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) m = fmaxf(m, s(r, c));
    m = quad_max(m);
    // A row with nothing visible yet keeps max = -inf; subtract 0 instead so exp2 gives 0, not NaN.
    const float m_scaled = m == -inf() ? 0.f : m * scale_log2;
    const float correction = fast_exp2(row_max[r] * scale_log2 - m_scaled);
    row_max[r] = m;
    float sum = 0.f;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) {
      s(r, c) = fast_exp2(s(r, c) * scale_log2 - m_scaled);
      sum += s(r, c);
    }
    row_sum[r] = row_sum[r] * correction + sum;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(o); ++c) o(r, c) *= correction;
  }
}

}  // namespace flash_gen
