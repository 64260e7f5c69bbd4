// Hopper forward, step 1 (issue 7): both GEMMs on wgmma. Two consumer warpgroups own 64 query rows each of a
// 128-row tile; S = Q K^T reads Q and K from swizzled shared memory (SS), O += P V takes P from registers (RS)
// and V from shared memory read head-dim-major. K/V tiles are double-buffered with cp.async by all threads
// (TMA, warp specialization and ping-pong scheduling are the next steps). Same FwdParams, masks and softmax
// conventions as the portable kernel (fwd_sm80.cuh): dense K/V, no softcap/ALiBi/varlen yet.
#pragma once
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include "flash_gen/attn_mask.cuh"
#include "flash_gen/fwd_params.cuh"
#include "flash_gen/sm80_utils.cuh"

namespace flash_gen {

template <class Element_, int kHeadDim_, int kBlockN_, int kStages_, Mask kMask_>
struct Sm90FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;  // two warpgroups x 64 rows (the wgmma M)
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;  // K/V buffers
  static constexpr int kNThreads = 256;
  static constexpr Mask kMask = kMask_;
  static_assert(kHeadDim % 64 == 0, "128-byte swizzled rows: head dim a multiple of 64");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256);
  static_assert(kBlockN % (kNThreads / 8) == 0, "each cp.async pass covers kNThreads / 8 rows of 128 bytes");

  // Warpgroup w computes rows [64w, 64w + 64) of both GEMMs.
  using MmaS = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(),
      Layout<Shape<_2, _1, _1>>{}));
  using MmaO = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      Layout<Shape<_2, _1, _1>>{}));

  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;  // 8 rows x 64 elements, 16-byte chunks XOR-swizzled
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V^T (head dim, keys, stage): the same bytes as V, seen as the PV GEMM's head-dim-major B operand.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  static constexpr int kSmemBytes =
      int(sizeof(Element)) * (kBlockM * kHeadDim + 2 * kStages * kBlockN * kHeadDim);

  using GmemLoad = typename GmemCopy<Element, kNThreads, kHeadDim>::Load;
};

// The issued wgmmas of one GEMM, waited for. kZeroInit overwrites the accumulator.
template <bool kZeroInit, class Mma, class A, class B, class C>
__device__ __forceinline__ void wgmma_gemm(Mma& mma, A const& a, B const& b, C& c) {
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(c);
}

// A wgmma accumulator ((2, 2, N/8), M, N) as (rows, cols) = ((2, M), (2, N/8, N)).
template <class Layout>
__device__ __forceinline__ auto gmma_rowcol(Layout const& l) {
  return make_layout(make_layout(layout<0, 1>(l), layout<1>(l)),
                     make_layout(layout<0, 0>(l), layout<0, 2>(l), layout<2>(l)));
}

// The same accumulator as the register A operand ((2, 2, 2), M, K/16) of the next wgmma: two adjacent n8 column
// groups hold one k16 slice.
template <class Layout>
__device__ __forceinline__ auto gmma_acc_as_a(Layout const& l) {
  auto cols = logical_divide(layout<0, 2>(l), Shape<_2>{});  // ((2, N/16))
  return make_layout(make_layout(layout<0, 0>(l), layout<0, 1>(l), layout<0, 0>(cols)), layout<1>(l),
                     make_layout(layout<0, 1>(cols), layout<2>(l)));
}

__device__ __forceinline__ void fence_smem_for_async_proxy() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

template <class T>
__device__ __forceinline__ void fwd_sm90_kernel(FwdParams const& p) {
  using Element = typename T::Element;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kD = T::kHeadDim;
  extern __shared__ __align__(1024) char smem_buf[];  // 128-byte swizzle atoms repeat every 1024 bytes

  const int tidx = threadIdx.x;
  const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const int head_k = head / (p.nheads / p.nheads_k);
  const int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k;
  const int row0 = m_block * kBlockM;
  const int diag = seqlen_k - seqlen_q;

  int n_min = 0, n_max = (seqlen_k + kBlockN - 1) / kBlockN;
  if constexpr (MaskBounds<T::kMask>::kRight) {
    const int last_col = min(row0 + kBlockM, seqlen_q) - 1 + diag + p.window_right;
    n_max = min(n_max, max(0, last_col + kBlockN) / kBlockN);
  }
  if constexpr (MaskBounds<T::kMask>::kLeft) n_min = max(0, row0 + diag - p.window_left) / kBlockN;

  auto rows = [&](const void* base, int64_t b, int64_t r, int64_t h, int hh, int len, auto block) {
    auto* ptr = static_cast<const Element*>(base) + batch * b + hh * h;
    return local_tile(make_tensor(make_gmem_ptr(ptr), make_shape(len, Int<kD>{}), make_stride(r, _1{})),
                      Shape<decltype(block), Int<kD>>{}, make_coord(_, 0));  // (rows, D, tile)
  };
  Tensor gQ = rows(p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride, head, seqlen_q, Int<kBlockM>{});
  Tensor gK = rows(p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride, head_k, seqlen_k, Int<kBlockN>{});
  Tensor gV = rows(p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride, head_k, seqlen_k, Int<kBlockN>{});

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem_buf)), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename T::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename T::SmemLayoutKV{});
  Tensor sVt = make_tensor(sV.data(), typename T::SmemLayoutVt{});

  typename T::GmemLoad load;
  auto load_thr = load.get_thread_slice(tidx);
  Tensor cQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kD>>{});
  Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kD>>{});
  Tensor tKVcKV = load_thr.partition_D(cKV);
  Tensor tKsK = load_thr.partition_D(sK), tVsV = load_thr.partition_D(sV);
  Tensor tKgK = load_thr.partition_S(gK), tVgV = load_thr.partition_S(gV);
  auto load_kv = [&](int n, int stage) {
    const int left = seqlen_k - n * kBlockN;
    copy_zfill(load, tKgK(_, _, _, n), tKsK(_, _, _, stage), tKVcKV, left, kD);
    copy_zfill(load, tVgV(_, _, _, n), tVsV(_, _, _, stage), tKVcKV, left, kD);
  };

  float* lse_ptr = p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride;
  auto* o_ptr = static_cast<Element*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride;

  typename T::MmaS mma_s;
  typename T::MmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(tidx);
  auto thr_o = mma_o.get_thread_slice(tidx);
  Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kD>>{});
  Tensor o_rc = make_tensor(acc_o.data(), gmma_rowcol(acc_o.layout()));
  Tensor tOcO = thr_o.partition_C(cQ);
  Tensor tOcO_rc = make_tensor(tOcO.data(), gmma_rowcol(tOcO.layout()));
  constexpr int kRows = decltype(size<0>(o_rc))::value;
  float row_max[kRows], row_sum[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    row_max[r] = -inf();
    row_sum[r] = 0.f;
  }
  clear(acc_o);

  if (n_min < n_max) {
    copy_zfill(load, load_thr.partition_S(gQ(_, _, m_block)), load_thr.partition_D(sQ), load_thr.partition_D(cQ),
               seqlen_q - row0, kD);
    load_kv(n_min, 0);
    cp_async_fence();
  }
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);  // smem descriptors
  Tensor tScS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), gmma_rowcol(tScS.layout()));

  for (int n = n_min, it = 0; n < n_max; ++n, ++it) {
    const int stage = it % T::kStages;
    if (n + 1 < n_max) load_kv(n + 1, (it + 1) % T::kStages);  // its buffer was released by the last barrier
    cp_async_fence();
    cp_async_wait<1>();
    fence_smem_for_async_proxy();  // cp.async wrote through the generic proxy; wgmma reads through the async one
    __syncthreads();

    Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
    wgmma_gemm<true>(mma_s, tSrQ, thr_s.partition_fragment_B(sK(_, _, stage)), acc_s);

    Tensor s = make_tensor(acc_s.data(), gmma_rowcol(acc_s.layout()));
    if (tile_is_cut<T::kMask>(row0, kBlockM, n * kBlockN, kBlockN, seqlen_k, diag, p.window_left, p.window_right)) {
      mask_tile<T::kMask>(s, tScS_rc, row0, n * kBlockN, seqlen_k, diag, p.window_left, p.window_right);
    }
    online_softmax_step(s, o_rc, row_max, row_sum, p.scale_log2);

    Tensor p_frag = convert_to<Element>(acc_s);
    Tensor tOrP = make_tensor(p_frag.data(), gmma_acc_as_a(p_frag.layout()));
    warpgroup_fence_operand(tOrP);
    wgmma_gemm<false>(mma_o, tOrP, thr_o.partition_fragment_B(sVt(_, _, stage)), acc_o);
    __syncthreads();  // every warpgroup is done with this stage before it is refilled
  }

  // Epilogue: normalise, lse, then O straight from the accumulators (two adjacent columns per store).
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const float sum = quad_sum(row_sum[r]);
    const bool empty = sum == 0.f || sum != sum;
    const float inv = empty ? 1.f : 1.f / sum;
    const int row = row0 + get<0>(tOcO_rc(r, 0));
    if (row >= seqlen_q) continue;
    if (get<1>(tOcO_rc(r, 0)) == 0) {
      lse_ptr[row] = empty ? inf() : (row_max[r] * p.scale_log2 + log2f(sum)) * 0.69314718055994531f;
    }
    Element* o_row = o_ptr + int64_t(row) * p.o_row_stride;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(o_rc); c += 2) {
      const int col = get<1>(tOcO_rc(r, c));
      Element pair[2] = {Element(o_rc(r, c) * inv), Element(o_rc(r, c + 1) * inv)};
      *reinterpret_cast<uint32_t*>(o_row + col) = *reinterpret_cast<uint32_t*>(pair);
    }
  }
}

}  // namespace flash_gen
