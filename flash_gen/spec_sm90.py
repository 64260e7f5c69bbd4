"""Hopper forward kernel (templates/include/flash_gen/fwd_sm90.cuh) identities: its tiling and what it supports.

Issue 7: a TMA producer warpgroup and one to three wgmma consumer warpgroups (64 query rows each) with
intra-warpgroup overlap, optional ping-pong and persistent CTAs (docs/hopper_forward.md). Keys are the forward's
FwdKey; keys on sm90 with dense K/V (packed ragged batches or not, pack-GQA or not) or K/V read from a KV cache
tile by tile (kv "cache": contiguous, or pages of a multiple of 128 rows), and any head dim up to 256 are
supported (computed as sm90_head_dim says: TMA boxes zero-fill the columns past head_dim on load and drop them on
store), with or without softcap and ALiBi. Must not import torch or cuda.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from flash_gen.spec import MAX_SMEM_PER_BLOCK, SMEM_PER_SM, SMEM_RESERVED_PER_CTA, FwdKey

ROWS_PER_CONSUMER = 64  # the wgmma M
CONSUMER_REGISTERS = {1: 232, 2: 240, 3: 160}  # setmaxnreg of each consumer thread (kConsumerRegs in the kernel)
ADDRESSING_REGISTERS = 32  # a consumer's other registers, a floor: ptxas has the last word (hd128 n176, 196: spilled)
BARRIER_BYTES = 8  # one mbarrier
TILE_SLOT_BYTES = 64  # persistent CTAs: the tile the producer hands to the consumers (kTileSlotBytes)
# wgmma N values CuTe's op selector picks without CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED; any other key tile it
# would split into N = 16 (or 8) instructions. The extended shapes cost about 35% more compile time.
WGMMA_BASIC_N = (8, 16, 32, 64, 96, 128, 192, 256)


@dataclass(frozen=True)
class Sm90FwdConfig:
    block_n: int = 128  # keys per step (the S wgmma's N)
    stages: int = 2  # K/V shared-memory buffers in the TMA ring
    pingpong: bool = True  # the consumer warpgroups take turns issuing GEMMs (one's softmax under the other's GEMMs)
    block_m: int = 128  # query rows per CTA: 64 per consumer warpgroup (64: one, and two CTAs per SM)
    persistent: bool = False  # resident CTAs walk the query tiles (costs registers: state carried across tiles)
    overlap: bool = True  # intra-warpgroup overlap: step j's softmax under step j-1's P V GEMM (off: "_serial")
    p_in_smem: bool = False  # P V GEMM with P from shared memory (SS, "_ss") instead of registers (RS)
    # CTAs per thread-block cluster ("_c2"): neighbouring query tiles of a head, each CTA loading its share of
    # every K/V tile and multicasting it into the others (unmasked dense batches only)
    cluster: int = 1
    # "_al": shift Q's and K's columns (by K's rows) and V's (by V's) by 8 into the computed head dim's padding for
    # KV heads whose rows start 16 bytes into a 32-byte sector, so every box but the first starts on a sector: at
    # head dim 72 (144-byte rows, computed in 80's 16-column boxes) each box of an odd head otherwise spans two
    # sectors. O is staged rotated back, so its stores keep column 0
    align: bool = False
    # "_mf" (with overlap): a tile's steps after its first take P without the tile's maximum (one instruction per
    # score less), recomputing S where an element would exceed 2^15 (online_softmax_max_free)
    max_free: bool = False

    @property
    def name(self) -> str:
        return (f"wgm{self.block_m}n{self.block_n}s{self.stages}" + ("p" if self.pingpong else "")
                + ("" if self.overlap else "_serial") + ("_ss" if self.p_in_smem else "")
                + ("_al" if self.align else "") + ("_mf" if self.max_free else "")
                + (f"_c{self.cluster}" if self.cluster > 1 else "") + ("_persist" if self.persistent else ""))

    @property
    def consumers(self) -> int:
        return self.block_m // ROWS_PER_CONSUMER

    @property
    def ctas_per_sm(self) -> int:
        """Two CTAs of one consumer warpgroup share an SM (each one's prologue and epilogue under the other's
        GEMMs); more consumers take the SM's registers alone."""
        return 2 if self.consumers == 1 else 1

    @property
    def num_threads(self) -> int:
        return 128 * (1 + self.consumers)  # the TMA producer warpgroup first


# The tuner's axes (flash_gen.search.space), each a field of Sm90FwdConfig; sm90_infeasible_reason prunes them.
SM90_CONFIG_SPACE = {
    "block_n": (64, 80, 96, 112, 128, 144, 160, 176, 192),
    "stages": (2, 3, 4),
    "pingpong": (False, True),
    "block_m": (64, 128, 192),
    "persistent": (False, True),
    "overlap": (True, False),
    "p_in_smem": (False, True),
    "cluster": (1, 2),
    "align": (False, True),
    "max_free": (False, True),
}


# Head dims computed as a nearer multiple of 16 than the next multiple of 64, measured faster that way on the H200
# (2026-12-02, docs/benchmarks.md "Head dim 72 as 80"): 72 in 80's 16-column boxes runs 1.04-1.12x 72 as 128 at
# 2k-4k (at 1k 0.94-0.96x, before a cluster tiling took its s<=1k entry); 208 in 224's 32-column boxes 1.01-1.03x
# 208 as 256 (200 and 216 likewise). The same runs found 40 as 48, 88 as 96 and 144 as 160 slower in some cells
# than as 64, 128 and 192 (by up to 8%, 14% and 6%), so those keep the next multiple of 64.
NEARER_HEAD_DIMS = {72: 80, 200: 224, 208: 224, 216: 224}


def sm90_head_dim(key: FwdKey) -> int:
    """Head dim the kernel computes with: multiples of 32, and 16, 48 and 80, exactly, in TMA boxes of 64, 32 or
    16 columns (sm90_box_cols); 72 and 200-216 as NEARER_HEAD_DIMS says; any other the next multiple of 64. TMA
    zero-fills the columns past the tensor's. Measured on the H200 (docs/benchmarks.md "Exact head dims"):
    - exact 80, 96, 160 and 224 ran 0.98-1.2x an estimate of the next multiple of 64 from its time;
    - 112 and 144 in seven and nine 16-column boxes ran only 0.86-0.94x of it."""
    d = key.head_dim
    if d % 32 == 0 or d in (16, 48, 80):
        return d
    return NEARER_HEAD_DIMS.get(d, -(-d // 64) * 64)


def sm90_computed_key(key: FwdKey) -> FwdKey:
    """`key` at the head dim its Hopper forward kernel computes (sm90_head_dim). The kernel's code depends on that
    head dim alone (TMA zero-fills the columns past the tensors' on load and drops them on store), so this key's
    kernel serves `key`: 72 runs 80's, 112 runs 128's."""
    return replace(key, head_dim=sm90_head_dim(key))


def sm90_box_cols(head_dim: int) -> int:
    """Columns of a TMA box and of a shared-memory swizzle row for a computed head dim (sm90_head_dim): 64
    (128-byte swizzle) where they divide it, else 32 (64-byte) or 16 (32-byte). The kernel's kBoxCols."""
    return next(cols for cols in (64, 32, 16) if head_dim % cols == 0)


def packed_positions(cfg: Sm90FwdConfig, group: int) -> int:
    """Query positions per tile of the pack-GQA kernel: a consumer warpgroup's 64 rows hold 64 // group whole
    positions of the group's heads (a group of 7 fills 63 rows); 0 for groups over 64, which cannot pack."""
    return cfg.consumers * (ROWS_PER_CONSUMER // group)


def needs_extended_wgmma(key: FwdKey, cfg: Sm90FwdConfig) -> bool:
    """Whether the S GEMM's N (block_n) or the P V GEMM's (the computed head dim) needs CuTe's extended wgmma
    shapes to stay one instruction per k-step."""
    return cfg.block_n not in WGMMA_BASIC_N or sm90_head_dim(key) not in WGMMA_BASIC_N


def sm90_config_from_name(name: str) -> Sm90FwdConfig | None:
    """Inverse of Sm90FwdConfig.name ("wgm128n128s2p"), or None for a name of another kernel family."""
    m = re.fullmatch(r"wgm(\d+)n(\d+)s(\d+)(p?)(_serial)?(_ss)?(_al)?(_mf)?(?:_c(\d+))?(_persist)?", name)
    if m is None:
        return None
    return Sm90FwdConfig(int(m[2]), int(m[3]), bool(m[4]), int(m[1]), bool(m[10]), not m[5], bool(m[6]),
                         int(m[9] or 1), bool(m[7]), bool(m[8]))


STREAM_K_MIN_STEPS = 4  # key steps of a stream-K piece at least: each piece's partial costs its owner a merge
# Stream-K only where whole tiles would take this much longer by the round count: the gain measured a third to a
# half of that (H100, 2026-12-06: 1.06-1.20x where it predicts 1.14-1.6x; level where 1.02-1.03x).
STREAM_K_MIN_GAIN = 1.08


def sm90_stream_k(key: FwdKey, cfg: Sm90FwdConfig) -> bool:
    """Whether the Hopper kernel of `key` with `cfg` shares the key steps of a partial last round (stream-K, the
    kernel's kStreamK; the runtime's StreamKPlan says when): persistent CTAs without clusters on unmasked dense
    keys, where every tile takes the same key steps, without dropout. Not with softcap, ALiBi, packed heads or
    aligned rows either: their kernels spilled with it (8-56 bytes at head dims 64, 216 and 256, 2026-12-06)."""
    return (cfg.persistent and cfg.cluster == 1 and not cfg.align and key.mask == "none" and not key.dropout
            and not (key.softcap or key.alibi or key.pack_gqa) and not key.varlen and not key.split
            and key.kv == "dense")


@dataclass(frozen=True)
class StreamKPlan:
    """How a launch of a stream-K kernel (sm90_stream_k) shares its tiles (the kernel's sm90_work_of_round):
    `rounds` of whole tiles over `ctas` CTAs, then the `left` tiles' `steps` key steps each in chunks of `chunk`
    per CTA (0: the left tiles whole, as without stream-K)."""

    ctas: int
    rounds: int
    left: int
    steps: int
    chunk: int


def stream_k_plan(tiles: int, slots: int, steps: int, allow: bool = True) -> StreamKPlan:
    """The stream-K split of `tiles` query tiles of `steps` key steps over at most `slots` resident CTAs. Where the
    tiles do not fill whole rounds, the last round keeps some CTAs a whole tile while the others idle: stream-K
    gives each CTA ceil(left x steps / slots) of the left tiles' steps instead (at least STREAM_K_MIN_STEPS), where
    the round count says that pays (STREAM_K_MIN_GAIN): few rounds with a small remainder, as batch-1 prefills
    have; with fewer tiles than slots, all of them shared so (every slot launched). Else (or not `allow`) whole
    tiles, as many CTAs as there are tiles or slots."""
    left, rounds = tiles % slots, tiles // slots
    chunk = max(-(-left * steps // slots), STREAM_K_MIN_STEPS) if left and allow else 0
    if not chunk or chunk >= steps or (rounds + 1) < STREAM_K_MIN_GAIN * (rounds + chunk / steps):
        ctas = max(1, min(tiles, slots))
        return StreamKPlan(ctas, tiles // ctas, tiles % ctas, steps, 0)
    return StreamKPlan(slots, rounds, left, steps, chunk)


def _smem_limit(key: FwdKey, cfg: Sm90FwdConfig) -> int:
    """Shared memory one CTA may take: the per-block maximum, or its share of the SM."""
    return min(MAX_SMEM_PER_BLOCK[key.arch], SMEM_PER_SM[key.arch] // cfg.ctas_per_sm - SMEM_RESERVED_PER_CTA)


def _smem_bytes(key: FwdKey, cfg: Sm90FwdConfig, o_in_v: bool) -> int:
    rows = cfg.block_m * (2 if cfg.persistent and not o_in_v else 1) + 2 * cfg.stages * cfg.block_n
    p_tile = 2 * cfg.block_m * cfg.block_n if cfg.p_in_smem else 0
    tile_slot = TILE_SLOT_BYTES if cfg.persistent else 0
    barriers = 2 + 4 * cfg.stages + (key.kv == "cache") + 2 * o_in_v
    return 2 * sm90_head_dim(key) * rows + p_tile + BARRIER_BYTES * barriers + tile_slot


def sm90_o_in_v(key: FwdKey, cfg: Sm90FwdConfig) -> bool:
    """Whether persistent CTAs stage O in the V ring (the kernel's kOInV): where an O buffer of its own does not
    fit beside Q and the K/V ring (head dim 256) and the ring holds O. The next tile's first V load then waits for
    the O stores. Not in clusters, whose peers multicast V into the ring."""
    return (cfg.persistent and cfg.cluster == 1 and cfg.stages * cfg.block_n >= cfg.block_m
            and _smem_bytes(key, cfg, o_in_v=False) > _smem_limit(key, cfg))


def sm90_smem_bytes(key: FwdKey, cfg: Sm90FwdConfig) -> int:
    """Q plus `stages` K and V tiles (2-byte elements), an O staging tile in persistent CTAs where it fits
    (elsewhere O leaves through the V ring, sm90_o_in_v, or with one tile per CTA through Q's buffer), P (block_m x
    block_n) where the P V GEMM reads it from shared memory, then the mbarriers: Q full and empty, K/V full and
    empty per stage, KV-cache keys one more (the last V tile's stale rows zeroed), O in the V ring two (its stores
    done, by round parity); persistent CTAs end with the slot through which the producer hands each tile to the
    consumers."""
    return _smem_bytes(key, cfg, sm90_o_in_v(key, cfg))


def sm90_infeasible_reason(key: FwdKey, cfg: Sm90FwdConfig) -> str | None:
    """Why the Hopper kernel cannot run `key` with `cfg` (None when it can)."""
    if key.arch != "sm90":
        return f"wgmma kernels are built for sm90, not {key.arch}"
    if key.kv == "paged":
        return "pages of any size: each row found through the block table (the portable kernel)"
    if key.kv == "cache":
        if cfg.persistent or cfg.cluster > 1:
            return "KV-cache tiles run one CTA each, without clusters (the last V tile's stale rows zeroed once)"
        if 128 % cfg.block_n:
            return f"block_n {cfg.block_n} must divide 128: a key tile lies in one page of a multiple of 128 rows"
    if key.split and (cfg.persistent or cfg.cluster > 1):
        return "split-KV runs one CTA per (query tile, split), without clusters"
    if key.varlen and cfg.persistent:
        return "varlen runs one CTA per tile (each CTA finds its tile with a warp-collective scan)"
    if key.head_dim % 8 or key.head_dim > 256:
        return f"head_dim {key.head_dim} is not a multiple of 8 up to 256 (16-byte TMA strides)"
    if cfg.block_n % 16 or not 16 <= cfg.block_n <= 256:
        return f"block_n {cfg.block_n} must be a multiple of 16 in [16, 256] (the wgmma N)"
    if cfg.stages < 2:
        # The consumers release V_{j-1} only after waiting for K_{j+1} (the P V wait sits after the next K wait),
        # while the producer loads V_j before K_{j+1}: with one buffer each they would wait on each other.
        return "stages must be at least 2"
    if cfg.block_m not in (64, 128, 192):
        return f"block_m {cfg.block_m} must be 64, 128 or 192 (one to three consumer warpgroups of 64 rows)"
    if cfg.pingpong and cfg.consumers == 1:
        return "ping-pong needs two or more consumer warpgroups"
    if cfg.cluster not in (1, 2):
        return f"cluster {cfg.cluster} must be 1 or 2"
    if cfg.cluster > 1 and (key.mask != "none" or key.varlen):
        return "a cluster's CTAs share K/V tiles, so every tile must see the same keys: unmasked dense batches only"
    if cfg.align and (key.split or key.kv != "dense"):
        return "aligned rows shift the columns of dense K/V only (split partials index them, caches have pages)"
    if cfg.align and sm90_head_dim(key) - key.head_dim < 8:
        return f"aligned rows need 8 padding columns: head dim {key.head_dim} computes as {sm90_head_dim(key)}"
    if cfg.max_free and not cfg.overlap:
        return "max-free steps are the overlapped ones (serial steps release K before their softmax)"
    if cfg.max_free and sm90_head_dim(key) > 128:
        # NVRTC 13.0, 2026-12-06: 12-56 B at head dim 256 (the O accumulator alone takes 128 of the 240 registers)
        return "max-free steps spill at head dims above 128"
    if cfg.max_free and cfg.consumers == 3 and (key.softcap or key.alibi or key.dropout):
        # 150-588 B at head dims 64 and 128: the repair applies the score modifiers a second time
        return "max-free steps spill with three consumer warpgroups and softcap, ALiBi or dropout"
    regs = (cfg.block_n // 2 + cfg.block_n // 4 + sm90_head_dim(key) // 2)  # 64 rows over 128 threads: S, P, O
    budget = CONSUMER_REGISTERS[cfg.consumers] - ADDRESSING_REGISTERS
    if regs > budget:
        return f"{regs} tile registers per consumer thread (S, P, O) exceed {budget} with {cfg.consumers} consumers"
    smem = sm90_smem_bytes(key, cfg)
    limit = _smem_limit(key, cfg)
    if smem > limit:
        return f"shared memory {smem} B exceeds the {key.arch} limit of {limit} B for {cfg.ctas_per_sm} CTA(s) per SM"
    return None


def aligned_if_misaligned(key: FwdKey, cfg: Sm90FwdConfig) -> Sm90FwdConfig:
    """`cfg` with aligned rows ("_al") where `key`'s odd heads start mid-sector (head dims 8 mod 16: 2-byte rows of
    16 bytes past a multiple of 32) and the key can take them, else `cfg`. The same tiling aligned ran, against
    itself unaligned, about 1.02x at 120 (0.94-1.06x over two runs), 1.01-1.05x at 56, 1.10-1.18x at 88 and 248,
    1.30-1.41x at 200 and 216 and 1.11-1.30x at 72 (H100, 2026-12-05, docs/benchmarks.md "Aligned rows at the
    other head dims" and "Aligned rows at head dim 72")."""
    if cfg.align or key.head_dim % 16 != 8:
        return cfg
    aligned = replace(cfg, align=True)
    return aligned if sm90_infeasible_reason(key, aligned) is None else cfg


def _packed_192_rows(key: FwdKey, head_dim: int) -> bool:
    """Where a packed batch's forward measured faster with 192 x 80 tiles (the keys it was measured on)."""
    return (key.varlen and key.kv == "dense" and not key.split and head_dim == 128 and key.mask in ("none", "causal")
            and not (key.softcap or key.alibi))


def default_sm90_config(key: FwdKey) -> Sm90FwdConfig | None:
    """The Hopper kernel's tiling for `key`, or None where it does not support the key. From the H200 sweeps of
    2026-11-30 (docs/benchmarks.md): 128-key steps up to head dim 128, 64 above (80 and 144-176 keys level to 11%
    slower, measured again with single wgmmas per k-step); at head dim 64 three consumer
    warpgroups (192 rows: 2-10% over 128 rows); at 128 persistent CTAs (O staged apart from Q, tiles snaking
    longest first: 2-7% over one CTA per tile); at 64 no persistent CTAs (spills); above 128, where no mask bounds
    the keys, persistent CTAs with 80-key steps (at 256 O staged in the V ring: 2-7% over one CTA per tile at
    2k-16k, H200, 2026-12-02 17:14 UTC, docs/benchmarks.md "O in the V ring"), else one CTA per tile (at 256
    causal, persistent ran 553 against 705 TFLOP/s at 16k before its tiles were ordered in zigzag sections, and is
    level there since: the tuning database picks per bucket). Ping-pong only where it measured ahead: the three
    warpgroups of head dim 64. Head dim 80 (computed exactly) takes head dim 64's with 112-key steps, which fit its
    registers: 1.03x and 1.11x the 128-row persistent tiling at 2k and 4k non-causal, 0.90x at 1k, where the tuning database picks
    other tilings (H200, 2026-12-01 22:54 UTC, docs/benchmarks.md "Exact head dims"). Other computed head dims take
    the tiling of the next multiple of 64 (96: 128's); head dims 8 mod 16 its aligned form (aligned_if_misaligned).
    Packed (varlen) batches and split-KV and KV caches take the same tiling with one CTA per tile (KV caches with
    key steps that divide 128), except packed batches at head dim 128 without softcap or ALiBi, none or
    causal: 192 x 80 tiles in three stages, forward 1.05x / 1.04x the 128 x 128 tiling (H200, 2026-12-03 20:50 UTC,
    docs/benchmarks.md "Current: 192 x 80 tiles for the packed forward")."""
    head_dim = sm90_head_dim(key)
    if head_dim <= 64:
        cfg = Sm90FwdConfig(128, 2, pingpong=True, block_m=192)
    elif head_dim == 80:
        cfg = Sm90FwdConfig(112, 2, pingpong=True, block_m=192)
    elif head_dim <= 128:
        cfg = Sm90FwdConfig(128, 2, pingpong=False, persistent=True)
    elif key.mask == "none":
        cfg = Sm90FwdConfig(80, 2, pingpong=False, persistent=True)
    else:
        cfg = Sm90FwdConfig(64, 2, pingpong=False)
    if key.varlen or key.split or key.kv == "cache":
        cfg = replace(cfg, persistent=False)
    if _packed_192_rows(key, head_dim):
        cfg = Sm90FwdConfig(80, 3, pingpong=False, block_m=192)
    if key.kv == "cache" and 128 % cfg.block_n:
        cfg = replace(cfg, block_n=64)  # a key tile lies in one page (pages of a multiple of 128 rows)
    return aligned_if_misaligned(key, cfg) if sm90_infeasible_reason(key, cfg) is None else None
