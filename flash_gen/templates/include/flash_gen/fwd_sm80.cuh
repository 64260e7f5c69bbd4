// The portable forward kernel: FlashAttention-2's algorithm on mma.sync, ldmatrix and cp.async (Sm80 and
// newer). One CTA owns a block_m-row tile of Q for one (batch, head), keeps it in smem (or registers), and
// streams K/V tiles from the last visible one down to the first; scores go through an online base-2
// softmax with the scale folded into one FMA; masking costs only the tiles that a mask or a sequence end cuts.
#pragma once
#include "flash_gen/attn_mask.cuh"
#include "flash_gen/dropout.cuh"
#include "flash_gen/fwd_params.cuh"
#include "flash_gen/kv_cache.cuh"
#include "flash_gen/score_mods.cuh"
#include "flash_gen/seq_info.cuh"
#include "flash_gen/sm80_ldsm.cuh"
#include "flash_gen/sm80_utils.cuh"
#include "flash_gen/visible_keys.cuh"

namespace flash_gen {

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kStages_, bool kQInRegs_,
          bool kLateVWait_, Mask kMask_, bool kSoftcap_, bool kAlibi_, bool kVarlen_, KvLayout kKv_, bool kSplit_,
          bool kPackGqa_, bool kDropout_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;                 // what loads and stores touch
  static constexpr int kHeadDimMma = (kHeadDim + 15) / 16 * 16;  // what the MMAs compute (zero-padded)
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kStages = kStages_;
  static constexpr bool kQInRegs = kQInRegs_;
  static constexpr bool kLateVWait = kLateVWait_;  // kStages == 1: wait for V after the softmax (FwdConfig.late_v_wait)
  static constexpr Mask kMask = kMask_;
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr bool kAlibi = kAlibi_;
  static constexpr bool kVarlen = kVarlen_;
  static constexpr KvLayout kKv = kKv_;
  static constexpr bool kSplit = kSplit_;  // split-KV: grid.z is batch x num_splits; fp32 partials out
  // grid.y is the KV head; tile row R is query position R / group of query head head_k * group + R % group
  static constexpr bool kPackGqa = kPackGqa_;
  static constexpr bool kDropout = kDropout_;  // P V takes the kept probabilities; row sums and lse all of them
  static constexpr bool kHasRightBound = MaskBounds<kMask>::kRight;
  static constexpr bool kHasLeftBound = MaskBounds<kMask>::kLeft;
  static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns whole 16-row MMA tiles");
  static_assert(kBlockN % 16 == 0, "block_n is the k-extent of P@V");

  // Warps tile M; N=16 per step so ldmatrix.x4 feeds two n8 MMAs of B at once.
  using TiledMma = TiledMMA<Sm80MmaAtom<Element>, Layout<Shape<Int<kNWarps>, _1, _1>>,
                            Tile<Int<16 * kNWarps>, _16, _16>>;

  using Smem = SmemTile<kHeadDimMma>;
  using SmemLayoutQ = decltype(tile_to_shape(typename Smem::Atom{}, Shape<Int<kBlockM>, Int<kHeadDimMma>>{}));
  using SmemLayoutKV =
      decltype(tile_to_shape(typename Smem::Atom{}, Shape<Int<kBlockN>, Int<kHeadDimMma>, Int<kStages>>{}));
  // V read transposed (head dim x keys) as the B operand of P@V: same bytes, permuted coordinates.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDimMma>, Int<kBlockN>, Int<kStages>>{},
                                  Stride<Int<kBlockN>, _1, Int<kBlockN * kHeadDimMma>>{})));
  static constexpr int kSmemElems = kBlockM * kHeadDimMma + 2 * kStages * kBlockN * kHeadDimMma;
  static constexpr int kSmemBytes = kSmemElems * int(sizeof(Element));

  using GmemLoad = typename GmemCopy<Element, kNThreads, kHeadDimMma>::Load;
  using GmemStore = typename GmemCopy<Element, kNThreads, kHeadDimMma>::Store;
};

template <class T>
__device__ __forceinline__ void fwd_kernel(FwdParams const& p) {
  using Element = typename T::Element;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kD = T::kHeadDimMma;
  extern __shared__ __align__(128) char smem_buf[];

  const int tidx = threadIdx.x;
  const int group = p.nheads / p.nheads_k;
  const int head = T::kPackGqa ? blockIdx.y * group : blockIdx.y;  // packed: the group's first query head
  // Within a head, the last query tiles see the most keys under a causal mask: start them first.
  int m_block = gridDim.x - 1 - blockIdx.x, batch = blockIdx.z, split = 0;
  if constexpr (T::kSplit) {
    split = batch % p.num_splits;
    batch /= p.num_splits;
  }
  if constexpr (T::kVarlen) {  // the grid's x runs over every entry's query tiles
    const int2 tile = varlen_tile(p.cu_seqlens_q, p.batch, p.seqlen_q, m_block,
                                  [](int len) { return (len + kBlockM - 1) / kBlockM; });
    if (tile.x < 0) return;
    batch = tile.x;
    m_block = tile.y;
  }
  SeqInfo seq = seq_info<T::kVarlen>(p, batch);
  int kv_batch = batch;
  if constexpr (T::kKv != KvLayout::kDense) kv_batch = kv_cache_rows<T::kVarlen>(p, batch, seq);
  const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
  const int head_k = head / group;
  const int rows_q = T::kPackGqa ? seqlen_q * group : seqlen_q;  // tile rows of this (entry, head or group)
  const int row0 = m_block * kBlockM;
  const int diag = seqlen_k - seqlen_q;  // bottom-right alignment of causal/local masks
  // Query positions of the tile's first and last row (rows are positions unless packed).
  const int pos0 = T::kPackGqa ? row0 / group : row0;
  const int pos_last = (min(row0 + kBlockM, rows_q) - 1) / (T::kPackGqa ? group : 1);

  // Key tiles [n_min, n_max) that any row of this query tile can see.
  int n_min, n_max;
  visible_key_tiles<T::kMask, kBlockN>(pos0, pos_last, seqlen_k, diag, p.window_left, p.window_right, n_min, n_max);
  if constexpr (T::kSplit) {  // this CTA's share of the visible key tiles
    const int per_split = (n_max - n_min + p.num_splits - 1) / p.num_splits;
    n_min += split * per_split;
    n_max = min(n_max, n_min + per_split);
  }

  auto* q_ptr = static_cast<const Element*>(p.q) + batch * p.q_batch_stride + seq.q_start * p.q_row_stride +
               head * p.q_head_stride;
  auto* k_ptr = static_cast<const Element*>(p.k) + kv_batch * p.k_batch_stride + seq.k_start * p.k_row_stride +
               head_k * p.k_head_stride;
  auto* v_ptr = static_cast<const Element*>(p.v) + kv_batch * p.v_batch_stride + seq.k_start * p.v_row_stride +
               head_k * p.v_head_stride;
  auto* o_ptr = static_cast<Element*>(p.o) + batch * p.o_batch_stride + seq.q_start * p.o_row_stride +
               head * p.o_head_stride;
  float* lse_ptr = p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride + seq.q_start;
  float empty_lse = inf();  // rows that see no key: +inf, or -inf in a split's partial (weight 0 in the combine)
  if constexpr (T::kSplit) {
    lse_ptr = p.lse_partial + ((int64_t(split) * p.batch + batch) * p.nheads + head) * p.seqlen_q;
    empty_lse = -inf();
  }
  // Where tile row R's lse, fp32 partial O and output go. Unpacked rows are positions of one head; packed rows
  // interleave the group's heads (pos = R / group, head + R % group).
  auto lse_at = [&](int R) -> float* {
    if constexpr (T::kPackGqa) {
      const int pos = R / group, h = head + R % group;
      return T::kSplit ? p.lse_partial + ((int64_t(split) * p.batch + batch) * p.nheads + h) * p.seqlen_q + pos
                       : p.lse + batch * p.lse_batch_stride + h * p.lse_head_stride + pos;
    } else {
      return lse_ptr + R;
    }
  };
  auto o_partial_at = [&](int R) -> float* {
    const int pos = T::kPackGqa ? R / group : R, h = T::kPackGqa ? head + R % group : head;
    return p.o_partial + (((int64_t(split) * p.batch + batch) * p.nheads + h) * p.seqlen_q + pos) * T::kHeadDim;
  };
  auto o_row = [&](int r) {  // packed only: tile row r of O
    const int R = row0 + r;
    return o_ptr + (R / group) * p.o_row_stride + (R % group) * p.o_head_stride;
  };

  Tensor gQ = local_tile(make_tensor(make_gmem_ptr(q_ptr), make_shape(seqlen_q, Int<kD>{}),
                                     make_stride(p.q_row_stride, _1{})),
                         Shape<Int<kBlockM>, Int<kD>>{}, make_coord(m_block, 0));
  Tensor gO = local_tile(make_tensor(make_gmem_ptr(o_ptr), make_shape(seqlen_q, Int<kD>{}),
                                     make_stride(p.o_row_stride, _1{})),
                         Shape<Int<kBlockM>, Int<kD>>{}, make_coord(m_block, 0));
  Tensor gK = local_tile(make_tensor(make_gmem_ptr(k_ptr), make_shape(seqlen_k, Int<kD>{}),
                                     make_stride(p.k_row_stride, _1{})),
                         Shape<Int<kBlockN>, Int<kD>>{}, make_coord(_, 0));  // (BN, D, n)
  Tensor gV = local_tile(make_tensor(make_gmem_ptr(v_ptr), make_shape(seqlen_k, Int<kD>{}),
                                     make_stride(p.v_row_stride, _1{})),
                         Shape<Int<kBlockN>, Int<kD>>{}, make_coord(_, 0));

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem_buf)), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename T::SmemLayoutKV{});  // (BN, D, stage)
  Tensor sV = make_tensor(sK.data() + size(sK), typename T::SmemLayoutKV{});
  Tensor sVt = make_tensor(sV.data(), typename T::SmemLayoutVt{});  // (D, BN, stage)

  // Identity tensors give each thread the (row, col) of every element it holds.
  Tensor cQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kD>>{});
  Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kD>>{});

  if (n_max <= n_min) {
    // No visible key for any row (e.g. causal with seqlen_q > seqlen_k): output 0, lse = +inf. A split that
    // got no key tile writes lse = -inf only: the combine skips it.
    if constexpr (T::kSplit || T::kPackGqa) {
      if constexpr (!T::kSplit) {
        constexpr int kVecs = T::kHeadDim / 8;  // 16-byte vectors of +0.0 per row
        for (int i = tidx; i < kBlockM * kVecs; i += T::kNThreads) {
          if (row0 + i / kVecs < rows_q) *reinterpret_cast<uint4*>(o_row(i / kVecs) + 8 * (i % kVecs)) = uint4{};
        }
      }
      for (int r = tidx; r < kBlockM; r += T::kNThreads) {
        if (row0 + r < rows_q) *lse_at(row0 + r) = empty_lse;
      }
      return;
    }
    auto thr = typename T::GmemStore{}.get_thread_slice(tidx);
    Tensor tOgO = thr.partition_D(gO);
    Tensor tOcO = thr.partition_D(cQ);
    CUTE_UNROLL
    for (int m = 0; m < size<1>(tOgO); ++m) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tOgO); ++k) {
        if (row0 + get<0>(tOcO(0, m, k)) < seqlen_q && get<1>(tOcO(0, m, k)) < T::kHeadDim) {
          *reinterpret_cast<uint4*>(&tOgO(0, m, k)) = make_uint4(0, 0, 0, 0);  // 8 elements of +0.0
        }
      }
    }
    for (int r = tidx; r < kBlockM; r += T::kNThreads) {
      if (row0 + r < seqlen_q) lse_ptr[row0 + r] = inf();
    }
    return;
  }

  typename T::GmemLoad load;
  auto load_thr = load.get_thread_slice(tidx);
  Tensor tQgQ = load_thr.partition_S(gQ);
  Tensor tQsQ = load_thr.partition_D(sQ);
  Tensor tQcQ = load_thr.partition_D(cQ);
  Tensor tKgK = load_thr.partition_S(gK);  // (CPY, CPY_N, CPY_K, n)
  Tensor tKsK = load_thr.partition_D(sK);  // (CPY, CPY_N, CPY_K, stage)
  Tensor tVgV = load_thr.partition_S(gV);
  Tensor tVsV = load_thr.partition_D(sV);
  Tensor tKVcKV = load_thr.partition_D(cKV);

  const int q_rows = rows_q - row0;
  // Pages of the next key tile to load (a paged cache): a page per copied row, or one per tile when pages hold
  // whole tiles. Fetched when a tile's V is issued, for the tile after it (tiles load in decreasing order).
  PageLookahead<T::kKv == KvLayout::kPaged ? decltype(size<1>(tKsK))::value : 1> pages(p, batch);
  auto fetch_pages = [&](int n) {
    const int first = seq.k_start + n * kBlockN;  // the tile's first row in the entry's cache rows
    pages.fetch(n, seq.k_start + seqlen_k - 1, [&](int i) {
      if constexpr (T::kKv == KvLayout::kPaged) {
        return first + get<0>(tKVcKV(0, i, 0));
      } else {
        return first;
      }
    });
  };
  // Key tile n of K or V: `origin` is the entry's first row (dense and contiguous caches), `cache` the head's
  // element 0 of a paged tensor (whose page stride validate.py keeps below 2^32).
  auto load_cache_tile = [&](const Element* origin, const Element* cache, int64_t page_stride, int64_t row_stride,
                             auto&& dst, int n) {
    const uint32_t page_stride32 = uint32_t(page_stride), row_stride32 = uint32_t(row_stride);
    if (p.block_table != nullptr && pages.tile != n) fetch_pages(n);
    if constexpr (T::kKv == KvLayout::kPaged) {
      auto row_ptr = [&](int m, int) { return cache + pages.offset(p, m, page_stride32, row_stride32); };
      copy_rows_zfill(load, row_ptr, dst, tKVcKV, seqlen_k - n * kBlockN, T::kHeadDim);
    } else {
      const Element* tile = p.block_table != nullptr ? cache + pages.offset(p, 0, page_stride32, row_stride32)
                                                     : origin + int64_t(n) * kBlockN * row_stride;
      Tensor g = make_tensor(make_gmem_ptr(tile), Shape<Int<kBlockN>, Int<kD>>{}, make_stride(row_stride, _1{}));
      copy_zfill(load, load_thr.partition_S(g), dst, tKVcKV, seqlen_k - n * kBlockN, T::kHeadDim);
    }
  };
  auto load_k = [&](int n, int stage) {
    if constexpr (T::kKv == KvLayout::kDense) {
      copy_zfill(load, tKgK(_, _, _, n), tKsK(_, _, _, stage), tKVcKV, seqlen_k - n * kBlockN, T::kHeadDim);
    } else {
      load_cache_tile(k_ptr, static_cast<const Element*>(p.k) + head_k * p.k_head_stride, p.k_batch_stride,
                      p.k_row_stride, tKsK(_, _, _, stage), n);
    }
  };
  auto load_v = [&](int n, int stage) {
    if constexpr (T::kKv == KvLayout::kDense) {
      copy_zfill(load, tVgV(_, _, _, n), tVsV(_, _, _, stage), tKVcKV, seqlen_k - n * kBlockN, T::kHeadDim);
    } else {
      load_cache_tile(v_ptr, static_cast<const Element*>(p.v) + head_k * p.v_head_stride, p.v_batch_stride,
                      p.v_row_stride, tVsV(_, _, _, stage), n);
      if (p.block_table != nullptr && n > n_min) fetch_pages(n - 1);  // K and V of tile n are issued
    }
  };

  typename T::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);                 // (MMA, MMA_M, MMA_K)
  Tensor tSrK = thr_mma.partition_fragment_B(sK(_, _, 0));        // (MMA, MMA_N, MMA_K)
  Tensor tOrVt = thr_mma.partition_fragment_B(sVt(_, _, 0));      // (MMA, MMA_D, MMA_K)
  Tensor acc_o = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kD>>{});

  // ldmatrix addresses (sm80_ldsm.cuh): one per-lane offset shared by Q, K and V plus warp-uniform tile bases
  // (the shuffle makes the warp index visibly uniform, so ptxas can keep those in uniform registers).
  using LdsmQ = LdsmTile<kD, kBlockM>;
  using LdsmKV = LdsmTile<kD, kBlockN>;
  static_assert(LdsmQ::kRowBytes == LdsmKV::kRowBytes);
  constexpr int kStageBytes = kBlockN * kD * int(sizeof(Element));
  const uint32_t lane_off = LdsmKV::lane_offset(tidx);
  // K's ldmatrix swaps matrices 1 and 2 so the registers of its two n8 tiles land in fragment order (no moves).
  const uint32_t k_lane_off = LdsmKV::template thread_offset<8, 8, true>(tidx);
  const int warp = __shfl_sync(0xffffffff, tidx / 32, 0);
  const uint32_t q_base = cast_smem_ptr_to_uint(raw_pointer_cast(sQ.data())) + warp * 16 * LdsmQ::kRowBytes;
  const uint32_t k_base0 = cast_smem_ptr_to_uint(raw_pointer_cast(sK.data()));
  const uint32_t v_base0 = cast_smem_ptr_to_uint(raw_pointer_cast(sV.data()));
  auto load_q = [&](int i) { LdsmQ::template load_a<16 * T::kNWarps>(tSrQ, q_base, lane_off, i); };

  // (row, col) of each accumulator element, as (rows, cols) views matching acc_rowcol.
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;  // accumulator rows this thread holds

  // Prologue: Q and the first K (and, with a multi-stage ring, the first kStages-1 K/V tiles).
  if constexpr (T::kPackGqa) {
    auto q_row = [&](int, int r) {
      const int R = row0 + r;
      return q_ptr + (R / group) * p.q_row_stride + (R % group) * p.q_head_stride;
    };
    copy_rows_zfill(load, q_row, tQsQ, tQcQ, q_rows, T::kHeadDim);
  } else {
    copy_zfill(load, tQgQ, tQsQ, tQcQ, q_rows, T::kHeadDim);
  }
  if constexpr (T::kStages == 1) {
    load_k(n_max - 1, 0);
    cp_async_fence();
  } else {
    CUTE_UNROLL
    for (int s = 0; s < T::kStages - 1; ++s) {
      if (n_max - 1 - s >= n_min) {
        load_k(n_max - 1 - s, s);
        load_v(n_max - 1 - s, s);
      }
      cp_async_fence();  // always commit, so the wait counts below are uniform
    }
  }
  if constexpr (T::kQInRegs) {
    cp_async_wait<0>();
    __syncthreads();
    CUTE_UNROLL
    for (int i = 0; i < size<2>(tSrQ); ++i) load_q(i);
  }

  clear(acc_o);
  float row_max[kRows], row_sum[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    row_max[r] = -inf();
    row_sum[r] = 0.f;
  }

  float slope = 0.f;
  if constexpr (T::kAlibi) slope = p.alibi_slopes[batch * p.alibi_batch_stride + head] * p.alibi_scale;
  const DropoutRng rng = make_dropout_rng<T::kDropout>(p, batch, head);

  // One K/V buffer: V[n] must have landed, and every warp be done reading K[n], before K[n-1] may load. Placed
  // right after QK^T the K load overlaps the softmax; placed after the softmax (kLateVWait) ptxas cannot hoist
  // V's ldmatrix into the softmax, where the fragments would stay live next to the whole score tile.
  auto wait_v_load_next_k = [&](int n) {
    cp_async_wait<0>();
    __syncthreads();
    if (n > n_min) {
      load_k(n - 1, 0);
      cp_async_fence();
    }
  };

  for (int n = n_max - 1, it = 0; n >= n_min; --n, ++it) {
    const int stage = T::kStages == 1 ? 0 : it % T::kStages;
    if constexpr (T::kStages == 1) {
      cp_async_wait<0>();
      __syncthreads();  // K[n] visible to all; every warp is done reading V[n+1]
      load_v(n, 0);
      cp_async_fence();
    } else {
      cp_async_wait<T::kStages - 2>();
      __syncthreads();  // tile n visible to all; every warp is done with the stage refilled below
      const int n_next = n - (T::kStages - 1);
      if (n_next >= n_min) {
        const int s_next = (it + T::kStages - 1) % T::kStages;
        load_k(n_next, s_next);
        load_v(n_next, s_next);
      }
      cp_async_fence();
    }

    Tensor acc_s = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    const uint32_t k_base = k_base0 + stage * kStageBytes;
    gemm_pipelined(
        acc_s, tSrQ, tSrK, mma,
        [&](int i) {
          if constexpr (!T::kQInRegs) load_q(i);
        },
        [&](int i, int n) { LdsmKV::template load_b<8, true>(tSrK, k_base, k_lane_off, i, n); });
    if constexpr (T::kStages == 1 && !T::kLateVWait) wait_v_load_next_k(n);

    Tensor s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
    apply_score_mods<T::kSoftcap, T::kAlibi>(s, tScS_rc, row0, n * kBlockN, diag, p.score_scale, slope);
    // Per-element masking only where this tile crosses the sequence end or a mask boundary.
    if constexpr (T::kPackGqa) {
      if (tile_is_cut<T::kMask>(pos0, pos_last - pos0 + 1, n * kBlockN, kBlockN, seqlen_k, diag, p.window_left,
                                p.window_right)) {
        mask_tile<T::kMask, true>(s, tScS_rc, row0, n * kBlockN, seqlen_k, diag, p.window_left, p.window_right,
                                  group);
      }
    } else if (tile_is_cut<T::kMask>(row0, kBlockM, n * kBlockN, kBlockN, seqlen_k, diag, p.window_left,
                                     p.window_right)) {
      mask_tile<T::kMask>(s, tScS_rc, row0, n * kBlockN, seqlen_k, diag, p.window_left, p.window_right);
    }

    Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
    online_softmax_step(s, o_rc, row_max, row_sum, p.scale_log2);
    if constexpr (T::kDropout) {  // after the row sums, which count every probability; the scale is the epilogue's
      dropout_scores<true>(s, tScS_rc, row0, n * kBlockN, rng, [](float& x, bool kept) { x = kept ? x : 0.f; });
    }

    Tensor p_frag = convert_to<Element>(acc_s);
    Tensor tOrP = make_tensor(p_frag.data(), acc_as_a_operand(p_frag.layout()));
    if constexpr (T::kStages == 1 && T::kLateVWait) wait_v_load_next_k(n);
    const uint32_t v_base = v_base0 + stage * kStageBytes;
    gemm_pipelined(
        acc_o, tOrP, tOrVt, mma, [](int) {}, [&](int i, int n) { LdsmKV::load_bt(tOrVt, v_base, lane_off, i, n); });
  }

  // Epilogue: normalise, write lse, stage O through smem (reusing Q's rows, which only this warp read) and
  // store it with 16-byte vectors.
  Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
  Tensor tOcO_acc = thr_mma.partition_C(cQ);
  Tensor tOcO_rc = make_tensor(tOcO_acc.data(), acc_rowcol(tOcO_acc.layout()));
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const float sum = quad_sum(row_sum[r]);
    const bool empty = sum == 0.f || sum != sum;
    // sum >= 1: MUFU's reciprocal and log2 suffice
    const float inv = empty ? 1.f : __fdividef(T::kDropout ? p.dropout_scale : 1.f, sum);
    CUTE_UNROLL
    for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) *= inv;
    const int row = get<0>(tOcO_rc(r, 0));
    if (get<1>(tOcO_rc(r, 0)) == 0 && row0 + row < rows_q) {
      *lse_at(row0 + row) = empty ? empty_lse : (row_max[r] * p.scale_log2 + __log2f(sum)) * 0.69314718055994531f;
    }
  }
  if constexpr (T::kSplit) {  // fp32 partial O straight from the accumulators, two adjacent columns at a time
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = row0 + get<0>(tOcO_rc(r, 0));
      if (row >= rows_q) continue;
      float* o_part = o_partial_at(row);
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o_rc); c += 2) {
        const int col = get<1>(tOcO_rc(r, c));
        if (col < T::kHeadDim) *reinterpret_cast<float2*>(o_part + col) = make_float2(o_rc(r, c), o_rc(r, c + 1));
      }
    }
    return;
  }

  Tensor o_frag = convert_to<Element>(acc_o);
  Tensor sO = make_tensor(sQ.data(), typename T::SmemLayoutQ{});
  auto copy_o = make_tiled_copy_C(Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>{}, mma);
  auto thr_copy_o = copy_o.get_thread_slice(tidx);
  // A warp reads (ldmatrix) and writes (here) only its own rows of sQ, so a warp barrier suffices.
  __syncwarp();
  copy(copy_o, thr_copy_o.retile_S(o_frag), thr_copy_o.partition_D(sO));
  __syncthreads();

  typename T::GmemStore store;
  auto store_thr = store.get_thread_slice(tidx);
  if constexpr (T::kPackGqa) {
    copy_rows_predicated(store, store_thr.partition_S(sO), o_row, store_thr.partition_D(cQ), q_rows, T::kHeadDim);
  } else {
    copy_predicated(store, store_thr.partition_S(sO), store_thr.partition_D(gO), store_thr.partition_D(cQ), q_rows,
                    T::kHeadDim);
  }
}

}  // namespace flash_gen
