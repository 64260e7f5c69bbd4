// Hopper backward (docs/hopper_backward.md), the sm90 default where it applies: FlashAttention-2's algorithm with
// the five GEMMs on wgmma, in the transposed form FlashAttention-3 uses so that P and dS never need a shuffle:
//   S^T = K Q^T, dP^T = V dO^T      (SS; warpgroup w holds keys [64w, 64w + 64) x the step's kBlockM queries)
//   P^T = exp2(S^T * scale_log2 - lse_log2[q]),  dS^T = P^T * (dP^T - rowsum(dO * O)[q])
//   dV += P^T dO, dK += dS^T Q      (RS: P^T and dS^T straight from the S^T accumulators' registers)
//   dQ_accum += dS K                (SS: dS through shared memory, query-major; fp32 reductions to global)
//   (80-query steps, no wgmma M: dQ^T = K^T dS^T instead, dS key-major; kDqTransposed below)
// One CTA (two warpgroups, 256 threads) owns a 128-key tile of K and V for one (batch, KV head) and walks the
// query tiles that see it, for every query head sharing that KV head, like the portable backward (bwd_sm80.cuh),
// with its parameters (BwdParams, after TMA maps of q and dout), preprocess and dQ conversion. One thread loads the
// next query tile's Q, dO and row statistics (lse, rowsum(dO * O)) by TMA into the other of two buffers while this
// one computes (completing on that buffer's mbarrier); K and V arrive once by cp.async; a barrier ends each query
// tile. Warp specialisation (a producer warp, no block-wide barriers) is the next step. Head dims up to 128,
// computed as 64 or 128 (loads zero-fill the columns past the tensors' head dim, stores skip them), and 256 (the
// warpgroups splitting the head dim, below); masks, ALiBi, softcap, dropout, dense or packed ragged batches,
// dQ additions in a fixed order when deterministic (bwd_dq.cuh).
#pragma once
#include "flash_gen/bwd_dq.cuh"
#include "flash_gen/bwd_key_tile.cuh"
#include "flash_gen/bwd_params.cuh"
#include "flash_gen/bwd_sm90_params.cuh"
#include "flash_gen/convert_pairs.cuh"
#include "flash_gen/dropout_transposed.cuh"
#include "flash_gen/score_mods.cuh"  // fast_tanh: the forward's softcap
#include "flash_gen/sm80_utils.cuh"  // copy_zfill, copy_predicated (K/V in by cp.async, dK/dV out)
#include "flash_gen/sm90_bulk.cuh"
#include "flash_gen/sm90_sync.cuh"
#include "flash_gen/sm90_wgmma.cuh"

namespace flash_gen {

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, bool kOverlap_, Mask kMask_,
          bool kSoftcap_, bool kAlibi_, bool kVarlen_, bool kDeterministic_, bool kDqBulk_, bool kDecoupled_,
          bool kDropout_>
struct Sm90BwdTraits {
  using Element = Element_;
  // What the GEMMs compute: 64, 128 or 256, or (narrow tilings) 96. The tensors' head dim (BwdParams::head_dim) is
  // a runtime value: loads zero-fill the columns past it and stores skip them, so one kernel serves every head dim
  // computed as this one (flash_gen.gen.render.kernel_key), for the cost of a few compares per CTA.
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // queries per step: the N of S^T, the M of dQ
  // Head dim 256 (docs/hopper_backward.md): 64 x 256 of dK and dV do not fit one warpgroup's registers, so the
  // warpgroups split the head dim: one CTA owns 64 keys, warpgroup 0 computes S^T and warpgroup 1 dP^T at the same
  // time, P^T and dS^T pass through shared memory, and dV, dK and dQ are SS GEMMs over each warpgroup's half.
  static constexpr bool kSplitHeadDim = kHeadDim_ > 128;
  static constexpr int kBlockN = kBlockN_;  // keys per CTA: 64 per warpgroup, or (split) 64 shared
  static_assert(kBlockN == (kSplitHeadDim ? 64 : 128));
  static constexpr int kNThreads = 256;
  static constexpr int kStages = 2;  // Q/dO buffers
  static constexpr Mask kMask = kMask_;
  // Softcap: S^T = tanh(S^T * score_scale) (scale_log2 carries the cap) and dS^T times 1 - tanh^2, with the
  // forward's tanh.approx so P is the one it normalised. The split head dim forms dS^T in warpgroup 1, which never
  // sees the scores: warpgroup 0 hands it P^T (1 - tanh^2) in a second P^T buffer.
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr bool kAlibi = kAlibi_;
  static constexpr bool kVarlen = kVarlen_;
  static constexpr bool kDeterministic = kDeterministic_;
  // Dropout (docs/dropout.md): the forward's keep decisions redrawn as bits (dropout_keep_bits_t) while S^T and dP^T
  // compute; dV takes Z P^T / (1 - p), dS^T = P^T (Z dP^T / (1 - p) - rowsum(dO * O)). Split, warpgroup 1 forms dS^T
  // from a second copy of P^T whose dropped scores carry a set sign bit (the first, dV's operand, holds them as 0).
  static constexpr bool kDropout = kDropout_;
  // Whether the dK/dV wgmmas run on through the dS barrier and the dQ GEMM (a tunable, Sm90BwdConfig.overlap).
  static constexpr bool kOverlapDkvDq = kOverlap_;
  // dQ through shared memory and out by TMA reductions (Sm90BwdConfig.dq_bulk): the consumers store their
  // accumulators into 32-column boxes swizzled by 128 bytes (in stage_dq's order, free of bank conflicts; at head dim
  // 96 16 columns and 64 bytes, below), and thread 0 adds the boxes into dq_accum (map tma_dq), taking the
  // per-element reductions off the load/store queue. (Until 2026-12-03 every warp's lane 0 sent 8 padded rows by
  // row-wise bulk reductions: a loop of 8 uniform-datapath instructions that took about 14% of the warps' time, ncu
  // source counters, docs/hopper_backward.md.)
  // Split head dim: no shared memory is left for a dQ buffer, so the warpgroups stage their halves (32 KB each) in
  // the step's dO and Q buffers, dead once its GEMMs are (the next tile's load into them waits for their reads).
  static constexpr bool kDqBulk = kDqBulk_;
  static_assert(!kDqBulk || !kDeterministic);
  // Decoupled warpgroups (Sm90BwdConfig.decoupled, unsplit bulk dQ): they meet once per step, at the dS barrier,
  // rather than also at its end, so one can run its next GEMMs while the other finishes its softmax or dQ. What the
  // closing barrier guarded: dS is double-buffered; the next tile's Q and dO load after the dS barrier (by then the
  // other warpgroup has done every GEMM of the step before, the last to read that buffer); each warpgroup stages
  // and sends its own half of dQ.
  static constexpr bool kDecoupled = kDecoupled_;
  static_assert(!kDecoupled || (kDqBulk && !kSplitHeadDim));
  static constexpr int kDsStages = kDecoupled ? 2 : 1;
  // Query steps that are no wgmma M (80, FlashAttention-3's head dim 128 tiling: S^T and dP^T 64 x 80 per
  // warpgroup read K and V a fifth less often per FLOP than 64-query steps, in the registers 128-query steps lack):
  // dQ is computed transposed, dQ^T = K^T dS^T, the warpgroups splitting the head dim as its M, and dS is stored
  // key-major (the K-major B operand) by transposing stmatrix; the accumulators go to the staging buffer one float at
  // a time (its swizzle keeps a warp's stores on distinct banks).
  static constexpr bool kDqTransposed = kBlockM_ % 64 != 0;
  static_assert(!kDqTransposed || (kHeadDim_ == 128 && kDqBulk && kBlockM_ % 16 == 0));
  // fp32 columns of a dQ box, one swizzle row: 32 (128 bytes), or at head dim 96 16 (64 bytes), since each
  // warpgroup's dQ wgmma covers 48 columns, which must be whole boxes for the accumulators to partition the buffer.
  static constexpr int kDqBoxCols = (kHeadDim / 2) % 32 == 0 ? 32 : 16;
  // P^T's exponentials while the dP^T GEMM computes (S^T waited for alone), dS^T after it. At head dim 64 that
  // measured +3% fwd+bwd without a mask and level causal; at 128 -1..-2% (H200, 2026-12-04, docs/hopper_backward.md).
  // Not with softcap, whose dS^T needs each score's tanh, gone by then.
  static constexpr bool kExpUnderDp = kHeadDim_ <= 64 && !kSoftcap_;
  // 128-query steps (head dim 64): the warpgroups split dQ's rows rather than its columns, so each dQ wgmma is
  // N = 64 over its own 64 rows of dS: 64 KB of shared-memory operands per step instead of 96 (each warpgroup read
  // all of dS for N = 32). dq_accum's TMA boxes are then 64 rows (flash_gen.spec_bwd_sm90.dq_box_rows).
  static constexpr bool kDqRowHalves = kBlockM_ == 128 && !kSplitHeadDim && !kDqTransposed;
  static constexpr int kDqBoxRows = kDqRowHalves ? 64 : kBlockM_;
  static constexpr int kDqStageCols = kSplitHeadDim ? kHeadDim / 2 : kHeadDim;  // columns staged at once
  using SmemLayoutdQ = decltype(tile_to_shape(
      composition(Swizzle<kDqBoxCols == 32 ? 3 : 2, 2, 3>{},
                  Layout<Shape<_8, Int<kDqBoxCols>>, Stride<Int<kDqBoxCols>, _1>>{}),
      Shape<Int<kBlockM>, Int<kDqStageCols>>{}));
  // The staging buffer seen as the whole (queries, head dim) tile, the halves on the same bytes: each warpgroup's
  // dQ accumulators partition it like the global tile.
  using SmemLayoutdQTile = decltype(composition(
      SmemLayoutdQ{}, Layout<Shape<Int<kBlockM>, Shape<Int<kDqStageCols>, Int<kHeadDim / kDqStageCols>>>,
                             Stride<_1, Stride<Int<kBlockM>, _0>>>{}));
  // What the dQ accumulators partition: that tile, or (transposed dQ) the same bytes as (head dim, queries).
  using SmemLayoutdQAcc = cute::conditional_t<
      kDqTransposed,
      decltype(composition(SmemLayoutdQTile{},
                           make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, Stride<Int<kBlockM>, _1>{}))),
      SmemLayoutdQTile>;
  static_assert((kHeadDim % 64 == 0 || kHeadDim == 96) && kHeadDim <= 256);
  // Columns of each warpgroup's dK/dV GEMM (its N: the whole head dim, or split half of it), whose MN-major B
  // operands (Q^T, dO^T) must be whole swizzle atoms: 96 (head dim 96, or 192 split) takes 32-column ones.
  static constexpr int kDkvCols = kSplitHeadDim ? kHeadDim / 2 : kHeadDim;
  // A TMA box row is one swizzle row: 64 columns (128 bytes), or at head dim 96 32 (64 bytes; its rows are three such
  // boxes, and the K-major atom seen head-dim-major is the MN-major 64-byte one the dK/dV GEMMs read).
  static constexpr int kBoxCols = kDkvCols % 64 == 0 ? 64 : 32;
  using SmemAtom = cute::conditional_t<kBoxCols == 64, GMMA::Layout_K_SW128_Atom<Element>,
                                       GMMA::Layout_K_SW64_Atom<Element>>;
  // K and V (loaded by cp.async, any swizzle): at head dim 96 in 32-byte swizzle rows of 16 columns, since K^T is
  // the MN-major B operand of each warpgroup's 48 dQ columns, a whole number of such atoms but not of 32-column ones.
  using SmemAtomKV = cute::conditional_t<(kHeadDim / 2) % 32 == 0, SmemAtom, GMMA::Layout_K_SW32_Atom<Element>>;
  using SmemLayoutQ =  // Q and dO: (queries, head dim, stage)
      decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));  // K and V
  // The same bytes seen head-dim-major: Q^T / dO^T and K^T as MN-major B operands.
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  // dS (queries, keys), query-major: the MN-major A operand of dQ = dS K (transposed dQ: key-major, the K-major B
  // operand of dQ^T = K^T dS^T).
  using SmemLayoutdS = decltype(tile_to_shape(
      cute::conditional_t<kDqTransposed, GMMA::Layout_K_SW128_Atom<Element>, GMMA::Layout_MN_SW128_Atom<Element>>{},
      Shape<Int<kBlockM>, Int<kBlockN>>{}));
  // dS^T stores from the S^T accumulators: 8 keys of a query adjacent in the key-major tile need the transposing
  // stmatrix, 8 queries of a key in the query-major one the plain one.
  using DsStoreAtom = cute::conditional_t<kDqTransposed, SM90_U16x8_STSM_T, SM90_U32x4_STSM_N>;
  // The same bytes as (keys, queries): where the S^T accumulators' dS^T values land.
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, Stride<Int<kBlockM>, _1>{})));

  // Split: P^T and dS^T (keys, queries) as K-major A operands of dV and dK; the same bytes as SmemLayoutdS. (Unused
  // otherwise, where 80 queries would be no whole number of swizzle rows.)
  using SmemLayoutPt = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                              Shape<Int<kBlockN>, Int<kSplitHeadDim ? kBlockM : 64>>{}));

  // S^T and dP^T: each warpgroup 64 keys of its own (or, split, one warpgroup per GEMM over all 64 keys).
  using MmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockM>, Int<kHeadDim>>>(),
      Layout<Shape<Int<kSplitHeadDim ? 1 : 2>, _1, _1>>{}));
  using MmadKV = cute::conditional_t<
      kSplitHeadDim,
      decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim / 2>, Int<kBlockM>>,
                                                   GMMA::Major::K, GMMA::Major::MN>(),
                              Layout<Shape<_1, _2, _1>>{})),
      decltype(make_tiled_mma(GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockM>>,
                                                   GMMA::Major::K, GMMA::Major::MN>(),
                              Layout<Shape<_2, _1, _1>>{}))>;
  // dQ: the tile's queries x head dim, the warpgroups splitting the head dim (kDqRowHalves: the queries; transposed:
  // head dim x queries, the warpgroups splitting the head dim as M). DqTile: the accumulator's (rows, cols).
  using MmadQ = cute::conditional_t<
      kDqTransposed,
      decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockM>, Int<kBlockN>>,
                                                   GMMA::Major::MN, GMMA::Major::K>(),
                              Layout<Shape<_2, _1, _1>>{})),
      cute::conditional_t<
          kDqRowHalves,
          decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                                                       GMMA::Major::MN, GMMA::Major::MN>(),
                                  Layout<Shape<_2, _1, _1>>{})),
          decltype(make_tiled_mma(
              GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim / 2>, Int<kBlockN>>,
                                   GMMA::Major::MN, GMMA::Major::MN>(),
              Layout<Shape<_1, _2, _1>>{}))>>;
  using DqTile =
      cute::conditional_t<kDqTransposed, Shape<Int<kHeadDim>, Int<kBlockM>>, Shape<Int<kBlockM>, Int<kHeadDim>>>;

  using GmemLoad = typename GmemCopy<Element, kNThreads, kHeadDim>::Load;
  using GmemStore = typename GmemCopy<Element, kNThreads, kHeadDim>::Store;
  // A tile's row statistics (lse, rowsum(dO * O)) arrive by bulk copy from the 16-byte boundary at or before its
  // first row: packed batches start entries at any row.
  static constexpr int kStatFloats = kBlockM + 4;
  static constexpr uint32_t kStageTxBytes =  // Q and dO tiles, and the statistics
      2 * kBlockM * kHeadDim * sizeof(Element) + 2 * kStatFloats * sizeof(float);
  // Split: P^T, the operand of dV (and where warpgroup 1 reads P^T back for dS^T), and with dropout or softcap the
  // second P^T warpgroup 1 reads instead: signed by the keep bits, times 1 - tanh^2.
  static constexpr bool kSecondPt = kSplitHeadDim && (kDropout || kSoftcap);
  static constexpr int kSplitBytes = kSplitHeadDim ? (kSecondPt ? 2 : 1) * kBlockN * kBlockM * int(sizeof(Element)) : 0;
  // Q, dO, K, V and dS; the bulk dQ buffer follows, at the 1024-byte alignment its 128-byte swizzle assumes.
  static constexpr int kTileBytes = int(sizeof(Element)) *
      (2 * kStages * kBlockM * kHeadDim + 2 * kBlockN * kHeadDim + kDsStages * kBlockM * kBlockN);
  static_assert(!kDqBulk || (kSplitHeadDim ? kBlockM * kHeadDim * int(sizeof(Element)) == kBlockM * kDqStageCols * 4
                                           : kTileBytes % 1024 == 0));
  static constexpr int kSmemBytes =
      kTileBytes + (kDqBulk && !kSplitHeadDim ? kBlockM * kHeadDim * int(sizeof(float)) : 0) + kSplitBytes +
      2 * kStages * kStatFloats * int(sizeof(float)) + kStages * int(sizeof(MBarrier));
};

// threadIdx.x through an opaque read: the epilogue's thread offsets are then recomputed after the main loop rather
// than kept live across it (or spilled) from the prologue's identical K/V load offsets.
__device__ __forceinline__ int opaque_thread_idx() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

__device__ __forceinline__ void st_shared_f32x2(uint32_t addr, float2 v) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(v.x), "f"(v.y) : "memory");
}

template <class T>
__device__ __forceinline__ void bwd_sm90_kernel(Sm90BwdParams const& sp) {
  BwdParams const& p = sp.base;
  using Element = typename T::Element;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kD = T::kHeadDim;
  // Split or decoupled bulk dQ: the named barrier of each warpgroup's staged half (id kDqHalfStaged + warpgroup).
  constexpr int kDqHalfStaged = 1;
  constexpr int kSdpIssued = 3;  // late dK: warpgroup 0's S^T and dP^T are issued (below)
  // Without the overlap (unsplit): dV issued before the dS barrier, dK after the dQ GEMM, running on under dQ's
  // store until the step's end (FlashAttention-4's order).
  constexpr bool kLateDk = !T::kOverlapDkvDq && !T::kSplitHeadDim;
  // Late dK, warpgroups not decoupled: warpgroup 0, ahead by its staggered S^T/dP^T (below), issues its dK right after
  // its dS^T store, beside its dV and under warpgroup 1's softmax; warpgroup 1 keeps dK after the dQ GEMM. (Decoupled,
  // ptxas re-stages the dK/dV operands and silently serialises every wgmma: docs/hopper_backward.md.)
  constexpr bool kEarlyDk0 = kLateDk && !T::kDecoupled;
  // Split bulk dQ: the next tile's Q and dO are loaded once the last step's halves have been read from the buffers
  // that load refills, after the step's softmax rather than under its first GEMMs; decoupled: after the dS barrier.
  constexpr bool kLateLoad = (T::kDqBulk && T::kSplitHeadDim) || T::kDecoupled;
  // Bulk dQ: the threads that send staged dQ (thread 0; with a half per warpgroup, each warpgroup's first).
  constexpr bool kDqHalves = T::kSplitHeadDim || T::kDecoupled;
  extern __shared__ __align__(1024) char smem_buf[];
  Element* smem_q = reinterpret_cast<Element*>(smem_buf);
  Element* smem_do = smem_q + T::kStages * kBlockM * kD;
  Element* smem_k = smem_do + T::kStages * kBlockM * kD;
  Element* smem_v = smem_k + kBlockN * kD;
  Element* smem_ds = smem_v + kBlockN * kD;
  // Bulk dQ only, 1024-byte aligned (split: the step's dO and Q buffers hold the warpgroups' halves instead).
  float* smem_dq = reinterpret_cast<float*>(smem_ds + T::kDsStages * kBlockM * kBlockN);
  // Split only: P^T, a 1024-byte aligned operand (dropout: then its signed copy).
  Element* smem_pt = reinterpret_cast<Element*>(smem_dq + (T::kDqBulk && !T::kSplitHeadDim ? kBlockM * kD : 0));
  float* smem_lse = reinterpret_cast<float*>(smem_pt + T::kSplitBytes / int(sizeof(Element)));  // per buffer
  float* smem_dsum = smem_lse + T::kStages * T::kStatFloats;
  MBarrier* q_full = reinterpret_cast<MBarrier*>(smem_dsum + T::kStages * T::kStatFloats);  // per Q/dO buffer

  const int tidx = threadIdx.x;
  const int head_k = blockIdx.y;
  BwdKeyTile tile;
  if (!bwd_key_tile<T::kVarlen, T::kMask, kBlockM, kBlockN>(p, tile)) return;
  const int batch = tile.batch, n_block = tile.n_block, diag = tile.diag, m_min = tile.m_min, m_max = tile.m_max;
  const SeqInfo& seq = tile.seq;
  const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
  const int group = p.nheads / p.nheads_k;
  const int col0 = n_block * kBlockN;

  if (tidx == 0) {
    prefetch_tensor_map(sp.tma_q);
    prefetch_tensor_map(sp.tma_do);
    if constexpr (T::kDqBulk) prefetch_tensor_map(sp.tma_dq);
    for (int s = 0; s < T::kStages; ++s) q_full[s].init(1);
    fence_barrier_init();
  }
  // Dense: each entry's rows through the maps' batch coordinate; packed: rows from q_start of the whole tensor,
  // whose boxes may run into the next entry (finite values whose lse padding makes P and dS zero).
  const int tma_batch = T::kVarlen ? 0 : batch;
  // The entry's first query row (seq.q_start): packed, read again where used rather than held in a register
  // through the steps. At 255 registers that one counts: the packed causal head dim 128 key's `wgbm64n128b` then
  // compiles without spills (4 B of spill stores before) and `wgbm64n128ob` stores 4 B instead of 20 (NVRTC 13.0).
  auto entry_q_start = [&] {
    int q_start = 0, len;
    if constexpr (T::kVarlen) packed_range(p.cu_seqlens_q, batch, p.seqlen_q, q_start, len);
    return q_start;
  };
  // Thread 0 only: query tile m of head `head` into buffer `stage`. A buffer is refilled after the barrier that ends
  // the step that last read it.
  auto load_q_do = [&](int head, int m, int stage) {
    const int q_start = entry_q_start();
    const int64_t acc0 = acc_row0(p, T::kVarlen, batch, head, q_start);
    const int stat_shift = T::kVarlen ? int(acc0 & 3) : 0;
    q_full[stage].arrive_expect_tx(T::kStageTxBytes);
    CUTE_UNROLL
    for (int c = 0; c < kD / T::kBoxCols; ++c) {
      const int offset = (stage * kD + c * T::kBoxCols) * kBlockM;
      const int row = q_start + m * kBlockM;
      tma_load_4d(sp.tma_q, q_full[stage], smem_q + offset, c * T::kBoxCols, row, head, tma_batch);
      tma_load_4d(sp.tma_do, q_full[stage], smem_do + offset, c * T::kBoxCols, row, head, tma_batch);
    }
    // The row buffers are padded to whole tiles (lse +inf, dsum 0 past seqlen_q); the up to 4 floats read past a
    // tile stay inside their allocation (runtime/bwd.py: lse_log2, dsum and dq_accum are parts of one buffer).
    const int64_t stat0 = acc0 + m * kBlockM - stat_shift;
    bulk_load(smem_lse + stage * T::kStatFloats, p.lse_log2 + stat0, T::kStatFloats * sizeof(float), q_full[stage]);
    bulk_load(smem_dsum + stage * T::kStatFloats, p.dsum + stat0, T::kStatFloats * sizeof(float), q_full[stage]);
  };
  // The first tile's loads go out with K and V's.
  if (tidx == 0 && m_min < m_max) load_q_do(head_k * group, m_min, 0);

  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename T::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem_do), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename T::SmemLayoutK{});
  Tensor sQt = make_tensor(make_smem_ptr(smem_q), typename T::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(smem_do), typename T::SmemLayoutQt{});
  Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename T::SmemLayoutKt{});

  auto kv_tile = [&](auto* base, int64_t batch_stride, int64_t row_stride, int64_t head_stride) {
    return tile.kv<kBlockN, kD>(base, batch_stride, row_stride, head_stride, head_k);
  };
  typename T::GmemLoad load;
  auto load_thr = load.get_thread_slice(tidx);
  Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kD>>{});
  Tensor tKVcKV = load_thr.partition_D(cKV);
  copy_zfill(load, load_thr.partition_S(kv_tile(static_cast<const Element*>(p.k), p.k_batch_stride, p.k_row_stride,
                                                p.k_head_stride)),
             load_thr.partition_D(sK), tKVcKV, seqlen_k - col0, p.head_dim);
  copy_zfill(load, load_thr.partition_S(kv_tile(static_cast<const Element*>(p.v), p.v_batch_stride, p.v_row_stride,
                                                p.v_head_stride)),
             load_thr.partition_D(sV), tKVcKV, seqlen_k - col0, p.head_dim);
  cp_async_fence();

  typename T::MmaSdP mma_sdp;
  typename T::MmadKV mma_dkv;
  typename T::MmadQ mma_dq;
  // Warp-uniform, as the shuffle tells the compiler: the smem descriptors, which depend on the warpgroup alone,
  // then live in uniform registers rather than in each thread's.
  const int wg = __shfl_sync(0xffffffff, tidx / 128, 0);
  auto thr_sdp = mma_sdp.get_thread_slice(T::kSplitHeadDim ? tidx % 128 : tidx);
  auto thr_dkv = mma_dkv.get_thread_slice(tidx);
  auto thr_dq = mma_dq.get_thread_slice(tidx);
  auto desc_sdp = mma_sdp.get_thread_slice(T::kSplitHeadDim ? 0 : wg * 128);
  auto desc_dkv = mma_dkv.get_thread_slice(wg * 128);
  auto desc_dq = mma_dq.get_thread_slice(wg * 128);
  Tensor tSrK = desc_sdp.partition_fragment_A(sK);
  Tensor tSrV = desc_sdp.partition_fragment_A(sV);
  auto tdQrKt = [&] {  // K^T: the B operand of dQ, or A of dQ^T
    if constexpr (T::kDqTransposed) return desc_dq.partition_fragment_A(sKt);
    else return desc_dq.partition_fragment_B(sKt);
  }();
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kD>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kD>>{});
  clear(acc_dk);
  clear(acc_dv);
  // Each S^T element's (key, query) within the tile.
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
  // dS^T into the dS tile by stmatrix: each 8 x 8 block's key rows (query-major) or query columns (key-major) are 16
  // contiguous bytes there. (Per element, the stores went through generic 64-bit addresses with the swizzle computed
  // on each.)
  auto ds_store = make_tiled_copy_C(Copy_Atom<typename T::DsStoreAtom, Element>{}, mma_sdp);
  auto thr_ds_store = ds_store.get_thread_slice(T::kSplitHeadDim ? tidx % 128 : tidx);

  cp_async_wait<0>();  // K and V
  fence_smem_for_async_proxy();  // cp.async wrote them through the generic proxy; wgmma reads them
  __syncthreads();  // K and V visible, barriers initialised

  // One thread: columns [col0, col0 + kSendCols) x the row boxes [box0, box0 + kSendRowBoxes) (kDqBoxRows rows
  // each) of the tile whose first dq_accum row is `row`, staged at `buf` (kDqBoxCols-column boxes of kBlockM rows), as
  // one bulk group. A warpgroup's half is half the columns, or (kDqRowHalves) its own row box.
  constexpr bool kRowHalfSends = kDqHalves && T::kDqRowHalves;
  constexpr int kSendCols = kDqHalves && !kRowHalfSends ? kD / 2 : kD;
  constexpr int kSendRowBoxes = kRowHalfSends ? 1 : kBlockM / T::kDqBoxRows;
  auto send_dq = [&](const float* buf, int col0, int box0, int row) {
    CUTE_UNROLL
    for (int c = 0; c < kSendCols / T::kDqBoxCols; ++c) {
      CUTE_UNROLL
      for (int b = box0; b < box0 + kSendRowBoxes; ++b) {
        tma_reduce_add_4d(sp.tma_dq, buf + (c * kBlockM + b * T::kDqBoxRows) * T::kDqBoxCols,
                          col0 + c * T::kDqBoxCols, row + b * T::kDqBoxRows);
      }
    }
    bulk_commit_group();
  };
  // Bulk dQ: the dq_accum row of the last step's tile (-1: none), whose reductions from the shared buffer are
  // issued under the next step's first GEMMs (or after the last step) rather than between the step's closing
  // barrier and those GEMMs, where they would hold back the sender's warpgroup. Decoupled: each warpgroup's half.
  int dq_pending = -1;
  auto reduce_pending_dq = [&] {
    if constexpr (T::kDecoupled) {
      if (tidx % 128 == 0 && dq_pending >= 0) {
        if constexpr (kRowHalfSends) send_dq(smem_dq, 0, wg, dq_pending);
        else send_dq(smem_dq + wg * kBlockM * (kD / 2), wg * (kD / 2), 0, dq_pending);
      }
    } else if constexpr (T::kDqBulk && !T::kSplitHeadDim) {
      if (tidx == 0 && dq_pending >= 0) send_dq(smem_dq, 0, 0, dq_pending);
    }
    dq_pending = -1;
  };

  // Steps count across heads: step t uses buffer t % kStages, whose barrier completes its (t / kStages)-th phase.
  int step = 0;
  for (int g = 0; g < group; ++g) {
    const int head = head_k * group + g;
    float slope = 0.f;  // ALiBi, pre-divided by the softmax scale (alibi_scale) as scale_log2 multiplies it back
    if constexpr (T::kAlibi) slope = p.alibi_slopes[batch * p.alibi_batch_stride + head] * p.alibi_scale;
    const int64_t acc0 = acc_row0(p, T::kVarlen, batch, head, entry_q_start());
    const DropoutRng rng = make_dropout_rng<T::kDropout>(p, batch, head);
    // The statistics' rows from the 16-byte boundary; dense rows start at multiples of block_m (acc_row0).
    const int stat_shift = T::kVarlen ? int(acc0 & 3) : 0;
    if (tidx == 0 && m_min < m_max && g > 0) load_q_do(head, m_min, step % T::kStages);

    for (int m = m_min; m < m_max; ++m, ++step) {
      const int row0 = m * kBlockM, stage = step % T::kStages;
      q_full[stage].wait((step / T::kStages) & 1);  // this step's Q, dO and row statistics have landed
      auto load_next = [&] {
        if (tidx == 0 && m + 1 < m_max) load_q_do(head, m + 1, (step + 1) % T::kStages);
      };
      // Issued once this step's first GEMMs are, so that they do not wait for it: thread 0 fills the other buffer
      // (free since the last step's closing barrier), and the last step's dQ leaves.
      auto under_first_gemms = [&] {
        if constexpr (!kLateLoad) load_next();
        reduce_pending_dq();
      };
      const float* lse = smem_lse + stage * T::kStatFloats + stat_shift;
      const float* dsum = smem_dsum + stage * T::kStatFloats + stat_shift;
      // The statistics of queries q and q + 1 (q even): one 8-byte load where dense rows keep them aligned.
      auto stat_pair = [&](const float* rows, int q) {
        if constexpr (T::kVarlen) return make_float2(rows[q], rows[q + 1]);
        else return *reinterpret_cast<const float2*>(rows + q);
      };
      Tensor tSrQ = desc_sdp.partition_fragment_B(sQ(_, _, stage));
      Tensor tSrdO = desc_sdp.partition_fragment_B(sdO(_, _, stage));
      Tensor tdVrdOt = desc_dkv.partition_fragment_B(sdOt(_, _, stage));
      Tensor tdKrQt = desc_dkv.partition_fragment_B(sQt(_, _, stage));
      Element* ds_buf = smem_ds + (T::kDecoupled ? stage * kBlockM * kBlockN : 0);
      Tensor sdS = make_tensor(make_smem_ptr(ds_buf), typename T::SmemLayoutdS{});
      Tensor tdSsdSt = thr_ds_store.partition_D(make_tensor(make_smem_ptr(ds_buf), typename T::SmemLayoutdSt{}));
      // Dropout: the keep bits of this thread's S^T elements (drawn under the step's first GEMMs).
      uint32_t keep[T::kDropout ? (kBlockM / 2 + 31) / 32 : 1];
      auto draw_keep = [&] {
        if constexpr (T::kDropout) dropout_keep_bits_t(keep, cS, row0, col0, rng);
      };

      // dS^T's element v = P^T (dP^T - d) in place of dP^T, P^T in acc_s, d its query's rowsum(dO * O); dropout:
      // P^T (Z dP^T / (1 - p) - d), and acc_s then holds dV's operand, P^T kept and scaled.
      auto ds_element = [&](auto& acc_s, auto& acc_dp, int v, float d) {
        const float pt = acc_s(v);
        float dp = acc_dp(v);
        if constexpr (T::kDropout) {
          const bool kept = kept_bit(keep, v);
          acc_s(v) = kept ? pt * p.dropout_scale : 0.f;
          dp = kept ? dp * p.dropout_scale : 0.f;
        }
        acc_dp(v) = pt * (dp - d);
      };
      // P^T in place of S^T (a hidden (query, key) pair gives P = 0), and, with_dp, dS^T in place of dP^T
      // (ds_element; without dp, P^T as it is).
      // Coordinates as offsets from the thread's first element fold into constants (attn_mask.cuh does the same):
      // an element's key offset from its query's diagonal is base + off, so the bounds become per-thread limits on
      // the constant off, compared against immediates.
      // `masked`: whether any element may be hidden; steps inside every bound (see `interior`) skip the checks.
      auto softmax_grad = [&](auto& acc_s, auto& acc_dp, auto with_dp, auto masked) {
        const int key0 = get<0>(cS(0)), q0 = get<1>(cS(0));
        const int base = col0 + key0 - (row0 + q0 + diag), key_end = seqlen_k - col0 - key0;
        const int right = p.window_right - base, left = -p.window_left - base;
        CUTE_UNROLL
        for (int i = 0; i < size(acc_s); i += 2) {  // elements i, i + 1: one key, queries q and q + 1
          const int q = q0 + (get<1>(cS(i)) - q0);
          const float2 lse2 = stat_pair(lse, q), dsum2 = stat_pair(dsum, q);
          CUTE_UNROLL
          for (int j = 0; j < 2; ++j) {
            const int dk = get<0>(cS(i + j)) - key0, off = dk - (q + j - q0);
            const float t = T::kSoftcap ? fast_tanh(acc_s(i + j) * p.score_scale) : acc_s(i + j);
            float s = t;
            if constexpr (T::kAlibi) s -= slope * float(abs(base + off));  // -slope * |i + diag - j|
            float pt = fast_exp2(s * p.scale_log2 - (j ? lse2.y : lse2.x));
            if constexpr (decltype(masked)::value) {
              bool visible = dk < key_end;
              if constexpr (MaskBounds<T::kMask>::kRight) visible &= off <= right;
              if constexpr (MaskBounds<T::kMask>::kLeft) visible &= off >= left;
              pt = visible ? pt : 0.f;
            }
            acc_s(i + j) = pt;
            if constexpr (decltype(with_dp)::value) {
              ds_element(acc_s, acc_dp, i + j, j ? dsum2.y : dsum2.x);
              if constexpr (T::kSoftcap) acc_dp(i + j) *= 1.f - t * t;
            } else if constexpr (T::kSplitHeadDim && T::kSoftcap) {  // warpgroup 1's factor of dS^T
              acc_dp(i + j) = pt * (1.f - t * t);
            }
          }
        }
      };
      // Whether every (query, key) pair of the step is visible (keys inside seqlen_k and inside the mask's
      // bounds), as the forward decides per tile. Uniform over the CTA.
      const bool interior =
          !tile_is_cut<T::kMask>(row0, kBlockM, col0, kBlockN, seqlen_k, diag, p.window_left, p.window_right);
      auto softmax_grad_step = [&](auto& acc_s, auto& acc_dp, auto with_dp) {
        if (interior) {
          softmax_grad(acc_s, acc_dp, with_dp, cute::false_type{});
        } else {
          softmax_grad(acc_s, acc_dp, with_dp, cute::true_type{});
        }
      };
      // dS^T in place of dP^T, P^T already in acc_s (0 where hidden).
      auto ds_from_p = [&](auto& acc_s, auto& acc_dp) {
        const int q0 = get<1>(cS(0));
        CUTE_UNROLL
        for (int i = 0; i < size(acc_dp); i += 2) {
          const float2 dsum2 = stat_pair(dsum, q0 + (get<1>(cS(i)) - q0));
          ds_element(acc_s, acc_dp, i, dsum2.x);
          ds_element(acc_s, acc_dp, i + 1, dsum2.y);
        }
      };
      // Unsplit: P^T and dS^T in bf16 registers, the A operands of dV and dK, live until those wgmmas are waited for.
      Tensor pt_frag = make_tensor<Element>(partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{}).layout());
      Tensor dst_frag = make_tensor<Element>(pt_frag.layout());
      Tensor tdVrPt = make_tensor(pt_frag.data(), gmma_acc_as_a(pt_frag.layout()));
      Tensor tdKrdSt = make_tensor(dst_frag.data(), gmma_acc_as_a(dst_frag.layout()));
      auto finish_late_dk = [&] {
        if constexpr (kLateDk) {
          warpgroup_wait<0>();
          warpgroup_fence_operand(tdKrdSt);
          warpgroup_fence_operand(acc_dk);
        }
      };
      if constexpr (T::kSplitHeadDim) {
        Tensor sPt = make_tensor(make_smem_ptr(smem_pt), typename T::SmemLayoutPt{});
        // What warpgroup 1 forms dS^T from: P^T, or in the second buffer P^T times 1 - tanh^2 (softcap) with the
        // dropped scores negated (dropout; sPt holds them as 0).
        Tensor sPs = make_tensor(make_smem_ptr(smem_pt + (T::kSecondPt ? kBlockN * kBlockM : 0)),
                                 typename T::SmemLayoutPt{});
        Tensor sdSt = make_tensor(make_smem_ptr(smem_ds), typename T::SmemLayoutPt{});
        // The inverse of ds_store, P^T from shared memory into the S^T accumulators' positions.
        auto pt_load = make_tiled_copy_C(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, mma_sdp);
        auto thr_pt_load = pt_load.get_thread_slice(tidx % 128);
        Tensor acc = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
        // sPs's source: P^T itself, or under softcap P^T (1 - t^2) in acc_g
        Tensor acc_g = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
        auto& acc_ps = [&]() -> auto& { if constexpr (T::kSoftcap) return acc_g; else return acc; }();
        if (wg == 0) {
          wgmma_issue<true>(mma_sdp, tSrK, tSrQ, acc);
        } else {
          wgmma_issue<true>(mma_sdp, tSrV, tSrdO, acc);
        }
        under_first_gemms();
        if (wg == 0) draw_keep();
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc);
        Tensor frag = make_tensor<Element>(acc.layout());
        if (wg == 0) {
          softmax_grad_step(acc, acc_ps, cute::false_type{});
        } else if constexpr (!T::kDropout) {  // dP^T - rowsum(dO * O) while warpgroup 0 forms P^T
          const int q0 = get<1>(cS(0));
          CUTE_UNROLL
          for (int i = 0; i < size(acc); i += 2) {
            const float2 dsum2 = stat_pair(dsum, q0 + (get<1>(cS(i)) - q0));
            acc(i) -= dsum2.x;
            acc(i + 1) -= dsum2.y;
          }
        }
        if (wg == 0) {  // P^T, the operand of dV (and, without a second buffer, of warpgroup 1's dS^T)
          if constexpr (T::kSecondPt) {  // warpgroup 1's copy (signed under dropout), then dV's kept and scaled P^T
            if constexpr (T::kDropout) {
              CUTE_UNROLL
              for (int i = 0; i < size(acc); ++i) acc_ps(i) = kept_bit(keep, i) ? acc_ps(i) : -acc_ps(i);
            }
            convert_pairs(acc_ps, frag);
            copy(ds_store, thr_ds_store.retile_S(frag), thr_ds_store.partition_D(sPs));
            if constexpr (T::kDropout) {
              CUTE_UNROLL
              for (int i = 0; i < size(acc); ++i) acc(i) = kept_bit(keep, i) ? acc(i) * p.dropout_scale : 0.f;
            }
          }
          convert_pairs(acc, frag);
          copy(ds_store, thr_ds_store.retile_S(frag), thr_ds_store.partition_D(sPt));
          fence_smem_for_async_proxy();
        }
        if constexpr (T::kDqBulk) {
          if (tidx % 128 == 0) bulk_wait_read();  // the last step's dQ halves, from the Q and dO buffers
        }
        __syncthreads();  // P^T complete (and, bulk dQ, the buffers the next tile's load refills free)
        if constexpr (kLateLoad) load_next();
        // Warpgroup 0's dV half runs on the tensor cores while warpgroup 1 forms dS^T, which would otherwise idle.
        Tensor tdVrPt_s = desc_dkv.partition_fragment_A(sPt);
        if (wg == 0) {
          wgmma_issue<false>(mma_dkv, tdVrPt_s, tdVrdOt, acc_dv);
        } else {  // dS^T = P^T (dP^T - rowsum(dO * O)), P^T read back by ldmatrix into warpgroup 0's positions
          copy(pt_load, thr_pt_load.partition_S(sPs), thr_pt_load.retile_D(frag));
          if constexpr (T::kDropout) {  // dS^T = |P^T| (Z dP^T / (1 - p) - rowsum(dO * O)), Z from P^T's sign
            // (softcap: |P^T (1 - t^2)|)
            const int q0 = get<1>(cS(0));
            CUTE_UNROLL
            for (int i = 0; i < size(acc); i += 2) {
              const float2 dsum2 = stat_pair(dsum, q0 + (get<1>(cS(i)) - q0));
              CUTE_UNROLL
              for (int j = 0; j < 2; ++j) {
                const float pt = float(frag(i + j));
                const float dp = pt >= 0.f ? acc(i + j) * p.dropout_scale : 0.f;
                acc(i + j) = fabsf(pt) * (dp - (j ? dsum2.y : dsum2.x));
              }
            }
          } else {
            CUTE_UNROLL
            for (int i = 0; i < size(acc); ++i) acc(i) *= float(frag(i));
          }
          convert_pairs(acc, frag);
          copy(ds_store, thr_ds_store.retile_S(frag), thr_ds_store.partition_D(sdSt));
          fence_smem_for_async_proxy();
        }
        __syncthreads();  // dS^T complete
        if (wg == 1) wgmma_issue<false>(mma_dkv, tdVrPt_s, tdVrdOt, acc_dv);
        wgmma_issue<false>(mma_dkv, desc_dkv.partition_fragment_A(sdSt), tdKrQt, acc_dk);
      } else {
        Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
        Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
        // Late dK: warpgroup 1 issues its S^T and dP^T once warpgroup 0 has issued its own (a wgmma's issue returns
        // about when the tensor cores take it), so the tensor cores run the two warpgroups' GEMMs one after the
        // other rather than interleaved: warpgroup 0's softmax then runs under warpgroup 1's GEMMs, and its dV under
        // warpgroup 1's softmax, instead of both softmaxes at once with the tensor cores idle. (fwd+bwd +2-4% at head
        // dim 128; in the dK/dV overlap tilings -1..-2%, not yet understood: H200, 2026-12-04,
        // docs/hopper_backward.md.) Warpgroup 0 syncs rather than arrives (warpgroup 1 is waiting already): with an
        // arrive, racecheck reported hazards across the epilogue's block barrier.
        if (kLateDk && wg == 1) named_barrier_sync(kSdpIssued, 256);
        wgmma_issue<true>(mma_sdp, tSrK, tSrQ, acc_s);
        wgmma_issue<true>(mma_sdp, tSrV, tSrdO, acc_dp);
        if (kLateDk && wg == 0) named_barrier_sync(kSdpIssued, 256);
        under_first_gemms();
        draw_keep();
        if constexpr (T::kExpUnderDp) {
          warpgroup_wait<1>();
          warpgroup_fence_operand(acc_s);
          softmax_grad_step(acc_s, acc_dp, cute::false_type{});
          warpgroup_wait<0>();
          warpgroup_fence_operand(acc_dp);
          ds_from_p(acc_s, acc_dp);
        } else {
          warpgroup_wait<0>();
          warpgroup_fence_operand(acc_s);
          warpgroup_fence_operand(acc_dp);
          softmax_grad_step(acc_s, acc_dp, cute::true_type{});
        }
        convert_pairs(acc_s, pt_frag);
        if constexpr (kLateDk) {  // dV first, under dS^T's conversion and store
          warpgroup_fence_operand(tdVrPt);
          wgmma_issue<false>(mma_dkv, tdVrPt, tdVrdOt, acc_dv);
        }
        convert_pairs(acc_dp, dst_frag);
        copy(ds_store, thr_ds_store.retile_S(dst_frag), tdSsdSt);
        fence_smem_for_async_proxy();  // the generic-proxy dS stores, before wgmma reads them
        if (kEarlyDk0 && wg == 0) {
          warpgroup_fence_operand(tdKrdSt);
          wgmma_issue<false>(mma_dkv, tdKrdSt, tdKrQt, acc_dk);
        }
        if constexpr (!kLateDk) {
          warpgroup_fence_operand(tdVrPt);
          wgmma_issue<false>(mma_dkv, tdVrPt, tdVrdOt, acc_dv);
          warpgroup_fence_operand(tdKrdSt);
          wgmma_issue<false>(mma_dkv, tdKrdSt, tdKrQt, acc_dk);
        }
      }
      if constexpr (!T::kOverlapDkvDq && T::kSplitHeadDim) warpgroup_wait<0>();
      // The last step's dQ reductions have read their buffer before anyone rewrites it (below, after this barrier).
      if constexpr (T::kDqBulk && !T::kSplitHeadDim) {
        if (tidx % 128 == 0 && (T::kDecoupled || tidx == 0)) bulk_wait_read();
      }
      if constexpr (!T::kSplitHeadDim) __syncthreads();  // dS complete (split: since the barrier above)

      Tensor acc_dq = partition_fragment_C(mma_dq, typename T::DqTile{});
      if constexpr (T::kDqTransposed) {
        wgmma_issue<true>(mma_dq, tdQrKt, desc_dq.partition_fragment_B(sdS), acc_dq);
      } else {
        wgmma_issue<true>(mma_dq, desc_dq.partition_fragment_A(sdS), tdQrKt, acc_dq);
      }
      const bool dk_after_dq = kLateDk && !(kEarlyDk0 && wg == 0);
      if constexpr (kLateDk) {
        if (dk_after_dq) {  // dV done (dQ may still run), then dK, which runs on under dQ's store
          warpgroup_wait<1>();
          warpgroup_fence_operand(tdVrPt);
          warpgroup_fence_operand(tdKrdSt);
          wgmma_issue<false>(mma_dkv, tdKrdSt, tdKrQt, acc_dk);
        }
      }
      if constexpr (T::kDecoupled) load_next();  // the buffer's last readers, the step before's GEMMs, are done
      // With the overlap, the dK/dV wgmmas too: they have read their registers and Q/dO. Late dK: dQ only.
      if (dk_after_dq) warpgroup_wait<1>();
      else warpgroup_wait<0>();
      if constexpr (!T::kSplitHeadDim) {  // (early dK: warpgroup 0's dV and dK are done too)
        warpgroup_fence_operand(tdVrPt);
        warpgroup_fence_operand(tdKrdSt);
      }
      warpgroup_fence_operand(acc_dv);
      if constexpr (!kLateDk) warpgroup_fence_operand(acc_dk);  // late: once its wgmma is waited for
      warpgroup_fence_operand(acc_dq);
      // dQ into the staging buffer (the generic-proxy stores fenced before the TMA reductions read them).
      auto stage_dq = [&](float* buf) {
        Tensor tdQsdQ = thr_dq.partition_C(make_tensor(make_smem_ptr(buf), typename T::SmemLayoutdQAcc{}));
        if constexpr (T::kDqTransposed) {  // an accumulator's adjacent columns are adjacent rows of the tile
          copy(acc_dq, tdQsdQ);
        } else if constexpr (decltype(size<0, 2>(acc_dq))::value % 4 != 0) {
          // Head dim 96: a warpgroup's 48 columns are six 8-column chunks, so chunks 4 and 5 have no partner k ^ 2
          // for the crossed order below (which also assumes 128-byte rows); element pairs go straight, at up to 4
          // wavefronts a store.
          CUTE_UNROLL
          for (int i = 0; i < size(acc_dq); i += 2) {
            st_shared_f32x2(smem_u32(&tdQsdQ(i)), make_float2(acc_dq(i), acc_dq(i + 1)));
          }
        } else {
          // 8-byte stores, each element pair i, i + 1 two adjacent columns of one row. Shared memory serves them by
          // half-warps (rows 4h..4h+3 of a warp's eight), and the 128-byte swizzle puts rows 2s and 2s + 1 of one
          // store on the same 8 banks (ncu, 2026-12-04: 4 wavefronts per store, not 2). So odd rows store in a crossed
          // order, each instruction writing the chunk 16 columns over: fragment element i ^ 8 (8-column chunk k ^ 2,
          // the same 32-column box), whose address is element i's XOR 64 bytes whatever the row's swizzle (it permutes
          // 16-byte units within the row; the buffers are 1024-byte aligned). Shared-space stores: a select between
          // two pointers made them generic, and two addresses per pair cost registers (spills under ALiBi).
          static_assert(decltype(size<0, 0>(acc_dq))::value == 2 && decltype(size<0, 1>(acc_dq))::value == 2);
          const bool odd_row = (tidx >> 2) & 1;
          const uint32_t flip = odd_row ? 64 : 0;
          CUTE_UNROLL
          for (int i = 0; i < size(acc_dq); i += 2) {
            if (i & 8) continue;
            const float2 a = make_float2(acc_dq(i), acc_dq(i + 1)), b = make_float2(acc_dq(i ^ 8), acc_dq((i ^ 8) + 1));
            const uint32_t addr = smem_u32(&tdQsdQ(i)) ^ flip;  // odd rows: element i ^ 8's
            st_shared_f32x2(addr, odd_row ? b : a);
            st_shared_f32x2(addr ^ 64, odd_row ? a : b);
          }
        }
        fence_smem_for_async_proxy();
      };
      if constexpr (T::kDqBulk && T::kSplitHeadDim) {
        // Both warpgroups stage their halves at once, warpgroup 0's in this step's dO buffer and warpgroup 1's in its
        // Q buffer; each warpgroup's first thread sends its half. The barrier also ends the step (both warpgroups'
        // GEMMs are done with Q, dO and dS); the halves are waited for after the next step's softmax.
        __syncthreads();  // every GEMM has read Q and dO
        float* buf = reinterpret_cast<float*>((wg == 0 ? smem_do : smem_q) + stage * kBlockM * kD);
        stage_dq(buf);
        named_barrier_sync(kDqHalfStaged + wg, 128);
        if (tidx % 128 == 0) send_dq(buf, wg * T::kDqStageCols, 0, int(acc0 + row0));
        continue;
      } else if constexpr (T::kDecoupled) {  // each warpgroup's half, sent under its next step's first GEMMs
        stage_dq(smem_dq);
        finish_late_dk();
        named_barrier_sync(kDqHalfStaged + wg, 128);
        dq_pending = int(acc0 + row0);
        continue;
      } else if constexpr (T::kDqBulk) {
        stage_dq(smem_dq);
      } else {
        float* dq_rows = p.dq_accum + (acc0 + row0) * kD;  // the tile's rows, contiguous
        Tensor gdQ = make_tensor(make_gmem_ptr(dq_rows), Shape<Int<kBlockM>, Int<kD>>{}, Stride<Int<kD>, _1>{});
        add_dq<T::kDeterministic, MaskBounds<T::kMask>::kLeft, kBlockN>(p, thr_dq.partition_C(gdQ), acc_dq,
                                                                        acc0 + row0, n_block, row0 + diag);
      }
      finish_late_dk();
      __syncthreads();  // every warpgroup is done with Q, dO and dS before the next tile overwrites them
      if constexpr (T::kDqBulk) dq_pending = int(acc0 + row0);
    }
  }
  reduce_pending_dq();

  // Epilogue: dK scaled, dK and dV staged through the K/V buffers and stored with 16-byte vectors.
  if constexpr (T::kDqBulk) {  // the dQ buffer stays allocated, and dq_accum complete, until the reductions are done
    if (tidx == 0 || (kDqHalves && tidx == 128)) bulk_wait_done();
  }
  __syncthreads();
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.softmax_scale;
  Tensor dk_out = make_tensor<Element>(acc_dk.layout());
  Tensor dv_out = make_tensor<Element>(acc_dv.layout());
  convert_pairs(acc_dk, dk_out);
  convert_pairs(acc_dv, dv_out);
  const int tidx_epi = opaque_thread_idx();
  // The K/V buffers through a second name for the dynamic shared memory, for the same reason: the prologue's 64-bit
  // generic base would otherwise stay live across the main loop (spilled where registers are tight).
  extern __shared__ __align__(1024) char smem_epi[];
  Element* epi_k = reinterpret_cast<Element*>(smem_epi) + (smem_k - smem_q);  // a constant offset
  Tensor sK_epi = make_tensor(make_smem_ptr(epi_k), typename T::SmemLayoutK{});
  Tensor sV_epi = make_tensor(make_smem_ptr(epi_k + kBlockN * kD), typename T::SmemLayoutK{});
  auto thr_dkv_epi = mma_dkv.get_thread_slice(tidx_epi);
  copy(dk_out, thr_dkv_epi.partition_C(sK_epi));
  copy(dv_out, thr_dkv_epi.partition_C(sV_epi));
  __syncthreads();
  typename T::GmemStore store;
  auto store_thr = store.get_thread_slice(tidx_epi);
  Tensor tKVcKV_st = store_thr.partition_D(cKV);
  copy_predicated(store, store_thr.partition_S(sK_epi),
                  store_thr.partition_D(kv_tile(static_cast<Element*>(p.dk), p.dk_batch_stride, p.dk_row_stride,
                                                p.dk_head_stride)),
                  tKVcKV_st, seqlen_k - col0, p.head_dim);
  copy_predicated(store, store_thr.partition_S(sV_epi),
                  store_thr.partition_D(kv_tile(static_cast<Element*>(p.dv), p.dv_batch_stride, p.dv_row_stride,
                                                p.dv_head_stride)),
                  tKVcKV_st, seqlen_k - col0, p.head_dim);
}

}  // namespace flash_gen
