"""Kernel identities: what a compiled attention variant *is* (its key) and how it is tiled (its config).

A `FwdKey` names everything that changes the kernel's semantics (arch, dtype, head dim, mask, features);
a `FwdConfig` names the tunable knobs that change only its speed. Both are frozen dataclasses of plain
scalars, so they hash cheaply (the loader's per-call lookup is one dict hit) and their `.name` is a stable,
readable C identifier and file name that encodes every field.

This module is the root of the dependency order: it must not import torch, cuda or anything in flash_gen.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Iterator

ARCHS = ("sm80", "sm90", "sm100")
DTYPES = ("fp16", "bf16")
MASKS = ("none", "causal", "local")
KV_LAYOUTS = ("dense", "cache", "paged")
# Boolean FwdKey fields, in name order, with their name tokens.
_FEATURES = {"softcap": "softcap", "alibi": "alibi", "varlen": "varlen", "split": "split", "pack_gqa": "packgqa",
             "dropout": "dropout"}
HEAD_DIMS = tuple(range(8, 257, 8))

# Per-arch limits used to prune configs before compiling (dynamic shared memory per block, in bytes).
MAX_SMEM_PER_BLOCK = {"sm80": 163 * 1024, "sm90": 227 * 1024, "sm100": 227 * 1024}
# Shared memory per SM, and what the hardware reserves per resident CTA: how many CTAs of a kernel fit at once.
SMEM_PER_SM = {"sm80": 164 * 1024, "sm90": 228 * 1024, "sm100": 228 * 1024}
SMEM_RESERVED_PER_CTA = 1024
# Budget for the accumulators a thread holds (fp32 registers); above it ptxas spills. 255 is the hardware cap;
# the rest of the kernel (pointers, indices, softmax state, fragments of Q/K/V) needs the remainder.
MAX_ACCUM_REGS = 192


# Sequence-length buckets the tuner tunes separately (flash_gen.search.space gives each its shapes) and the
# runtime looks tuned configs up by: (name, largest seqlen_k served; 0 = no limit).
BUCKETS = {
    "fwd": (("s<=1k", 1024), ("s<=4k", 4096), ("s>4k", 0)),
    "bwd": (("s<=1k", 1024), ("s<=4k", 4096), ("s>4k", 0)),
    "decode": (("cache<=8k", 8192), ("cache>8k", 0)),
}


def bucket_name(direction: str, seqlen_k: int) -> str:
    """The bucket serving calls with this key length."""
    for name, limit in BUCKETS[direction]:
        if limit == 0 or seqlen_k <= limit:
            return name
    return BUCKETS[direction][-1][0]


def dropout_keep_threshold(dropout_p: float) -> int:
    """Kernels keep a score when its 16 random bits (templates/include/flash_gen/philox.cuh) are below this:
    round((1 - dropout_p) * 2^16), so the keep probability is (1 - dropout_p) to within 2^-17."""
    return min(1 << 16, round((1.0 - dropout_p) * (1 << 16)))


def mma_head_dim(head_dim: int) -> int:
    """Head dim as the MMA sees it: the k-step of mma.sync m16n8k16 is 16, so a head dim of 72 computes as 80
    with zero-filled columns (loads and stores touch exactly `head_dim` columns)."""
    return (head_dim + 15) // 16 * 16


@dataclass(frozen=True)
class FwdKey:
    """Semantics of a forward kernel. Changing any field changes the generated code."""

    arch: str  # compile target: sm80 | sm90 | sm100 (the portable family runs mma.sync on all three)
    dtype: str  # fp16 | bf16
    head_dim: int  # multiple of 8 in [8, 256]
    mask: str = "none"  # none | causal | local (sliding window; causal is local(-1, 0) specialised)
    softcap: bool = False
    alibi: bool = False
    varlen: bool = False  # packed ragged batch: rows found through cu_seqlens (flash_attn_varlen_func)
    # Where K/V rows live: "dense" tensors; a "cache" read tile by tile (contiguous, or pages that hold whole key
    # tiles), with per-entry used length, left padding and batch index (flash_attn_with_kvcache); "paged": any
    # page size, each row found through the block table. With varlen: a paged cache whose entries' lengths come
    # from cu_seqlens_k (flash_attn_varlen_func with block_table).
    kv: str = "dense"
    # Split-KV: each CTA covers a share of the keys and writes fp32 partials to combine; for KV caches and for
    # dense batches with few query tiles (the runtime splits them where runtime.fwd._split_plan says so).
    split: bool = False
    # GQA/MQA: one CTA serves all query heads of a KV head, their rows stacked along the query tile, so each K/V
    # tile is read once per group instead of once per query head (decoding reads little else) and few query rows
    # still fill a tile (the runtime packs dense calls where that needs fewer tiles: fwd_tilings.pack_gqa_pays).
    pack_gqa: bool = False
    # Attention dropout (flash_attn's dropout_p): kept probabilities scaled by 1/(1 - p), the keep decisions drawn
    # per score from the call's seed (templates/include/flash_gen/philox.cuh). Training calls only: dense K/V, one
    # head per tile row.
    dropout: bool = False

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be a multiple of 8 in [8, 256], got {self.head_dim!r}")
        if self.mask not in MASKS:
            raise ValueError(f"mask must be one of {MASKS}, got {self.mask!r}")
        if self.kv not in KV_LAYOUTS:
            raise ValueError(f"kv must be one of {KV_LAYOUTS}, got {self.kv!r}")
        if self.split and self.varlen:
            raise ValueError("split-KV is built for dense query batches only")
        if self.pack_gqa and self.varlen:
            raise ValueError("pack_gqa stacks the heads of dense query batches, not packed ragged ones")
        if self.pack_gqa and self.alibi:
            raise ValueError("pack_gqa stacks several heads in one tile; ALiBi's per-head slopes need one head")
        if self.dropout and (self.kv != "dense" or self.pack_gqa):
            raise ValueError("dropout is built for dense K/V with one query head per tile row")

    @property
    def name(self) -> str:
        feats = "".join(f"_{token}" for f, token in _FEATURES.items() if getattr(self, f))
        feats += "" if self.kv == "dense" else f"_kv{self.kv}"
        return f"fwd_{self.arch}_{self.dtype}_hd{self.head_dim}_{self.mask}{feats}"


@dataclass(frozen=True)
class FwdConfig:
    """Tunable tiling of the portable (mma.sync + cp.async) forward kernel."""

    block_m: int = 128  # query rows per CTA
    block_n: int = 64  # key rows per main-loop step
    num_warps: int = 4  # warps split block_m; each warp owns whole rows of S, so softmax is warp-local
    kv_stages: int = 1  # K/V smem buffers: 1 = FA2's interleave (V[j] loads under QK^T, K[j+1] under PV);
    # 2 = double buffer, K[j+1] and V[j+1] both in flight during step j
    q_in_regs: bool = False  # keep Q's MMA fragments in registers for the whole loop (no per-step ldmatrix)
    late_v_wait: bool = False  # kv_stages=1 only: wait for V (and start loading the next K) after the softmax
    # instead of right after QK^T. The next K load then no longer overlaps the softmax, but ptxas cannot hoist V's
    # ldmatrix into the softmax either, which keeps big tiles (128x64 at hd 128) from spilling.

    @property
    def name(self) -> str:
        return (
            f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.kv_stages}"
            f"{'_qreg' if self.q_in_regs else ''}{'_vlate' if self.late_v_wait else ''}"
        )

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps


# The axes the tuner searches; `enumerate_configs` and `infeasible_reason` bound them.
CONFIG_SPACE = {
    "block_m": (64, 128),
    "block_n": (32, 64, 128),
    "num_warps": (4, 8),
    "kv_stages": (1, 2),
    "q_in_regs": (False, True),
    "late_v_wait": (False, True),
}


def smem_bytes(key: FwdKey, cfg: FwdConfig) -> int:
    """Dynamic shared memory the kernel asks for: Q tile + kv_stages x (K tile + V tile); the epilogue
    reuses Q's buffer for O."""
    elem = 2
    d = mma_head_dim(key.head_dim)
    return elem * d * (cfg.block_m + 2 * cfg.kv_stages * cfg.block_n)


def ctas_per_sm(key: FwdKey, cfg: FwdConfig) -> int:
    """Resident CTAs per SM as shared memory allows (the register file allows at least as many for these
    tilings: 128-256 threads at <= 255 registers)."""
    return max(1, SMEM_PER_SM[key.arch] // (smem_bytes(key, cfg) + SMEM_RESERVED_PER_CTA))


def accum_regs(key: FwdKey, cfg: FwdConfig) -> int:
    """fp32 registers per thread for the O and S accumulators (plus Q fragments when held in registers)."""
    d = mma_head_dim(key.head_dim)
    t = cfg.num_threads
    regs = cfg.block_m * d // t + cfg.block_m * cfg.block_n // t
    if cfg.q_in_regs:
        regs += cfg.block_m * d // (2 * t)  # Q fragments: two 16-bit values per register
    return regs


def infeasible_reason(key: FwdKey, cfg: FwdConfig) -> str | None:
    """Why `cfg` cannot be compiled for `key` (None when it can). Checked before NVRTC ever runs."""
    rows_per_warp_step = 16 * cfg.num_warps
    if cfg.block_m % rows_per_warp_step:
        return f"block_m={cfg.block_m} is not a multiple of 16*num_warps={rows_per_warp_step}"
    if cfg.block_n % 16:
        return f"block_n={cfg.block_n} is not a multiple of 16 (the MMA k-step of P@V)"
    if cfg.late_v_wait and cfg.kv_stages != 1:
        return "late_v_wait only applies to kv_stages=1 (with a ring, K and V of a step arrive together)"
    # 16-byte global<->smem copies: a pass of all threads covers num_threads / (atom_cols / 8) rows, where the
    # smem swizzle atom is 64, 32 or 16 columns wide (as wide as the padded head dim allows).
    d = mma_head_dim(key.head_dim)
    atom_cols = 64 if d % 64 == 0 else (32 if d % 32 == 0 else 16)
    rows_per_pass = cfg.num_threads // (atom_cols // 8)
    for name, rows in (("block_m", cfg.block_m), ("block_n", cfg.block_n)):
        if rows % rows_per_pass:
            return f"{name}={rows} is not a multiple of the {rows_per_pass} rows one copy pass covers"
    smem = smem_bytes(key, cfg)
    limit = MAX_SMEM_PER_BLOCK[key.arch]
    if smem > limit:
        return f"shared memory {smem} B exceeds the {key.arch} limit of {limit} B"
    regs = accum_regs(key, cfg)
    if regs > MAX_ACCUM_REGS:
        return f"{regs} accumulator registers per thread exceed the budget of {MAX_ACCUM_REGS}"
    return None


def default_config(key: FwdKey) -> FwdConfig:
    """The head of default_configs: the tiling the tuner's database entries are measured against."""
    return default_configs(key)[0]


def default_configs(key: FwdKey) -> tuple[FwdConfig, ...]:
    """Hand-picked starting points, fastest first: the feasible ones of a short preference list per head-dim
    class, from the config sweep on an H200 (docs/benchmarks.md). The runtime runs the first that compiles without
    spills (flash_gen.build.spill_free); the tuner's database overrides them.

    Reasons, per class (sm_90a ptxas reports and timings unless said otherwise):
    - hd <= 80: 128x64, 4 warps. 128x128 spills at 255 registers and is 3-8% slower.
    - hd 96-128: on sm90, FA2's 128x64 tile with the V wait after the softmax (`late_v_wait`: without it the
      tile spills); 3-10% faster than the 32-key step below. Elsewhere a 32-key step keeps acc_o (128 fp32
      registers) plus acc_s under the cap, with two K/V stages where registers allow; masked kernels spill with
      two stages, and on sm80/sm100 ptxas spilled 4-8 bytes even with one, so those (and head dims whose 16-byte
      copy passes cover 64 rows, e.g. 112) take 64x64 tiles.
    - hd > 128: 8 warps split the rows and two K/V stages hide the loads (196 KB of smem at hd 256, so sm80
      falls back to one stage).
    """
    d = mma_head_dim(key.head_dim)
    if key.kv != "dense":
        # Decoding: a handful of query rows per CTA, so the MMAs idle and the kernel is bound by K/V bytes: the
        # smallest query tile and a two-stage ring, with 64-key tiles so two CTAs fit per SM (H200, GQA 32/8,
        # hdim 128: 89-99% of the copy ceiling against 64-95% with 128-key tiles; docs/benchmarks.md).
        prefs = [FwdConfig(64, 64, 4, 2), FwdConfig(64, 64, 4, 1), FwdConfig(64, 32, 4, 1)]
    elif d <= 80:
        prefs = [FwdConfig(128, 64, 4, 1), FwdConfig(64, 64, 4, 1)]
    elif d <= 128:
        prefs = [FwdConfig(128, 64, 4, 1, late_v_wait=True)] if key.arch == "sm90" else []
        prefs += [FwdConfig(128, 32, 4, 2)] if key.mask == "none" else []
        prefs += [FwdConfig(64, 64, 4, 1)]
    else:
        prefs = [FwdConfig(128, 64, 8, 2), FwdConfig(128, 64, 8, 1), FwdConfig(64, 64, 4, 2), FwdConfig(64, 64, 4, 1),
                 FwdConfig(64, 32, 4, 1)]
    feasible = tuple(cfg for cfg in prefs if infeasible_reason(key, cfg) is None)
    if not feasible:
        raise AssertionError(f"no default config fits {key.name}")  # spec tests cover every key
    return feasible


def enumerate_keys(
    archs: tuple[str, ...] = ARCHS,
    dtypes: tuple[str, ...] = DTYPES,
    head_dims: tuple[int, ...] = HEAD_DIMS,
    masks: tuple[str, ...] = MASKS,
    varlen: tuple[bool, ...] = (False, True),
) -> Iterator[FwdKey]:
    """The forward key space: every (arch, dtype, head dim, mask, softcap, alibi, varlen, dropout) combination."""
    layouts = [(packed, kv, False, False) for packed in varlen for kv in KV_LAYOUTS] + [
        (False, kv, True, pack) for kv in KV_LAYOUTS for pack in (False, True)
    ] + [(False, kv, False, True) for kv in KV_LAYOUTS]
    for arch, dtype, hd, mask in itertools.product(archs, dtypes, head_dims, masks):
        for softcap, alibi, (packed, kv, split, pack) in itertools.product((False, True), (False, True), layouts):
            if not (alibi and pack):
                yield FwdKey(arch, dtype, hd, mask, softcap, alibi, packed, kv, split, pack)
            if kv == "dense" and not pack:
                yield FwdKey(arch, dtype, hd, mask, softcap, alibi, packed, kv, split, pack, dropout=True)


def enumerate_configs(key: FwdKey) -> Iterator[FwdConfig]:
    """Every feasible config in CONFIG_SPACE for `key`."""
    names = list(CONFIG_SPACE)

    def rec(i: int, chosen: dict) -> Iterator[FwdConfig]:
        if i == len(names):
            cfg = FwdConfig(**chosen)
            if infeasible_reason(key, cfg) is None:
                yield cfg
            return
        for v in CONFIG_SPACE[names[i]]:
            yield from rec(i + 1, {**chosen, names[i]: v})

    yield from rec(0, {})


def key_from_name(name: str) -> FwdKey:
    """Inverse of FwdKey.name."""
    parts = name.split("_")
    if len(parts) < 5 or parts[0] != "fwd" or not parts[3].startswith("hd"):
        raise ValueError(f"not a forward kernel key name: {name!r}")
    feats = set(parts[5:])
    kvs = {f for f in feats if f[2:] in KV_LAYOUTS[1:] and f.startswith("kv")}
    unknown = feats - set(_FEATURES.values()) - kvs
    if unknown or len(kvs) > 1:
        raise ValueError(f"unknown feature(s) {sorted(unknown or kvs)} in key name {name!r}")
    kv = kvs.pop()[2:] if kvs else "dense"
    flags = {f: token in feats for f, token in _FEATURES.items()}
    return FwdKey(parts[1], parts[2], int(parts[3][2:]), parts[4], **flags, kv=kv)


def config_from_name(name: str) -> FwdConfig:
    """Inverse of FwdConfig.name, e.g. "m128n64w4s2_qreg" or "m128n64w4s1_vlate"."""
    m = re.fullmatch(r"m(\d+)n(\d+)w(\d+)s(\d+)(_qreg)?(_vlate)?", name)
    if m is None:
        raise ValueError(f"not a forward config name (like m128n64w4s1, m128n64w4s2_qreg, m128n64w4s1_vlate): {name!r}")
    return FwdConfig(int(m[1]), int(m[2]), int(m[3]), int(m[4]), bool(m[5]), bool(m[6]))
