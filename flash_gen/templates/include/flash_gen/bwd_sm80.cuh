// The portable backward kernel: FlashAttention-2's algorithm on mma.sync, ldmatrix and cp.async (Sm80 and
// newer). One CTA owns a block_n-row tile of K and V for one (batch, KV head) and walks every query tile that
// sees it, for every query head sharing that KV head (so MQA/GQA sum dK/dV in registers, without repeated K/V):
//   S = Q K^T, P = exp2(S * scale_log2 - lse_log2)        (recomputed from the forward's lse, never stored)
//   dP = dO V^T, dS = P * (dP - rowsum(dO * O))           (times 1 - tanh^2 under softcap)
//   dV += P^T dO, dK += dS^T Q,  dQ_accum += dS K         (dQ in fp32 through atomics; converted afterwards)
// With dropout (keep mask Z, scale 1/(1-p)), dV takes Z * P / (1-p) and dS = P * (Z * dP / (1-p) - rowsum(dO * O)):
// the forward's output already held the dropout, so the row sums need no change.
// P and dS go through shared memory because the dK/dV GEMMs read them transposed.
// Deterministic kernels order the dQ additions of the CTAs that share a query tile with a per-tile semaphore,
// so every run adds in the same order.
#pragma once
#include "flash_gen/attn_mask.cuh"
#include "flash_gen/bwd_dq.cuh"
#include "flash_gen/bwd_key_tile.cuh"
#include "flash_gen/bwd_params.cuh"
#include "flash_gen/dropout.cuh"
#include "flash_gen/score_mods.cuh"  // fast_tanh: the forward's softcap
#include "flash_gen/seq_info.cuh"
#include "flash_gen/sm80_ldsm.cuh"
#include "flash_gen/sm80_utils.cuh"

namespace flash_gen {

template <class Element_, int kHeadDim_, int kHeadDimMma_, int kBlockM_, int kBlockN_, int kNWarps_,
          int kWarpsMSdP_, int kWarpsNdKV_, int kWarpsMdQ_, int kStages_, Mask kMask_, bool kSoftcap_,
          bool kAlibi_, bool kVarlen_, bool kDeterministic_, bool kDropout_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;        // what loads and stores touch
  static constexpr int kHeadDimMma = kHeadDimMma_;  // what the MMAs compute (zero-padded; flash_gen.spec decides)
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kStages = kStages_;  // Q/dO smem buffers: 2 loads tile m+1 while tile m computes
  static constexpr Mask kMask = kMask_;
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr bool kAlibi = kAlibi_;
  static constexpr bool kVarlen = kVarlen_;
  static constexpr bool kDeterministic = kDeterministic_;
  static constexpr bool kDropout = kDropout_;
  static constexpr int kWarpsMSdP = kWarpsMSdP_, kWarpsNdKV = kWarpsNdKV_, kWarpsMdQ = kWarpsMdQ_;

  // Warps tile a GEMM's (M, N) as kWarpsM x (kNWarps / kWarpsM); N = 16 per warp step so one ldmatrix.x4
  // feeds two n8 MMAs.
  template <int kWarpsM>
  using Mma = TiledMMA<Sm80MmaAtom<Element>, Layout<Shape<Int<kWarpsM>, Int<kNWarps / kWarpsM>, _1>>,
                       Tile<Int<16 * kWarpsM>, Int<16 * (kNWarps / kWarpsM)>, _16>>;
  using MmaSdP = Mma<kWarpsMSdP_>;  // S and dP: (block_m, block_n), k = head dim
  using MmadKV = Mma<kWarpsNdKV_>;  // dK and dV: (block_n, head dim), k = block_m
  using MmadQ = Mma<kWarpsMdQ_>;    // dQ: (block_m, head dim), k = block_n
  static_assert(kBlockM % (16 * kWarpsMSdP_) == 0 && kBlockN % (16 * (kNWarps / kWarpsMSdP_)) == 0);
  static_assert(kBlockN % (16 * kWarpsNdKV_) == 0 && kHeadDimMma % (16 * (kNWarps / kWarpsNdKV_)) == 0);
  static_assert(kBlockM % (16 * kWarpsMdQ_) == 0 && kHeadDimMma % (16 * (kNWarps / kWarpsMdQ_)) == 0);

  using Smem = SmemTile<kHeadDimMma>;
  using SmemLayoutQ =  // Q and dO: (block_m, head dim, stage)
      decltype(tile_to_shape(typename Smem::Atom{}, Shape<Int<kBlockM>, Int<kHeadDimMma>, Int<kStages>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(typename Smem::Atom{}, Shape<Int<kBlockN>, Int<kHeadDimMma>>{}));
  using SmemLayoutP =  // P and dS: (block_m, block_n)
      decltype(tile_to_shape(typename SmemTile<kBlockN>::Atom{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  static constexpr int kSmemElems =
      2 * kStages * kBlockM * kHeadDimMma + 2 * kBlockN * kHeadDimMma + 2 * kBlockM * kBlockN;
  static constexpr int kSmemBytes = kSmemElems * int(sizeof(Element));

  using GmemLoad = typename GmemCopy<Element, kNThreads, kHeadDimMma>::Load;
  using GmemStore = typename GmemCopy<Element, kNThreads, kHeadDimMma>::Store;
  using StoreC = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;
};

template <class T>
__device__ __forceinline__ void bwd_kernel(BwdParams const& p) {
  using Element = typename T::Element;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kD = T::kHeadDimMma;
  constexpr bool kLeftBound = MaskBounds<T::kMask>::kLeft;
  extern __shared__ __align__(128) char smem_buf[];

  const int tidx = threadIdx.x;
  const int head_k = blockIdx.y;
  BwdKeyTile tile;
  if (!bwd_key_tile<T::kVarlen, T::kMask, kBlockM, kBlockN>(p, tile)) return;
  const int batch = tile.batch, n_block = tile.n_block, diag = tile.diag, m_min = tile.m_min, m_max = tile.m_max;
  const SeqInfo& seq = tile.seq;
  const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
  const int group = p.nheads / p.nheads_k;
  const int col0 = n_block * kBlockN;
  auto kv_tile = [&](auto* base, int64_t batch_stride, int64_t row_stride, int64_t head_stride) {
    return tile.kv<kBlockN, kD>(base, batch_stride, row_stride, head_stride, head_k);
  };
  Tensor gK = kv_tile(static_cast<const Element*>(p.k), p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  Tensor gV = kv_tile(static_cast<const Element*>(p.v), p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  Tensor gdK = kv_tile(static_cast<Element*>(p.dk), p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
  Tensor gdV = kv_tile(static_cast<Element*>(p.dv), p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem_buf)), typename T::SmemLayoutQ{});
  Tensor sdO = make_tensor(sQ.data() + size(sQ), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(sdO.data() + size(sdO), typename T::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename T::SmemLayoutKV{});
  Tensor sP = make_tensor(sV.data() + size(sV), typename T::SmemLayoutP{});
  Tensor sdS = make_tensor(sP.data() + size(sP), typename T::SmemLayoutP{});

  Tensor cQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kD>>{});
  Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kD>>{});

  typename T::GmemLoad load;
  auto load_thr = load.get_thread_slice(tidx);
  Tensor tQsQ = load_thr.partition_D(sQ);  // (CPY, CPY_M, CPY_K, stage)
  Tensor tdOsdO = load_thr.partition_D(sdO);
  Tensor tQcQ = load_thr.partition_D(cQ);
  Tensor tKVcKV = load_thr.partition_D(cKV);
  copy_zfill(load, load_thr.partition_S(gK), load_thr.partition_D(sK), tKVcKV, seqlen_k - col0, T::kHeadDim);
  copy_zfill(load, load_thr.partition_S(gV), load_thr.partition_D(sV), tKVcKV, seqlen_k - col0, T::kHeadDim);
  cp_async_fence();

  // Operand fragments (the MMAs' own layouts; a transposed operand's fragment only needs its shape).
  auto shaped = [](auto shape) {
    return make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)), make_layout(shape));
  };
  typename T::MmaSdP mma_sdp;  // S and dP: A = Q / dO, B = K / V, both k-major
  auto thr_sdp = mma_sdp.get_thread_slice(tidx);
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ(_, _, 0));  // (MMA, MMA_M, MMA_K)
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO(_, _, 0));
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
  typename T::MmadKV mma_dkv;  // dV and dK: A = P^T / dS^T, B = dO^T / Q^T, all read transposed
  auto thr_dkv = mma_dkv.get_thread_slice(tidx);
  Tensor sPt = shaped(Shape<Int<kBlockN>, Int<kBlockM>>{});  // P^T and dS^T
  Tensor sQt = shaped(Shape<Int<kD>, Int<kBlockM>>{});       // Q^T and dO^T
  Tensor tdVrPt = thr_dkv.partition_fragment_A(sPt);
  Tensor tdVrdOt = thr_dkv.partition_fragment_B(sQt);
  Tensor tdKrdSt = thr_dkv.partition_fragment_A(sPt);
  Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt);
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kD>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kD>>{});
  clear(acc_dk);
  clear(acc_dv);
  typename T::MmadQ mma_dq;  // dQ: A = dS (k-major), B = K^T (read transposed)
  auto thr_dq = mma_dq.get_thread_slice(tidx);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(shaped(Shape<Int<kD>, Int<kBlockN>>{}));

  // ldmatrix addresses (sm80_ldsm.cuh): per operand one thread offset (holding the warp's column offset
  // where the operand is read transposed) plus warp-uniform bases (the shuffle makes the warp index visibly
  // uniform). Warp w of a TiledMMA with wm warps along M is (w % wm, w / wm).
  using LdsmQ = LdsmTile<kD, kBlockM>;   // Q and dO, per stage
  using LdsmKV = LdsmTile<kD, kBlockN>;  // K and V
  using LdsmP = LdsmTile<kBlockN, kBlockM>;  // P and dS
  constexpr int kWmS = T::kWarpsMSdP, kWnS = T::kNWarps / kWmS;
  constexpr int kWmKV = T::kWarpsNdKV, kWnKV = T::kNWarps / kWmKV;
  constexpr int kWmQ = T::kWarpsMdQ, kWnQ = T::kNWarps / kWmQ;
  constexpr uint32_t kStageBytes = kBlockM * kD * sizeof(Element);
  const int warp = __shfl_sync(0xffffffff, tidx / 32, 0);
  auto smem_addr = [](auto const& t) { return cast_smem_ptr_to_uint(raw_pointer_cast(t.data())); };
  const uint32_t q_addr = smem_addr(sQ), do_addr = smem_addr(sdO), p_addr = smem_addr(sP), ds_addr = smem_addr(sdS);
  const uint32_t k_addr = smem_addr(sK), v_addr = smem_addr(sV);
  // S and dP: A rows and B n8 tiles (8 kWnS rows apart) get their warp offsets from the bases.
  const uint32_t lane_q = LdsmQ::lane_offset(tidx);
  const uint32_t off_kv = LdsmKV::template thread_offset<8 * kWnS, 8, true>(tidx);
  const uint32_t q_row = 16 * (warp % kWmS) * LdsmQ::kRowBytes;
  const uint32_t kv_row = 8 * (warp / kWmS) * LdsmKV::kRowBytes;
  // dQ: dS rows from the base; K^T's n8 tiles (8 kWnQ columns apart) from the thread offset.
  const uint32_t lane_p = LdsmP::lane_offset(tidx);
  const uint32_t ds_row = 16 * (warp % kWmQ) * LdsmP::kRowBytes;
  const uint32_t off_kt = LdsmKV::template thread_offset<8, 8 * kWnQ>(tidx, 0, 8 * (warp / kWmQ));
  // dV and dK: the M tiles of P^T / dS^T and the n8 tiles of dO^T / Q^T are columns of their smem tiles.
  const uint32_t off_pt = LdsmP::template thread_offset<8, 8, true>(tidx, 0, 16 * (warp % kWmKV));
  const uint32_t off_qt = LdsmQ::template thread_offset<8, 8 * kWnKV>(tidx, 0, 8 * (warp / kWmKV));

  // P and dS leave registers for smem through the S accumulator's layout.
  auto copy_p = make_tiled_copy_C(typename T::StoreC{}, mma_sdp);
  auto thr_copy_p = copy_p.get_thread_slice(tidx);
  Tensor tPsP = thr_copy_p.partition_D(sP);
  Tensor tPsdS = thr_copy_p.partition_D(sdS);

  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;  // accumulator rows this thread holds

  for (int g = 0; g < group; ++g) {
    const int head = head_k * group + g;
    auto q_tiles = [&](const void* ptr, int64_t batch_stride, int64_t row_stride, int64_t head_stride) {
      auto* base = static_cast<const Element*>(ptr) + batch * batch_stride + seq.q_start * row_stride +
                   head * head_stride;
      return local_tile(make_tensor(make_gmem_ptr(base), make_shape(seqlen_q, Int<kD>{}), make_stride(row_stride, _1{})),
                        Shape<Int<kBlockM>, Int<kD>>{}, make_coord(_, 0));  // (BM, D, m)
    };
    Tensor tQgQ = load_thr.partition_S(q_tiles(p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride));
    Tensor tdOgdO = load_thr.partition_S(q_tiles(p.dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride));
    const int64_t acc0 = acc_row0(p, T::kVarlen, batch, head, seq.q_start);
    const float* lse_ptr = p.lse_log2 + acc0;
    const float* dsum_ptr = p.dsum + acc0;
    float* dq_acc_ptr = p.dq_accum + acc0 * kD;
    float slope = 0.f;
    if constexpr (T::kAlibi) slope = p.alibi_slopes[batch * p.alibi_batch_stride + head] * p.alibi_scale;
    const DropoutRng rng = make_dropout_rng<T::kDropout>(p, batch, head);

    auto load_q_do = [&](int m, int stage) {
      const int rows = seqlen_q - m * kBlockM;
      copy_zfill(load, tQgQ(_, _, _, m), tQsQ(_, _, _, stage), tQcQ, rows, T::kHeadDim);
      copy_zfill(load, tdOgdO(_, _, _, m), tdOsdO(_, _, _, stage), tQcQ, rows, T::kHeadDim);
    };
    CUTE_UNROLL
    for (int s = 0; s < T::kStages - 1; ++s) {
      if (m_min + s < m_max) load_q_do(m_min + s, s);
      cp_async_fence();  // always commit, so the wait counts below are uniform
    }

    for (int m = m_min, it = 0; m < m_max; ++m, ++it) {
      const int stage = T::kStages == 1 ? 0 : it % T::kStages;
      // The stage refilled here was last read in the previous step, which ended with a barrier.
      if (m + T::kStages - 1 < m_max) load_q_do(m + T::kStages - 1, (it + T::kStages - 1) % T::kStages);
      cp_async_fence();
      cp_async_wait<T::kStages - 1>();
      __syncthreads();

      const int row0 = m * kBlockM;
      float lse_log2[kRows], dsum[kRows];
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = row0 + get<0>(tScS_rc(r, 0));  // may pass seqlen_q: the buffers are padded
        lse_log2[r] = lse_ptr[row];
        dsum[r] = dsum_ptr[row];
      }

      Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      const uint32_t q_stage = q_addr + stage * kStageBytes, do_stage = do_addr + stage * kStageBytes;
      gemm_pipelined(
          acc_s, tSrQ, tSrK, mma_sdp,
          [&](int i) { LdsmQ::template load_a<16 * kWmS>(tSrQ, q_stage + q_row, lane_q, i); },
          [&](int i, int n) { LdsmKV::template load_b<8 * kWnS, true>(tSrK, k_addr + kv_row, off_kv, i, n); });
      Tensor s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
      Tensor dtanh = make_fragment_like(s);  // 1 - tanh^2 of the capped scores (softcap only)
      if constexpr (T::kSoftcap) {
        CUTE_UNROLL
        for (int i = 0; i < size(s); ++i) {
          const float t = fast_tanh(s(i) * p.score_scale);
          s(i) = t;
          dtanh(i) = 1.f - t * t;
        }
      }
      if constexpr (T::kAlibi) add_alibi(s, tScS_rc, row0, col0, diag, slope);
      if (tile_is_cut<T::kMask>(row0, kBlockM, col0, kBlockN, seqlen_k, diag, p.window_left, p.window_right)) {
        mask_tile<T::kMask>(s, tScS_rc, row0, col0, seqlen_k, diag, p.window_left, p.window_right);
      }
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(s); ++c) s(r, c) = fast_exp2(s(r, c) * p.scale_log2 - lse_log2[r]);
      }
      if constexpr (T::kDropout) {
        // The sign of P carries the keep decision to dS (P >= 0; a dropped 0 reads as kept, which changes nothing).
        // A warp holds both n8 halves of a 16-key tile unless the warps split the keys.
        dropout_scores<kWnS == 1>(s, tScS_rc, row0, col0, rng, [](float& x, bool kept) { x = kept ? x : -x; });
      }
      Tensor p_frag = [&] {
        if constexpr (T::kDropout) {
          return kept_probs<Element>(acc_s, p.dropout_scale);
        } else {
          return convert_to<Element>(acc_s);
        }
      }();
      copy(copy_p, thr_copy_p.retile_S(p_frag), tPsP);

      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_dp);
      gemm_pipelined(
          acc_dp, tdPrdO, tdPrV, mma_sdp,
          [&](int i) { LdsmQ::template load_a<16 * kWmS>(tdPrdO, do_stage + q_row, lane_q, i); },
          [&](int i, int n) { LdsmKV::template load_b<8 * kWnS, true>(tdPrV, v_addr + kv_row, off_kv, i, n); });
      Tensor ds = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(ds); ++c) {
          if constexpr (T::kDropout) {
            const float prob = s(r, c);
            ds(r, c) = fabsf(prob) * ((prob >= 0.f ? ds(r, c) * p.dropout_scale : 0.f) - dsum[r]);
          } else {
            ds(r, c) = s(r, c) * (ds(r, c) - dsum[r]);
          }
          if constexpr (T::kSoftcap) ds(r, c) *= dtanh(r, c);
        }
      }
      Tensor ds_frag = convert_to<Element>(acc_dp);
      copy(copy_p, thr_copy_p.retile_S(ds_frag), tPsdS);
      __syncthreads();  // P and dS visible to every warp

      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kD>>{});
      clear(acc_dq);
      gemm_pipelined(
          acc_dq, tdQrdS, tdQrKt, mma_dq,
          [&](int i) { LdsmP::template load_a<16 * kWmQ>(tdQrdS, ds_addr + ds_row, lane_p, i); },
          [&](int i, int n) { LdsmKV::template load_bt<8 * kWnQ>(tdQrKt, k_addr, off_kt, i, n); });
      Tensor tdQgdQ = thr_dq.partition_C(make_tensor(make_gmem_ptr(dq_acc_ptr + int64_t(row0) * kD),
                                                     Shape<Int<kBlockM>, Int<kD>>{}, Stride<Int<kD>, _1>{}));
      add_dq<T::kDeterministic, kLeftBound, kBlockN>(p, tdQgdQ, acc_dq, acc0 + row0, n_block, row0 + diag);

      gemm_pipelined(
          acc_dv, tdVrPt, tdVrdOt, mma_dkv,
          [&](int i) { LdsmP::template load_at<16 * kWmKV>(tdVrPt, p_addr, off_pt, i); },
          [&](int i, int n) { LdsmQ::template load_bt<8 * kWnKV>(tdVrdOt, do_stage, off_qt, i, n); });
      gemm_pipelined(
          acc_dk, tdKrdSt, tdKrQt, mma_dkv,
          [&](int i) { LdsmP::template load_at<16 * kWmKV>(tdKrdSt, ds_addr, off_pt, i); },
          [&](int i, int n) { LdsmQ::template load_bt<8 * kWnKV>(tdKrQt, q_stage, off_qt, i, n); });
      __syncthreads();  // every warp is done with P, dS and this Q/dO stage before they are overwritten
    }
  }

  // Epilogue: scale dK, stage dK and dV through the K/V buffers and store them with 16-byte vectors.
  cp_async_wait<0>();
  __syncthreads();  // no copy into smem in flight (a CTA that visited no query tile still loaded K/V)
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.softmax_scale;
  auto copy_dkv_c = make_tiled_copy_C(typename T::StoreC{}, mma_dkv);
  auto thr_copy_dkv = copy_dkv_c.get_thread_slice(tidx);
  Tensor dk_frag = convert_to<Element>(acc_dk);
  Tensor dv_frag = convert_to<Element>(acc_dv);
  copy(copy_dkv_c, thr_copy_dkv.retile_S(dk_frag), thr_copy_dkv.partition_D(sK));
  copy(copy_dkv_c, thr_copy_dkv.retile_S(dv_frag), thr_copy_dkv.partition_D(sV));
  __syncthreads();

  typename T::GmemStore store;
  auto store_thr = store.get_thread_slice(tidx);
  Tensor tKVcKV_st = store_thr.partition_D(cKV);
  copy_predicated(store, store_thr.partition_S(sK), store_thr.partition_D(gdK), tKVcKV_st, seqlen_k - col0,
                  T::kHeadDim);
  copy_predicated(store, store_thr.partition_S(sV), store_thr.partition_D(gdV), tKVcKV_st, seqlen_k - col0,
                  T::kHeadDim);
}

}  // namespace flash_gen
