// Hopper forward (issue 7): warp-specialised, TMA-fed, both GEMMs on wgmma.
//   warpgroup 0 (producer): one thread issues TMA loads of the Q tile and of K/V tiles into a kStages-deep ring of
//     swizzled shared-memory buffers; full/empty mbarriers hand buffers to and from the consumers. It gives its
//     registers to the consumers (setmaxnreg).
//   warpgroups 1..kConsumers (1 to 3; with one, two CTAs share an SM): 64 query rows each. S = Q K^T reads both
//     operands from shared memory (SS), O += P V takes P from registers (RS; kPInSmem: from shared memory) and V
//     read head-dim-major. Within a warpgroup the softmax of tile j runs while the tensor cores compute
//     P_{j-1} V_{j-1} (intra-warpgroup overlap, unless kOverlap is off); with kPingPong the consumer warpgroups
//     take turns issuing their GEMMs (named barriers), so one's softmax overlaps the others' GEMMs.
// With kPersistent as many CTAs as fit on the SMs walk the query tiles (Sm90Tile, sm90_tile_of_round), so a tile's
// Q and first K/V loads overlap the previous tile's epilogue (O has a staging buffer of its own) and no CTA launch
// sits between tiles; otherwise each CTA serves one tile (the loops below run once, and the registers that carry
// state across tiles are free). Same FwdParams, masks, score modifiers (softcap, ALiBi) and softmax conventions
// as the portable kernel (fwd_sm80.cuh), with its own softmax step (online_softmax.cuh); dense or packed ragged
// (varlen) batches, or (kKvCache) a KV cache read tile by tile: per-entry key counts, left padding and cache
// entries, or pages of whole key tiles found through the block table. O leaves through shared memory and TMA
// stores (varlen: plain stores); with kSplit (dense calls with few query tiles) several CTAs share a tile's keys
// and write fp32 partials instead.
// With kPackGqa (GQA/MQA, few query rows) a tile serves every query head of one KV head: a warpgroup's 64 rows
// stack the group's heads position by position (row = position x group + head), each K/V tile then feeds
// group x as many rows. Q and O move through 5-D TMA maps (head_dim, heads of a group, seqlen, groups, batch)
// whose boxes hold 64 / group whole positions; unpacked, the group is 1.
// With kCluster = 2 (unmasked dense batches) the two CTAs of a thread-block cluster serve neighbouring query
// tiles of one head, which read the same K/V tiles: each CTA's producer loads half of every K/V tile and
// multicasts it into both CTAs, so each tile leaves L2 once per cluster. A stage is free again once the consumers
// of both CTAs have released it (they arrive on both CTAs' empty barriers).
#pragma once
// Key tiles outside CuTe's basic wgmma N set need CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED defined before this header
// (fwd_sm90.cu.j2 does it): otherwise its op selector splits, say, N = 176 into eleven N = 16 instructions.
#include "flash_gen/attn_mask.cuh"
#include "flash_gen/convert_pairs.cuh"
#include "flash_gen/dropout.cuh"
#include "flash_gen/fwd_sm90_params.cuh"
#include "flash_gen/kv_cache.cuh"
#include "flash_gen/online_softmax.cuh"
#include "flash_gen/score_mods.cuh"
#include "flash_gen/seq_info.cuh"
#include "flash_gen/sm80_utils.cuh"
#include "flash_gen/sm90_cluster.cuh"
#include "flash_gen/sm90_sync.cuh"
#include "flash_gen/sm90_wgmma.cuh"
#include "flash_gen/visible_keys.cuh"
#include "flash_gen/warp_scores.cuh"

namespace flash_gen {

template <class Element_, int kHeadDim_, int kConsumers_, int kBlockN_, int kStages_, bool kPingPong_,
          bool kPersistent_, Mask kMask_, bool kSoftcap_, bool kAlibi_, bool kVarlen_, bool kOverlap_,
          bool kPInSmem_, bool kPackGqa_, int kCluster_, bool kSplit_, bool kKvCache_, bool kOInV_, bool kDropout_,
          bool kAlign_, bool kStreamK_, bool kMaxFree_>
struct Sm90FwdTraits {
  using Element = Element_;
  // The head dim, a multiple of 16 (the wgmma K step) or rounded up to 64 (flash_gen.spec_sm90.sm90_head_dim): the
  // TMA boxes zero-fill the columns past the tensors' own head dim on load and skip them on store, so zero columns
  // add nothing to S and O.
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kConsumers = kConsumers_;  // consumer warpgroups; with one, two CTAs share an SM
  static constexpr int kBlockM = 64 * kConsumers;  // 64 rows (the wgmma M) per consumer warpgroup
  static constexpr int kCtasPerSm = kConsumers == 1 ? 2 : 1;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;  // K/V buffers in the ring
  static constexpr bool kPingPong = kPingPong_;
  static constexpr bool kPersistent = kPersistent_;  // grid: min(tiles, SMs) instead of tiles
  // Intra-warpgroup overlap: step j's softmax runs while step j-1's P V GEMM computes. Without it each step runs
  // S, softmax and P V in turn (the tensor cores then see only the other warpgroups' GEMMs during a softmax).
  static constexpr bool kOverlap = kOverlap_;
  // The P V GEMM reads P from shared memory (SS) instead of registers (RS): P is stored after its conversion.
  static constexpr bool kPInSmem = kPInSmem_;
  // Max-free steps ("_mf"): after a tile's first key step, the overlapped steps take P from the reference maxima as
  // they stand, without the tile's maximum (online_softmax_max_free); a warp where an element would exceed 2^15
  // computes its rows of S again by mma.sync (warp_scores: Q and K are released after the softmax), raises their
  // maxima and repeats the step.
  static constexpr bool kMaxFree = kMaxFree_;
  static_assert(!kMaxFree || kOverlap_);
  static constexpr int kConsumerThreads = 128 * kConsumers;
  static constexpr int kNThreads = 128 + kConsumerThreads;  // the producer warpgroup first
  // setmaxnreg budgets (multiples of 8). Consumers' increases are served only from what the producer's decrease
  // frees in the CTA's launch allocation (kNThreads x the registers per thread that __launch_bounds__ gives, 168 at
  // 384 threads), so the budgets must fit that allocation, not just the register file: 32 + 2 x 240 hung.
  static constexpr int kProducerRegs = kConsumers == 3 ? 32 : 24;
  static constexpr int kConsumerRegs = kConsumers == 1 ? 232 : (kConsumers == 2 ? 240 : 160);
  static_assert(kConsumers >= 1 && kConsumers <= 3 && (kConsumers > 1 || !kPingPong_));
  static constexpr int kLaunchRegs = 65536 / (kCtasPerSm * kNThreads) / 8 * 8;
  static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <= kNThreads * kLaunchRegs);
  static constexpr Mask kMask = kMask_;
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr bool kAlibi = kAlibi_;
  static constexpr bool kVarlen = kVarlen_;  // packed ragged batch (seq_info.cuh); one CTA per tile
  static_assert(!(kVarlen && kPersistent_), "varlen tiles are found by a warp-collective scan, once per CTA");
  // Pack-GQA: rows of several heads per tile (the query positions per warpgroup a runtime 64 / group).
  static constexpr bool kPackGqa = kPackGqa_;
  static_assert(!(kPackGqa && (kVarlen || kAlibi)), "packed heads: dense batches, one ALiBi slope per tile");
  // CTAs per cluster, sharing K/V tiles (each loads 1 / kCluster of a tile's rows and multicasts them). Every tile
  // of a cluster must see the same keys: no masks, no ragged batches.
  static constexpr int kCluster = kCluster_;
  static_assert(kCluster == 1 || (kCluster == 2 && kMask_ == Mask::kNone && !kVarlen));
  // Split-KV (dense batches with few query tiles): p.num_splits CTAs share each query tile's key tiles and write
  // fp32 partial O and lse (fwd_combine.cuh merges them). One tile per CTA, no cluster.
  static constexpr bool kSplit = kSplit_;
  static_assert(!kSplit || (!kPersistent_ && kCluster == 1 && !kVarlen));
  // Stream-K (persistent CTAs, unmasked dense batches): the key steps of the last, partial round's tiles are
  // shared out evenly over the CTAs (sm90_work_of_round); the piece that starts a tile merges the others' partials.
  static constexpr bool kStreamK = kStreamK_;
  static_assert(!kStreamK || (kPersistent_ && kCluster == 1 && kMask_ == Mask::kNone && !kSplit && !kDropout_));
  // K/V from a KV cache (flash_attn_with_kvcache; varlen: flash_attn_varlen_func with a block table): entry b's
  // keys are rows [leftpad, seqused_k) (varlen: its cu_seqlens_k count) of cache entry kv_batch_idx[b], or of its
  // pages (block_table; pages of a multiple of 128 rows, so a key tile lies in one page). One tile per CTA: the
  // producer warpgroup zeroes the stale rows of the tile's last V tile once.
  static constexpr bool kKvCache = kKvCache_;
  static_assert(!kKvCache || (!kPersistent_ && kCluster == 1 && 128 % kBlockN_ == 0));
  // A TMA box row is one swizzle row: 128 bytes (64 columns) where they divide the head dim, else 64 or 32 bytes,
  // so a head dim of 80 computes 80 columns instead of 128 (flash_gen.spec_sm90.sm90_box_cols).
  static constexpr int kBoxCols = kHeadDim % 64 == 0 ? 64 : (kHeadDim % 32 == 0 ? 32 : 16);
  // Aligned rows ("_al", Sm90FwdParams::qk_shift_bits): Q's and K's boxes start 8 columns early for KV heads whose K
  // rows start mid-sector, V's for those whose V rows do (dense K/V, packed or not: split partials index columns).
  // O's boxes keep column 0 (a TMA store at a negative column raises an illegal instruction): its shifted columns
  // are staged rotated back instead, so the staged tile is in the tensor's column order (packed batches' stores).
  static constexpr bool kAlign = kAlign_;
  static_assert(!kAlign || (!kSplit && !kKvCache));
  static_assert(kHeadDim % 16 == 0, "the S GEMM's K steps: head dim a multiple of 16");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "wgmma N and TMA box rows");

  // Consumer warpgroup w computes rows [64w, 64w + 64) of both GEMMs.
  using MmaS = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(),
      Layout<Shape<Int<kConsumers>, _1, _1>>{}));
  // A warpgroup's last key step whose visible keys all lie in the first half of the key tile runs its P V GEMM
  // over that half only (K halved, in whole k16 steps). (The S GEMM with N halved as well made ptxas serialise
  // the kernel's wgmmas: C7511, "insufficient register resources", even with its own accumulator.)
  static constexpr bool kHalfSteps = kBlockN % 32 == 0;
  using PVShape = Shape<_64, Int<kHeadDim>, Int<kBlockN>>;
  using MmaO = decltype(make_tiled_mma(
      cute::conditional_t<kPInSmem,
                          decltype(GMMA::ss_op_selector<Element, Element, float, PVShape, GMMA::Major::K,
                                                        GMMA::Major::MN>()),
                          decltype(GMMA::rs_op_selector<Element, Element, float, PVShape, GMMA::Major::K,
                                                        GMMA::Major::MN>())>{},
      Layout<Shape<Int<kConsumers>, _1, _1>>{}));

  // 8 rows x kBoxCols elements atoms, 16-byte chunks XOR-swizzled: the layout TMA's 128- (64-, 32-) byte swizzle
  // writes. Atoms run down the rows first, so each kBoxCols-column slab of a tile is one contiguous TMA box.
  using SmemAtom = cute::conditional_t<
      kBoxCols == 64, GMMA::Layout_K_SW128_Atom<Element>,
      cute::conditional_t<kBoxCols == 32, GMMA::Layout_K_SW64_Atom<Element>, GMMA::Layout_K_SW32_Atom<Element>>>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V^T (head dim, keys, stage): the same bytes as V, seen as the PV GEMM's head-dim-major B operand.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{})));

  // P (query rows x keys, keys contiguous) in the widest swizzle whose atom divides the key tile.
  using SmemAtomP = cute::conditional_t<
      kBlockN % 64 == 0, GMMA::Layout_K_SW128_Atom<Element>,
      cute::conditional_t<kBlockN % 32 == 0, GMMA::Layout_K_SW64_Atom<Element>, GMMA::Layout_K_SW32_Atom<Element>>>;
  using SmemLayoutP = decltype(tile_to_shape(SmemAtomP{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));

  struct StageBarriers {
    MBarrier q_full, q_empty, k_full[kStages], v_full[kStages], k_empty[kStages], v_empty[kStages];
  };
  struct CacheBarriers : StageBarriers {
    MBarrier v_tail;  // kKvCache: the last V tile's stale rows are zero (128 producer arrivals)
  };
  struct OInVBarriers : StageBarriers {
    // kOInV: round r's O stores have read the V ring (one arrival per consumer warpgroup); rounds alternate
    // between the two, so the producer, at most one round behind, never meets a barrier two phases ahead.
    MBarrier o_free[2];
  };
  using Barriers = cute::conditional_t<kKvCache, CacheBarriers, cute::conditional_t<kOInV_, OInVBarriers, StageBarriers>>;
  // Named barriers after the consumers' ping-pong, epilogue and P ids: the producer warpgroup's, then (kOInV) all
  // consumer warpgroups'.
  static constexpr int kProducerBarrierId = 3 * kConsumers + 1;
  static constexpr int kConsumersBarrierId = 3 * kConsumers + 2;
  static constexpr int kQBytes = int(sizeof(Element)) * kBlockM * kHeadDim;
  static constexpr int kKVTileBytes = int(sizeof(Element)) * kBlockN * kHeadDim;
  // O leaves through shared memory. Persistent CTAs stage it in a buffer of its own, so the next tile's Q can load
  // while this tile's O is written and stored, or (kOInV, where that buffer does not fit: head dim 256) in the V
  // ring, as FlashAttention-3 does: then only the next tile's first V load waits for the O stores, and its Q, first
  // K, S GEMM and softmax go ahead. One tile per CTA: through the Q buffer (the CTA needs Q no more).
  static constexpr bool kOInV = kOInV_;
  // Dropout: each warp's S holds m16n8 fragments per 16 rows and every n8 block of the key tile, as the portable
  // kernel's does, so the same draws (dropout.cuh) apply after the softmax; the epilogue scales.
  static constexpr bool kDropout = kDropout_;
  static_assert(!kOInV || (kPersistent && kCluster == 1 && kStages * kBlockN >= kBlockM),
                "O in the V ring of a persistent CTA, which no peer CTA multicasts into");
  static constexpr bool kSeparateO = kPersistent && !kOInV;
  static constexpr int kOBytes = kSeparateO ? kQBytes : 0;
  static constexpr int kPBytes = kPInSmem ? int(sizeof(Element)) * kBlockM * kBlockN : 0;
  // Persistent CTAs: the producer publishes each tile (an Sm90Tile) in shared memory with its Q, so the consumers
  // do not repeat the integer divisions that locate it (about a thousand cycles between tiles on the H200).
  static constexpr int kTileSlotBytes = kPersistent ? 64 : 0;
  // Persistent CTAs of three warpgroups without ping-pong turns, head dims up to 64: warpgroup w starts its first
  // tile 900 w ns (about half a key step) late. Up to +2.5% on the H100 at head dim 64, 22 of 24 cells level or
  // faster (docs/hopper_forward.md, "Staggered warpgroup starts"); level to -1% at head dim 128, so not there.
  static constexpr bool kStaggerStart = kPersistent && !kPingPong && kConsumers == 3 && !kOInV && kHeadDim <= 64;
  static constexpr int kSmemBytes =
      kQBytes + 2 * kStages * kKVTileBytes + kOBytes + kPBytes + int(sizeof(Barriers)) + kTileSlotBytes;
};

// The query tiles of one launch, t in [0, tiles) mapped to (m_block, batch, head). By default m runs fastest, so
// the CTAs running at once share few (batch, head)s' K/V in L2; under masks with a right bound (causal, local)
// m runs backwards, longest tile first. Persistent CTAs under such masks instead take tiles by length within
// sections of (batch, head) pairs whose K/V fit in kL2SectionBytes (but at least a round of tiles): the CTAs of
// one round then get similar lengths and still share a section's K/V in L2. Sections alternate longest-first and
// shortest-first, the last longest-first, so the lengths along the tile order rise and fall without jumps, which
// the snaking rounds (sm90_tile_of_round) pair off evenly, and the last round holds the shortest tiles. Sections
// all longest-first left the busiest CTA 1.5-1.7x the mean work where a section holds about a round of tiles (head
// dim 256 causal 16k, benchmarks/persistent_balance.py). (Launching one CTA per tile, the sectioned order measured
// 7% slower than the default at head dim 64, causal, 2k: H200, 2026-11-30.) Sm90FwdParams::section_pairs, where set,
// gives the width instead (FLASH_GEN_SECTION_PAIRS: a section's K/V against the balance, docs/benchmarks.md).
constexpr long long kL2SectionBytes = 24ll << 20;  // about half the H100/H200 L2

// Split-KV: tile t's split, the slowest index of the tile walk.
__device__ __forceinline__ int sm90_split_of(int t, int m_blocks, int heads, int batch) {
  return t / (m_blocks * heads * batch);
}

template <class T>
struct Sm90Tile {
  // head: the Q/O maps' head coordinate (the query head; packed, the KV head, whose group's heads the tile stacks).
  // row0: the query position of the tile's first row (packed: of its first `group` rows).
  int m_block, head, head_k, batch, row0, n_min, n_max;
  int idle_wgs;  // leading consumer warpgroups whose rows all lie before position 0
  // The entry's rows: dense, seqlen_q/k of every entry, reached through the TMA maps' batch coordinate (Q/O:
  // q_batch(); K/V: kv_batch, the entry, or with a KV cache its cache entry); varlen, rows [q_start, q_start +
  // seqlen_q) of the packed tensors (batch coordinate 0). A KV cache entry's keys start at cache row k_start.
  int q_start = 0, k_start = 0, seqlen_q, seqlen_k, kv_batch;
  bool valid = true;  // varlen: false for the CTAs past the last tile (the grid is an upper bound)

  // Dense: tile t of m_blocks per (batch, head; packed: KV head). Varlen (warp-collective: every lane of the warp
  // calls it): tile t of a grid of gridDim.x = nheads x (a bound on the summed per-entry tiles), head-major.
  // A consumer warpgroup covers `wg_rows` query positions (64; packed, 64 / group).
  __device__ __forceinline__ Sm90Tile(FwdParams const& p, int m_blocks, int t, int group, int wg_rows,
                                      int section_pairs) {
    int split = 0;  // kSplit: which share of the key tiles (sm90_split_of recomputes it; no member, which the
                    // persistent tile slot would carry)
    if constexpr (T::kVarlen) {
      const int per_head = gridDim.x / p.nheads;
      head = t / per_head;
      const int2 e = varlen_tile(p.cu_seqlens_q, p.batch, p.seqlen_q, t % per_head,
                                 [](int len) { return (len + T::kBlockM - 1) / T::kBlockM; });
      valid = e.x >= 0;
      batch = max(e.x, 0);
      packed_range(p.cu_seqlens_q, batch, p.seqlen_q, q_start, seqlen_q);
      m_blocks = (seqlen_q + T::kBlockM - 1) / T::kBlockM;
      m_block = MaskBounds<T::kMask>::kRight ? m_blocks - 1 - e.y : e.y;
      if constexpr (T::kKvCache) {
        SeqInfo seq;
        kv_batch = kv_cache_rows<true>(p, batch, seq);
        k_start = seq.k_start;
        seqlen_k = seq.seqlen_k;
      } else {
        packed_range(p.cu_seqlens_k, batch, p.seqlen_k, k_start, seqlen_k);
        kv_batch = 0;
      }
    } else {
      int hb;
      const int heads = T::kPackGqa ? p.nheads_k : p.nheads;
      if constexpr (MaskBounds<T::kMask>::kRight && T::kPersistent) {
        const long long kv_bytes = 2ll * p.seqlen_k * T::kHeadDim * int(sizeof(typename T::Element));
        const int pairs = heads * p.batch;
        const int fit = int(min(static_cast<long long>(pairs), kL2SectionBytes / max(kv_bytes, 1ll)));
        const int section = section_pairs > 0 ? min(section_pairs, pairs)
                                              : max(1, min(pairs, max(fit, (int(gridDim.x) + m_blocks - 1) / m_blocks)));
        const int sections = (pairs + section - 1) / section;
        const int sec = t / (section * m_blocks), base = sec * section;
        const int width = min(section, pairs - base), r = t - base * m_blocks;
        const int level = r / width;  // 0: the section's longest tiles
        m_block = (sections - 1 - sec) & 1 ? level : m_blocks - 1 - level;
        hb = base + r % width;
      } else {
        m_block = MaskBounds<T::kMask>::kRight ? m_blocks - 1 - t % m_blocks : t % m_blocks;
        hb = t / m_blocks;
      }
      if constexpr (T::kSplit) {  // the split runs slowest: a split's CTAs read the same key range
        split = sm90_split_of(t, m_blocks, heads, p.batch);
        hb %= heads * p.batch;
      }
      head = hb % heads;
      batch = kv_batch = hb / heads;
      seqlen_q = p.seqlen_q;
      seqlen_k = p.seqlen_k;
      if constexpr (T::kKvCache) {
        SeqInfo seq;
        kv_batch = kv_cache_rows<false>(p, batch, seq);
        k_start = seq.k_start;
        seqlen_k = seq.seqlen_k;
      }
    }
    head_k = T::kPackGqa ? head : head / group;
    // Under right-bounded masks the ragged tile is the first: the shortest tile, so its idle rows cost the fewest
    // key steps (192-row tiles over a causal 2k triangle: 12% more than the triangle instead of 18% with the
    // ragged tile last). The shift is in whole warpgroups, so a warpgroup's rows are all idle (negative: not
    // loaded, not stored) or start at a position >= 0: TMA coordinates stay non-negative.
    const int tile_rows = T::kConsumers * wg_rows;
    const int shift = MaskBounds<T::kMask>::kRight ? (m_blocks * tile_rows - seqlen_q) / wg_rows * wg_rows : 0;
    row0 = m_block * tile_rows - shift;
    idle_wgs = max(0, -row0) / wg_rows;
    visible_key_tiles<T::kMask, T::kBlockN>(max(row0, 0), min(row0 + tile_rows, seqlen_q) - 1, seqlen_k, diag(),
                                            p.window_left, p.window_right, n_min, n_max);
    n_max = max(n_min, n_max);  // an empty tile: no key steps, O = 0 and lse = +inf
    if constexpr (T::kSplit) {  // this CTA's share of the visible key tiles (possibly none)
      const int per_split = (n_max - n_min + p.num_splits - 1) / p.num_splits;
      const int first = min(n_max, n_min + split * per_split);
      n_max = min(n_max, first + per_split);
      n_min = first;
    }
  }

  __device__ __forceinline__ int diag() const { return seqlen_k - seqlen_q; }
  __device__ __forceinline__ int q_batch() const { return T::kVarlen ? 0 : batch; }
  // KV cache: rows of the last key tile past the entry's keys. TMA reads them from the cache (older steps, other
  // entries' pages) instead of zero-filling; S masks them to -inf, so P is 0 there, but 0 x a stale inf or NaN in
  // V would still be NaN: the producer warpgroup zeroes them before the last P V GEMM (zero_stale_v_rows).
  __device__ __forceinline__ int stale_v_rows() const {
    return T::kKvCache && n_min < n_max ? max(0, n_max * T::kBlockN - seqlen_k) : 0;
  }
};

constexpr int kNoTile = 0x7fffffff;  // past every launch's tiles

// The tile a CTA serves in `round` (from 0): blockIdx.x, and with kPersistent one per round of gridDim.x tiles,
// snaking (c, then gridDim.x - 1 - c, ...) so that over the rounds every CTA gets a like mix of long and short
// tiles. Past the last tile (>= tiles) the CTA is done; only the last round is ragged, so no CTA skips a tile.
// Clusters snake as units: the CTAs of a cluster always serve consecutive tiles (tiles is a multiple of kCluster).
template <class T>
__device__ __forceinline__ int sm90_tile_of_round(int round) {
  if constexpr (!T::kPersistent) return round == 0 ? int(blockIdx.x) : kNoTile;
  const int g = gridDim.x / T::kCluster, c = blockIdx.x / T::kCluster;
  return T::kCluster * (round * g + ((round & 1) ? g - 1 - c : c)) + blockIdx.x % T::kCluster;
}

// A persistent CTA's work in `round`: a tile, and in stream-K kernels (kStreamK with p.sk_chunk = L > 0, unmasked:
// every tile takes the same p.sk_steps = K > L key steps) which of its key steps. The rounds of whole tiles stop at
// the last full one (p.sk_rounds of them); the p.sk_tiles tiles left, their key steps laid end to end, go out in
// chunks of L, CTA c taking steps [c L, c L + L): the end of one tile (round sk_rounds), then maybe the start of
// the next (round sk_rounds + 1). So a last round that would keep a few CTAs busy for a whole tile while the rest
// idle takes about L / K of a tile instead (docs/hopper_forward.md, "The last round of a persistent walk"). The
// piece holding a tile's first step owns it: it is always its CTA's last, and merges the partials of the pieces
// after it, which are their CTAs' first, so no CTA waits on one that waits. The host works out the round and tile
// counts: the producer (24 registers) divides only in the stream-K rounds.
struct Sm90Work {
  int t;  // the tile; the CTA is done at t >= the launch's tiles (stream-K kernels: at kNoTile, the consumers then
          // needing no register for the tile count, which spilled at head dim 256)
  int n_begin, n_end;  // its key steps, counted from the first
};

template <class T>
__device__ __forceinline__ Sm90Work sm90_work_of_round(Sm90FwdParams const& params, int round) {
  Sm90Work w{sm90_tile_of_round<T>(round), 0, 0};
  if constexpr (T::kStreamK) {
    const int chunk = params.sk_chunk, steps = params.sk_steps, full = params.sk_rounds, ctas = gridDim.x;
    w.n_end = steps;
    if (round < full) return w;
    if (chunk == 0 || chunk >= steps) {  // whole tiles in the last round too
      if (round > full || w.t >= full * ctas + params.sk_tiles) w.t = kNoTile;
      return w;
    }
    {
      const int total = params.sk_tiles * steps;
      const int lo = int(blockIdx.x) * chunk, hi = min(lo + chunk, total);
      const int begin = round == full ? lo : (lo / steps + 1) * steps;
      if (round > full + 1 || begin >= hi) {
        w.t = kNoTile;
        return w;
      }
      const int first = begin / steps * steps;
      w.t = full * ctas + begin / steps;
      w.n_begin = begin - first;
      w.n_end = min(hi - first, steps);
    }
  }
  return w;
}

// Stream-K partials, one flag per (CTA slot, consumer warpgroup): each of the 128 writing threads adds 1 with
// release semantics once its rows are stored; each of the 128 merging threads waits (acquire) until all have,
// then adds its own 1. A launch adds 256 to every flag it uses, so between launches each is a multiple of 256 and
// the flags need zeroing only once (flash_gen.runtime.fwd keeps them per device and stream).
__device__ __forceinline__ void sk_arrive_written(unsigned* flag) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(flag) : "memory");
}

__device__ __forceinline__ void sk_wait_written(unsigned* flag) {
  unsigned v;
  do {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
  } while (v % 256 < 128);
  asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" ::"l"(flag) : "memory");
}

// A stream-K slot of fp32 partials (one per CTA, for its piece after a tile's first key step; kBlockM x kD and
// lse per tile row) as consumer thread `thread` sees it through its O accumulators `acc` (o_rc's layout): the
// thread's k-th accumulator at k x kConsumerThreads + thread, so a warp's accesses are contiguous and each thread's
// at static offsets from one address (a row-major tile took an address register per column pair, and spilled at
// head dim 256). Slot indices are 32-bit (a few CTAs' tiles): 64-bit row indices hoisted out of the key steps
// spilled there too.
template <class T, class AccLayout>
__device__ __forceinline__ auto sk_slot(float* partials, int cta, int thread, AccLayout const& acc) {
  return make_tensor(make_gmem_ptr(partials + cta * T::kBlockM * T::kHeadDim + thread),
                     composition(make_layout(Int<T::kHeadDim / 2>{}, Int<T::kConsumerThreads>{}), acc));
}

// The producer (one thread): per tile, Q once its buffer is free again (the consumers' last S GEMMs of the
// previous tile have completed), then K and V of every key step into the ring, each waiting for its buffer to be
// released. `it` counts key steps over all tiles, as the consumers do, so both agree on every buffer's phase.
template <class T>
__device__ __forceinline__ void fwd_sm90_produce(Sm90FwdParams const& params, typename T::Barriers& bars,
                                                 typename T::Element* smem_q, typename T::Element* smem_k,
                                                 typename T::Element* smem_v, int m_blocks, int tiles, int group,
                                                 int wg_rows, Sm90Tile<T> const& first, Sm90Tile<T>* tile_slot) {
  constexpr int kBoxes = T::kHeadDim / T::kBoxCols, kBlockN = T::kBlockN;
  const int cta_rank = T::kCluster > 1 ? int(cluster_cta_rank()) : 0;
  prefetch_tensor_map(params.tma_q);
  prefetch_tensor_map(params.tma_k);
  prefetch_tensor_map(params.tma_v);
  int it = 0;
  for (int round = 0;; ++round) {
    const Sm90Work work = sm90_work_of_round<T>(params, round);
    if (T::kStreamK ? work.t == kNoTile : work.t >= tiles) break;
    Sm90Tile<T> tile =
        T::kPersistent ? Sm90Tile<T>(params.base, m_blocks, work.t, group, wg_rows, params.section_pairs) : first;
    if constexpr (T::kStreamK) {
      tile.n_max = tile.n_min + work.n_end;
      tile.n_min += work.n_begin;
    }
    bars.q_empty.wait((round & 1) ^ 1);
    // The consumers have read the previous tile's slot (before releasing its Q); q_full's arrival below releases
    // this write to them.
    if constexpr (T::kPersistent) *tile_slot = tile;
    // One box per kBoxCols-column slab and warpgroup, wg_rows positions of `group` heads (packed, the slab's rows past
    // group x wg_rows are left as they are); idle warpgroups' rows are not loaded.
    const int slab_bytes = int(sizeof(typename T::Element)) * T::kHeadDim * (T::kPackGqa ? group * wg_rows : 64);
    bars.q_full.arrive_expect_tx(slab_bytes * (T::kConsumers - tile.idle_wgs));
    const int qk_shift = T::kAlign ? sm90_col_shift(params.qk_shift_bits, tile.head_k) : 0;
    const int v_shift = T::kAlign ? sm90_col_shift(params.v_shift_bits, tile.head_k) : 0;
    for (int w = tile.idle_wgs; w < T::kConsumers; ++w) {
      CUTE_UNROLL
      for (int c = 0; c < kBoxes; ++c) {
        tma_load_5d(params.tma_q, bars.q_full, smem_q + (c * T::kBlockM + 64 * w) * T::kBoxCols,
                    c * T::kBoxCols - qk_shift, 0, tile.q_start + tile.row0 + wg_rows * w, tile.head, tile.q_batch());
      }
    }
    for (int n = tile.n_min; n < tile.n_max; ++n, ++it) {
      const int stage = it % T::kStages;
      const uint32_t phase = (it / T::kStages) & 1;
      // The key tile's first row and batch coordinate in the K/V maps: a paged cache's tile lies in one page
      // (the page size a multiple of 128 rows, kBlockN a divisor of 128), found through the block table (entries
      // clamped to the pages: a bad entry reads a wrong page, never outside the cache).
      int row = tile.k_start + n * kBlockN, kv_batch = tile.kv_batch;
      if constexpr (T::kKvCache) {
        FwdParams const& p = params.base;
        if (p.block_table != nullptr) {
          const int index = row / p.page_size;
          kv_batch = min(max(p.block_table[tile.batch * p.block_table_stride + index], 0), p.kv_batches - 1);
          row -= index * p.page_size;
        }
      }
      // Key step n of K or V into its stage buffer, once the consumers (of every CTA of the cluster) have released
      // it. In a cluster this CTA loads its share of the rows into every CTA; the full barrier counts all shares.
      auto load = [&](const TensorMap& map, MBarrier& full, MBarrier& empty, typename T::Element* smem, int shift) {
        empty.wait(phase ^ 1);
        full.arrive_expect_tx(T::kKVTileBytes);
        constexpr int kShare = kBlockN / T::kCluster;
        CUTE_UNROLL
        for (int c = 0; c < kBoxes; ++c) {
          typename T::Element* dst = smem + stage * kBlockN * T::kHeadDim + c * kBlockN * T::kBoxCols;
          if constexpr (T::kCluster == 1) {
            tma_load_4d(map, full, dst, c * T::kBoxCols - shift, row, tile.head_k, kv_batch);
          } else {
            tma_load_4d_multicast(map, full, dst + cta_rank * kShare * T::kBoxCols, c * T::kBoxCols - shift,
                                  row + cta_rank * kShare, tile.head_k, kv_batch, (1 << T::kCluster) - 1);
          }
        }
      };
      load(params.tma_k, bars.k_full[stage], bars.k_empty[stage], smem_k, qk_shift);
      if constexpr (T::kOInV) {  // the previous round's O, staged in the V ring, has been read by its stores
        if (n == tile.n_min && round > 0) bars.o_free[(round - 1) & 1].wait(((round - 1) >> 1) & 1);
      }
      load(params.tma_v, bars.v_full[stage], bars.v_empty[stage], smem_v, v_shift);
    }
  }
}

// KV cache: the producer warpgroup zeroes the stale rows of the CTA's last V tile (Sm90Tile::stale_v_rows) once
// it has landed, then hands it to the consumers' last P V GEMM (v_tail). Thread 0 issued that load, so once it has
// returned from the producer loop a wait on the stage's full barrier can only be for that phase: warp 0 waits
// (whole, so that it reaches the named barrier converged) and the other warps wait for it there. A swizzle
// permutes 16-byte chunks within one swizzle row, so a tile row is one whole row of each kBoxCols-column slab.
template <class T>
__device__ __forceinline__ void zero_stale_v_rows(Sm90Tile<T> const& tile, typename T::Barriers& bars,
                                                  typename T::Element* smem_v) {
  const int stale = tile.stale_v_rows();
  if (stale == 0) return;
  const int last = tile.n_max - 1 - tile.n_min;  // key step of the last V tile (one tile per CTA)
  const int stage = last % T::kStages;
  if (threadIdx.x < 32) bars.v_full[stage].wait((last / T::kStages) & 1);
  named_barrier_sync(T::kProducerBarrierId, 128);
  constexpr int kRowBytes = T::kBoxCols * int(sizeof(typename T::Element)), kSlabs = T::kHeadDim / T::kBoxCols;
  const int chunks = stale * kRowBytes / 16;  // per slab
  char* first = reinterpret_cast<char*>(smem_v + stage * T::kBlockN * T::kHeadDim) + (T::kBlockN - stale) * kRowBytes;
  for (int i = threadIdx.x; i < kSlabs * chunks; i += 128) {
    const int slab = i / chunks;
    reinterpret_cast<uint4*>(first + slab * T::kBlockN * kRowBytes)[i - slab * chunks] = make_uint4(0, 0, 0, 0);
  }
  fence_smem_for_async_proxy();  // before the P V GEMM reads them through the async proxy
  bars.v_tail.arrive();
}

template <class T>
__device__ __forceinline__ void fwd_sm90_kernel(Sm90FwdParams const& params) {
  using Element = typename T::Element;
  using Barriers = typename T::Barriers;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kD = T::kHeadDim, kStages = T::kStages;
  FwdParams const& p = params.base;
  extern __shared__ __align__(1024) char smem_buf[];  // 128-byte swizzle atoms repeat every 1024 bytes
  Element* smem_q = reinterpret_cast<Element*>(smem_buf);
  Element* smem_k = smem_q + kBlockM * kD;
  Element* smem_v = smem_k + kStages * kBlockN * kD;
  Element* smem_o = T::kSeparateO ? smem_v + kStages * kBlockN * kD : (T::kOInV ? smem_v : smem_q);
  Element* smem_p = smem_v + kStages * kBlockN * kD + T::kOBytes / sizeof(Element);
  Barriers& bars = *reinterpret_cast<Barriers*>(smem_p + T::kPBytes / sizeof(Element));
  static_assert(!T::kPersistent || sizeof(Sm90Tile<T>) <= T::kTileSlotBytes, "the tile slot holds an Sm90Tile");
  Sm90Tile<T>* tile_slot = reinterpret_cast<Sm90Tile<T>*>(reinterpret_cast<char*>(&bars) + sizeof(Barriers));
  const int group = p.nheads / p.nheads_k;
  const int wg_rows = T::kPackGqa ? 64 / group : 64;  // query positions per consumer warpgroup
  const int slab_rows = T::kPackGqa ? group * wg_rows : 64;  // rows of a warpgroup's 64 that hold a query
  // Query tiles per head (dense only), in whole clusters: a cluster's last tile may lie past seqlen_q.
  const int cluster_rows = T::kCluster * T::kConsumers * wg_rows;
  const int m_blocks = (p.seqlen_q + cluster_rows - 1) / cluster_rows * T::kCluster;
  const int heads = T::kPackGqa ? p.nheads_k : p.nheads;
  const int tiles = T::kVarlen ? int(gridDim.x) : m_blocks * heads * p.batch * (T::kSplit ? p.num_splits : 1);
  // The first tile, worked out by every warp (the varlen scan is warp-collective); a CTA serving one tile keeps it.
  const Sm90Tile<T> first(p, m_blocks, sm90_tile_of_round<T>(0), group, wg_rows, params.section_pairs);
  if (!first.valid) return;  // a varlen CTA past the last tile, before any barrier

  constexpr int kConsumerWarps = T::kConsumerThreads / 32;
  if (threadIdx.x == 0) {
    bars.q_full.init(1);
    bars.q_empty.init(T::kConsumerThreads);
    CUTE_UNROLL
    for (int s = 0; s < kStages; ++s) {
      bars.k_full[s].init(1);
      bars.v_full[s].init(1);
      bars.k_empty[s].init(kConsumerWarps * T::kCluster);
      bars.v_empty[s].init(kConsumerWarps * T::kCluster);
    }
    if constexpr (T::kKvCache) bars.v_tail.init(128);
    if constexpr (T::kOInV) {
      bars.o_free[0].init(T::kConsumers);
      bars.o_free[1].init(T::kConsumers);
    }
    fence_barrier_init();
  }
  // The last CTA-wide barrier: from here the warpgroups meet only through mbarriers. In a cluster, every CTA's
  // barriers are initialised before any CTA's multicast or release reaches them.
  if constexpr (T::kCluster > 1) cluster_sync();
  else __syncthreads();

  if (threadIdx.x < 128) {
    release_registers<T::kProducerRegs>();
    if (threadIdx.x == 0) {
      fwd_sm90_produce<T>(params, bars, smem_q, smem_k, smem_v, m_blocks, tiles, group, wg_rows, first, tile_slot);
    }
    if constexpr (T::kKvCache) {
      __syncwarp();  // warp 0 converged again before the named barrier
      zero_stale_v_rows<T>(first, bars, smem_v);
    }
    if constexpr (T::kCluster > 1) cluster_sync();  // see the consumers' end
    return;
  }
  claim_registers<T::kConsumerRegs>();

  const int tidx = threadIdx.x - 128;  // consumer thread
  // Warp-uniform by construction (a broadcast): values derived from it, such as a warpgroup's key steps and so the
  // K/V stage of each step, stay in uniform registers (tidx / 128 alone made the stage descriptors per-thread).
  const int wg = __shfl_sync(0xffffffff, tidx / 128, 0);
  const bool warp_leader = tidx % 32 == 0;
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename T::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(smem_v), typename T::SmemLayoutVt{});
  Tensor sO = make_tensor(make_smem_ptr(smem_o), typename T::SmemLayoutQ{});

  typename T::MmaS mma_s;
  typename T::MmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(tidx);
  auto thr_o = mma_o.get_thread_slice(tidx);
  Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kD>>{});
  Tensor o_rc = make_tensor(acc_o.data(), gmma_rowcol(acc_o.layout()));
  Tensor tOcO = thr_o.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kD>>{}));  // rows for lse
  Tensor tOcO_rc = make_tensor(tOcO.data(), gmma_rowcol(tOcO.layout()));
  constexpr int kRows = decltype(size<0>(o_rc))::value;
  float row_max[kRows], row_sum[kRows];

  // Q's smem descriptors, the same for the warpgroup's threads: from the warp-uniform wg, so they stay in uniform
  // registers instead of taking 2 per k16 step from the consumer's 160 (three warpgroups).
  Tensor tSrQ = mma_s.get_thread_slice(128 * wg).partition_fragment_A(sQ);
  Tensor tScS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), gmma_rowcol(tScS.layout()));
  Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor s_rc = make_tensor(acc_s.data(), gmma_rowcol(acc_s.layout()));
  Tensor p_frag = make_tensor<Element>(acc_s.layout());
  Tensor tOrP = make_tensor(p_frag.data(), gmma_acc_as_a(p_frag.layout()));
  // With P in shared memory: its tile, the register-to-shared copy of the accumulator layout, and the SS GEMM's A
  // descriptors; otherwise the A operand is tOrP itself.
  Tensor sP = make_tensor(make_smem_ptr(smem_p), typename T::SmemLayoutP{});
  auto p_store = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_s);  // stmatrix
  auto thr_p_store = p_store.get_thread_slice(tidx);
  auto tOaP = [&] {
    if constexpr (T::kPInSmem) return thr_o.partition_fragment_A(sP);
    else return tOrP;
  }();
  // P_j from S_j (after the P V GEMM that read the previous P has completed). In shared memory: every warp's part
  // stored and fenced for the async proxy before the GEMM of any warp of the warpgroup reads it (named barrier
  // 2 C + 1 + w, after the ping-pong and epilogue ids).
  auto make_p = [&] {
    convert_pairs(acc_s, p_frag);
    if constexpr (T::kPInSmem) {
      Tensor src = thr_p_store.retile_S(p_frag);
      Tensor dst = thr_p_store.partition_D(sP);
      copy(p_store, src, dst);
      fence_smem_for_async_proxy();
      named_barrier_sync(2 * T::kConsumers + 1 + wg, 128);
    }
  };
  auto issue_s = [&](int stage) {
    wgmma_issue<true>(mma_s, tSrQ, thr_s.partition_fragment_B(sK(_, _, stage)), acc_s);
  };
  // O += P V of a stage; with `half` (T::kHalfSteps), over the key tile's first half only (P is zero past it).
  auto issue_pv = [&](int stage, bool half) {
    if constexpr (!T::kPInSmem) warpgroup_fence_operand(tOrP);
    Tensor tOrVt = thr_o.partition_fragment_B(sVt(_, _, stage));
    if constexpr (T::kHalfSteps) {
      if (half) {
        wgmma_issue<false, kBlockN / 32>(mma_o, tOaP, tOrVt, acc_o);
        return;
      }
    }
    wgmma_issue<false>(mma_o, tOaP, tOrVt, acc_o);
  };
  // Per-row factors that bring O to the current row maxima, applied just before the next P V GEMM adds to O (the
  // one in flight still accumulates under the old maxima); skipped by warps where no row's maximum was raised.
  float o_scale[kRows];
  bool o_scale_pending = false;

  // Ping-pong: warpgroup w may issue its GEMMs once warpgroup w - 1 (round robin) has issued its own: named
  // barrier 1 + w over 256 threads, 128 waiting here and 128 arriving from w - 1. Warpgroup 0 goes first. Every
  // warpgroup issues as many GEMMs per tile, so the turns carry over from tile to tile.
  auto wait_turn = [&] {
    if constexpr (T::kPingPong) named_barrier_sync(1 + wg, 256);
  };
  auto pass_turn = [&] {
    if constexpr (T::kPingPong) named_barrier_arrive(1 + (wg + 1) % T::kConsumers, 256);
  };
  if (wg == T::kConsumers - 1) pass_turn();

  auto rescale_o = [&] {
    if (__any_sync(0xffffffff, o_scale_pending)) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) *= o_scale[r];
      }
    }
  };
  // KV cache: the P V GEMM of a tile's last key step waits until the producers have zeroed its stale V rows.
  auto wait_v_tail = [&](Sm90Tile<T> const& tile) {
    if constexpr (T::kKvCache) {
      if (tile.stale_v_rows() > 0) bars.v_tail.wait(0);
    }
  };
  // Q, and in persistent CTAs the tile slot: every consumer thread arrives, once it has read both, so the producer
  // rewrites neither before each reader is done (a warp leader's arrival alone would order only its own reads).
  auto release_q = [&] { bars.q_empty.arrive(); };
  // A K/V stage: released in every CTA of the cluster, whose producers all write into it.
  const uint32_t peer = T::kCluster > 1 ? cluster_cta_rank() ^ 1 : 0;
  auto release_kv = [&](MBarrier& bar) {
    if (warp_leader) {
      bar.arrive();
      if constexpr (T::kCluster > 1) arrive_in_cta(bar, peer);
    }
  };

  int it = 0;  // key steps over all tiles, as the producer counts them
  for (int round = 0;; ++round) {
    const int t = sm90_work_of_round<T>(params, round).t;
    if (T::kStreamK ? t == kNoTile : t >= tiles) break;
    if constexpr (T::kStaggerStart) {
      if (round == 0) __nanosleep(900 * wg);
    }
    // Also for an empty tile: the Q phases stay in step, and without a buffer of its own O is staged where Q lands.
    bars.q_full.wait(round & 1);
    const Sm90Tile<T> tile = T::kPersistent ? *tile_slot : first;
    const int row0 = tile.row0, diag = tile.diag();
    // This warpgroup's key steps end at wg_end (<= the tile's n_max) under a right bound or the sequence end.
    // Steps from there on it only keeps in step (skip_step); its last step's P V GEMM covers half the key tile
    // (wg_half) where its rows see no key in the other half. Both from the key tiles its rows see, in whole and in
    // half tiles.
    const int wg_pos0 = max(row0 + wg_rows * wg, 0), wg_pos_last = min(row0 + wg_rows * (wg + 1), tile.seqlen_q) - 1;
    int unused, wg_end, half_end;
    visible_key_tiles<T::kMask, kBlockN>(wg_pos0, wg_pos_last, tile.seqlen_k, diag, p.window_left, p.window_right,
                                         unused, wg_end);
    visible_key_tiles<T::kMask, kBlockN / 2>(wg_pos0, wg_pos_last, tile.seqlen_k, diag, p.window_left,
                                             p.window_right, unused, half_end);
    wg_end = wg_pos_last < wg_pos0 ? tile.n_min : max(tile.n_min, min(tile.n_max, wg_end));
    const bool wg_half = T::kHalfSteps && wg_end > tile.n_min && half_end <= 2 * wg_end - 1;
    float slope = 0.f;
    if constexpr (T::kAlibi) slope = p.alibi_slopes[tile.batch * p.alibi_batch_stride + tile.head] * p.alibi_scale;
    const DropoutRng rng = make_dropout_rng<T::kDropout>(p, tile.batch, tile.head);
    // S_n = Q K_n^T, modified (softcap, ALiBi), masked and turned into P_n in place (fp32). Whether a key tile
    // needs the element-wise mask is decided on this warpgroup's 64 rows, not the CTA's: with 192-row tiles a
    // warpgroup meets the diagonal in fewer key tiles than the CTA does.
    auto modify_and_mask = [&](int n) {
      apply_score_mods<T::kSoftcap, T::kAlibi>(s_rc, tScS_rc, row0, n * kBlockN, diag, p.score_scale, slope);
      if (tile_is_cut<T::kMask>(row0 + wg_rows * wg, wg_rows, n * kBlockN, kBlockN, tile.seqlen_k, diag,
                                p.window_left, p.window_right)) {
        // Packed: tile row 64 wg + i is position row0 + wg_rows wg + i / group (mask_tile divides row0' + row).
        mask_tile<T::kMask, T::kPackGqa>(s_rc, tScS_rc, T::kPackGqa ? group * (row0 + wg_rows * wg) - 64 * wg : row0,
                                          n * kBlockN, tile.seqlen_k, diag, p.window_left, p.window_right, group);
      }
    };
    // max_free_stage >= 0 (kMaxFree, a step whose Q and K stage are still held): without the tile's maximum; where
    // that fails in any thread of the warp, the warp computes its rows of S again from shared memory alone, raises
    // their maxima and repeats, once (a second failure is a NaN score, which the step then passes on as is).
    auto scores = [&](int n, int max_free_stage = -1) {
      modify_and_mask(n);
      bool done = false;
      if constexpr (T::kMaxFree) {
        if (max_free_stage >= 0) {
          float tile_sum[kRows];
          bool raised = false;
#pragma unroll 1
          for (int attempt = 0;; ++attempt) {
            const bool ok = online_softmax_max_free(s_rc, row_max, tile_sum, p.scale_log2);
            if (__all_sync(0xffffffff, ok) || attempt == 1) break;
            warp_scores(sQ, sK(_, _, max_free_stage), 16 * (tidx / 32), s_rc);
            modify_and_mask(n);
            raised = raise_row_max(s_rc, row_max, o_scale, p.scale_log2);
          }
          CUTE_UNROLL
          for (int r = 0; r < kRows; ++r) row_sum[r] = (raised ? row_sum[r] * o_scale[r] : row_sum[r]) + tile_sum[r];
          o_scale_pending = raised;
          done = true;
        }
      }
      if (!done) o_scale_pending = online_softmax_lazy(s_rc, row_max, row_sum, o_scale, p.scale_log2);
      if constexpr (T::kDropout) {  // after the row sums, which count every probability
        dropout_scores<true>(s_rc, tScS_rc, row0, n * kBlockN, rng, [](float& x, bool kept) { x = kept ? x : 0.f; });
      }
    };
    // Q is free once the tile's last S GEMM has completed, before that step's softmax, its P V GEMM and the
    // epilogue: the producer, which loads the next tile's Q before its K/V, then starts both that much earlier.
    auto release_q_after = [&](int n) {
      if (n + 1 == tile.n_max) release_q();
    };
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -inf();
      row_sum[r] = 0.f;
    }
    clear(acc_o);
    // S of key step n (stage `it % kStages`) with nothing else in flight: wait for K, compute, release K (and Q
    // after the tile's last step).
    auto s_alone = [&](int n, int stage) {
      bars.k_full[stage].wait((it / kStages) & 1);
      wait_turn();
      issue_s(stage);
      pass_turn();
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_s);
      release_kv(bars.k_empty[stage]);
      release_q_after(n);
    };

    // A key step past wg_end: its stages released once loaded (an arrival before that could complete the
    // previous use's phase), and its ping-pong turn passed on, as the other warpgroups expect.
    auto skip_step = [&](int n) {
      const int stage = it % kStages;
      const uint32_t phase = (it / kStages) & 1;
      bars.k_full[stage].wait(phase);
      CUTE_UNROLL
      for (int turn = 0; turn < (T::kOverlap ? 1 : 2); ++turn) {  // a serial step takes one turn per GEMM
        wait_turn();
        pass_turn();
      }
      release_kv(bars.k_empty[stage]);
      release_q_after(n);
      bars.v_full[stage].wait(phase);
      release_kv(bars.v_empty[stage]);
    };

    if (!T::kOverlap) {
      // Each key step in turn: S, its softmax, then P V. Two ping-pong turns per step, one per GEMM.
      for (int n = tile.n_min; n < wg_end; ++n, ++it) {
        const int stage = it % kStages;
        s_alone(n, stage);
        scores(n);
        make_p();
        rescale_o();  // O is zero at the first step, so a rescale there changes nothing
        bars.v_full[stage].wait((it / kStages) & 1);
        if (n + 1 == tile.n_max) wait_v_tail(tile);
        wait_turn();
        issue_pv(stage, wg_half && n + 1 == wg_end);
        pass_turn();
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_o);
        release_kv(bars.v_empty[stage]);
      }
    } else if (tile.n_min < wg_end) {
      // Prologue: S of the first key step alone.
      int stage = it % kStages;
      s_alone(tile.n_min, stage);
      scores(tile.n_min);
      o_scale_pending = false;  // O is still zero

      // Steady state, key step n: S_n on the tensor cores, then P_{n-1} V_{n-1}; the softmax of S_n runs while
      // P V computes. The wait for that P V GEMM (and P_n's conversion, which overwrites the P it reads) comes
      // only after the next step's K wait: ptxas schedules the wgmma wait as early as its basic block allows, so
      // in the softmax's block it would land before the softmax and serialise it behind the GEMM.
      int pv_stage = -1;  // stage of the P V GEMM in flight, if any
      auto finish_pv = [&] {
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_o);
        if (pv_stage >= 0) release_kv(bars.v_empty[pv_stage]);
      };
      for (int n = tile.n_min + 1; n < wg_end; ++n) {
        const int prev = stage;
        const uint32_t prev_phase = (it / kStages) & 1;
        ++it;
        stage = it % kStages;
        bars.k_full[stage].wait((it / kStages) & 1);
        finish_pv();
        make_p();
        wait_turn();
        issue_s(stage);
        rescale_o();
        bars.v_full[prev].wait(prev_phase);
        issue_pv(prev, false);
        pv_stage = prev;
        pass_turn();
        warpgroup_wait<1>();  // S_n done, P V still running
        warpgroup_fence_operand(acc_s);
        if constexpr (T::kMaxFree) {  // K (and Q) stay until the softmax no longer needs S again
          scores(n, stage);
          release_kv(bars.k_empty[stage]);
          release_q_after(n);
        } else {
          release_kv(bars.k_empty[stage]);
          release_q_after(n);
          scores(n);
        }
      }
      // P V of the last key step.
      finish_pv();
      make_p();
      rescale_o();
      bars.v_full[stage].wait((it / kStages) & 1);
      if (wg_end == tile.n_max) wait_v_tail(tile);
      issue_pv(stage, wg_half);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      release_kv(bars.v_empty[stage]);
      ++it;
    }
    for (int n = max(tile.n_min, wg_end); n < tile.n_max; ++n, ++it) skip_step(n);

    if (tile.n_min >= tile.n_max) release_q();  // an empty tile: no S GEMM read Q

    // Epilogue: normalise and write lse; O goes through this warpgroup's 64 rows of the O staging buffer and out
    // with TMA stores, which skip rows outside [0, seqlen_q) (varlen: 16-byte stores of the entry's rows). A
    // split writes fp32 partials instead, (split, batch, head, position[, column]) contiguous, with lse -inf
    // where its keys leave a row nothing (weight 0 in the combine); so does a stream-K piece after its tile's
    // first key step, into its CTA's slot (sk_slot).
    // The query position and head of this thread's row r (packed: row i of the warpgroup is head i % group at
    // position i / group), and whether the row holds a query.
    auto row_at = [&](int r, int& pos, int& head) {
      const int i = get<0>(tOcO_rc(r, 0)) - 64 * wg;
      pos = row0 + wg_rows * wg + (T::kPackGqa ? i / group : i);
      head = T::kPackGqa ? tile.head * group + i % group : tile.head;
      return i < slab_rows && pos >= 0 && pos < tile.seqlen_q;
    };
    // Row r's softmax denominator (its quad's partial sums; 0 or NaN where the row saw no key: `empty`) and lse.
    // A row that saw a key sums to at least 1 (its reference maximum's own term) and far below 2^126, where
    // MUFU's reciprocal and log2 are within an ulp or two: the IEEE forms cost a branchy slow path per row.
    auto row_total = [&](int r, bool& empty) {
      const float sum = quad_sum(row_sum[r]);
      empty = sum == 0.f || sum != sum;
      return sum;
    };
    auto row_lse = [&](int r, float sum) { return (row_max[r] * p.scale_log2 + __log2f(sum)) * 0.69314718055994531f; };
    // Stream-K (unmasked: a whole tile's key steps start at 0): a piece after its tile's first step writes a
    // partial to its CTA's slot; one from the first step that stops short of the last merges the partials of the
    // CTAs after it (whose chunks start inside the tile) into its own and stores the tile as usual.
    if (T::kSplit || (T::kStreamK && tile.n_min > 0)) {  // straight from the accumulators
      const int split = T::kSplit ? sm90_split_of(t, m_blocks, heads, p.batch) : 0;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        bool empty;
        const float sum = row_total(r, empty);
        const float inv = empty ? 1.f : __fdividef(T::kDropout ? p.dropout_scale : 1.f, sum);
        int pos, head;
        if (!row_at(r, pos, head)) continue;
        const int64_t row = T::kSplit ? (int64_t(split * p.batch + tile.batch) * p.nheads + head) * p.seqlen_q + pos
                                      : int(blockIdx.x) * kBlockM + get<0>(tOcO_rc(r, 0));
        if (get<1>(tOcO_rc(r, 0)) == 0) {
          p.lse_partial[row] = empty ? -inf() : row_lse(r, sum);
        }
        if constexpr (T::kStreamK) {
          Tensor slot = sk_slot<T>(p.o_partial, blockIdx.x, tidx, o_rc.layout());
          CUTE_UNROLL
          for (int c = 0; c < size<1>(o_rc); ++c) slot(r, c) = o_rc(r, c) * inv;
        } else {
          float* o_row = p.o_partial + row * p.head_dim;
          CUTE_UNROLL
          for (int c = 0; c < size<1>(o_rc); ++c) {
            const int col = get<1>(tOcO_rc(r, c));
            if (col < p.head_dim) o_row[col] = o_rc(r, c) * inv;
          }
        }
      }
      if constexpr (T::kStreamK) {  // the CTA's next piece, if any, starts a tile: nothing is left to store
        sk_arrive_written(params.sk_flags + blockIdx.x * T::kConsumers + wg);
        if constexpr (T::kOInV) {
          if (tidx % 128 == 0) bars.o_free[round & 1].arrive();
        }
      }
      continue;  // a split: one tile per CTA
    }
    int sk_count = 0;  // partials to merge (their first pieces, so they are being or have been written)
    if constexpr (T::kStreamK) {
      if (tile.n_max < params.sk_steps) {
        // (The tile's index again, rather than t kept live across the key steps: that spilled at head dim 256.)
        const int left = sm90_work_of_round<T>(params, round).t - params.sk_rounds * int(gridDim.x);
        sk_count = ((left + 1) * params.sk_steps - 1) / params.sk_chunk - int(blockIdx.x);
        for (int j = 1; j <= sk_count; ++j) sk_wait_written(params.sk_flags + (blockIdx.x + j) * T::kConsumers + wg);
      }
    }
    // Row r merged with the partials: lse = log(sum_j exp(lse_j)) over this piece and theirs (each O normalised
    // over its own keys), O = sum_j exp(lse_j - lse) O_j; leaves `inv` 1.
    auto merge_partials = [&](int r, bool& empty, float& inv, float& lse) {
      const int row = get<0>(tOcO_rc(r, 0));
      auto partial_lse = [&](int j) { return p.lse_partial[(int(blockIdx.x) + j) * kBlockM + row]; };
      const float own = empty ? -inf() : lse;
      float top = own;
      for (int j = 1; j <= sk_count; ++j) top = fmaxf(top, partial_lse(j));
      if (top == -inf()) return;  // no piece saw a key: O stays 0, lse +inf
      float total = __expf(own - top);
      for (int j = 1; j <= sk_count; ++j) total += __expf(partial_lse(j) - top);
      lse = top + __logf(total);
      empty = false;
      const float own_weight = __expf(own - lse) * inv;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) *= own_weight;
      for (int j = 1; j <= sk_count; ++j) {
        const float weight = __expf(partial_lse(j) - lse);
        Tensor slot = sk_slot<T>(p.o_partial, blockIdx.x + j, tidx, o_rc.layout());
        CUTE_UNROLL
        for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) += weight * slot(r, c);
      }
      inv = 1.f;
    };
    float* lse_ptr = p.lse + tile.batch * p.lse_batch_stride + tile.q_start;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      bool empty;
      const float sum = row_total(r, empty);
      float inv = empty ? 1.f : __fdividef(T::kDropout ? p.dropout_scale : 1.f, sum);
      int pos, head;
      const bool stored = row_at(r, pos, head);
      float lse = 0.f;  // stream-K: the merged one
      if constexpr (T::kStreamK) {
        lse = row_lse(r, sum);
        if (sk_count > 0 && stored) merge_partials(r, empty, inv, lse);
      }
      if (stored && get<1>(tOcO_rc(r, 0)) == 0) {
        lse_ptr[head * p.lse_head_stride + pos] = empty ? inf() : (T::kStreamK ? lse : row_lse(r, sum));
      }
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) *= inv;
    }
    Tensor o_out = make_tensor<Element>(acc_o.layout());
    convert_pairs(acc_o, o_out);
    // Named barrier ids after the ping-pong ones. With a buffer of its own, the previous tile's stores must have
    // read it: the storing thread waits for that only here, a tile after issuing them, so that wait stays off the
    // next tile's first GEMM. Through Q, the CTA's one tile is done.
    if constexpr (T::kSeparateO) {
      if (tidx % 128 == 0) bulk_wait_read();
      named_barrier_sync(T::kConsumers + 1 + wg, 128);
    }
    // In the V ring, every warpgroup's P V GEMMs must have read it (and all of the tile's V loads landed: each
    // warpgroup waited for every step's V).
    if constexpr (T::kOInV) named_barrier_sync(T::kConsumersBarrierId, T::kConsumerThreads);
    if constexpr (T::kAlign) {
      // V's columns started 8 early for this KV head, so O's come out 8 late: stage them rotated back by one
      // 8-column block (the first, V's zero padding, into the last, past the tensor's head dim: not stored). One
      // stmatrix per block: lanes 0-15 address the warp's 16 rows, each thread gives its two rows' column pair.
      const int lane = tidx % 32, back = sm90_col_shift(params.v_shift_bits, tile.head_k) / 8;
      const int row = get<0>(tOcO_rc(0, 0)) - lane / 4 + lane % 16;
      Tensor o_pairs = recast<uint32_t>(o_out);  // (row r, block j) at r + 2 j
      CUTE_UNROLL
      for (int j = 0; j < kD / 8; ++j) {
        const int to = j >= back ? j - back : j - back + kD / 8;
        uint128_t& dst = *reinterpret_cast<uint128_t*>(&sO(row, 8 * to));
        SM90_U32x2_STSM_N::copy(o_pairs(2 * j), o_pairs(2 * j + 1), dst);
      }
    } else {
      auto o_store = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_o);  // stmatrix
      auto thr_o_store = o_store.get_thread_slice(tidx);
      copy(o_store, thr_o_store.retile_S(o_out), thr_o_store.partition_D(sO));
    }
    if constexpr (T::kVarlen) {
      // A TMA box of 64 rows would also write the neighbouring entries' rows. Consecutive threads take
      // consecutive 16-byte chunks of a row (coalesced); chunks past the tensor's own head dim are padding.
      named_barrier_sync(T::kConsumers + 1 + wg, 128);
      constexpr int kChunks = kD / 8;
      Element* o_rows = static_cast<Element*>(p.o) + tile.q_start * p.o_row_stride + tile.head * p.o_head_stride;
      for (int i = tidx % 128; i < 64 * kChunks; i += 128) {
        const int r = 64 * wg + i / kChunks, c = i % kChunks * 8, row = row0 + r;
        if (row >= 0 && row < tile.seqlen_q && c < p.head_dim) {
          *reinterpret_cast<uint4*>(o_rows + row * p.o_row_stride + c) = *reinterpret_cast<const uint4*>(&sO(r, c));
        }
      }
    } else {
      fence_smem_for_async_proxy();  // the generic-proxy stores above, before TMA reads them
      named_barrier_sync(T::kConsumers + 1 + wg, 128);
      if (tidx % 128 == 0) {
        if (wg >= tile.idle_wgs) {
          CUTE_UNROLL
          for (int c = 0; c < kD / T::kBoxCols; ++c) {
            tma_store_5d(params.tma_o, smem_o + c * kBlockM * T::kBoxCols + wg * 64 * T::kBoxCols,
                         c * T::kBoxCols, 0, row0 + wg_rows * wg, tile.head, tile.batch);
          }
          bulk_commit_group();
          // Through Q: before the CTA exits. In the V ring: before the producer loads the next tile's V there.
          if constexpr (!T::kSeparateO) bulk_wait_read();
        }
        if constexpr (T::kOInV) bars.o_free[round & 1].arrive();  // idle warpgroups too: the count is per warpgroup
      }
    }
  }
  if (T::kSeparateO && tidx % 128 == 0) bulk_wait_read();  // the last tile's stores, before the CTA exits
  // The other CTA's consumers may still be releasing stages on this CTA's barriers: no CTA of a cluster exits
  // before all are done.
  if constexpr (T::kCluster > 1) cluster_sync();
}

}  // namespace flash_gen
