"""Backward kernel identities: the key (semantics) and config (tiling) of the portable backward kernel.

Mirrors flash_gen.spec for the forward: frozen dataclasses of plain scalars with stable, readable names, a
feasibility model checked before NVRTC runs, and hand-picked defaults. Must not import torch or cuda.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Iterator

from flash_gen.spec import (
    ARCHS,
    DTYPES,
    HEAD_DIMS,
    MASKS,
    MAX_ACCUM_REGS,
    MAX_SMEM_PER_BLOCK,
    FwdKey,
    enumerate_keys,
    key_from_name,
)


@dataclass(frozen=True)
class BwdKey:
    """Semantics of a backward kernel: the forward's key plus whether dQ accumulates in a fixed order."""

    arch: str
    dtype: str
    head_dim: int
    mask: str = "none"
    softcap: bool = False
    alibi: bool = False
    varlen: bool = False
    deterministic: bool = False
    dropout: bool = False  # the forward's dropout, redrawn from its seed

    def __post_init__(self) -> None:
        self.fwd  # validates the shared fields

    @property
    def fwd(self) -> FwdKey:
        """The forward key with the same semantics (whose lse the backward consumes)."""
        return FwdKey(self.arch, self.dtype, self.head_dim, self.mask, self.softcap, self.alibi, self.varlen,
                      dropout=self.dropout)

    @property
    def name(self) -> str:
        return "bwd" + self.fwd.name[3:] + ("_det" if self.deterministic else "")


@dataclass(frozen=True)
class BwdConfig:
    """Tiling of the portable backward kernel. Each of its three GEMM shapes splits over the warps its own way
    (FA2's AtomLayoutMSdP / AtomLayoutNdKV / AtomLayoutMdQ)."""

    block_m: int = 64  # query rows per inner-loop step
    block_n: int = 128  # key rows per CTA (dK/dV accumulate in registers for these)
    num_warps: int = 8
    warps_m_sdp: int = 2  # warps along block_m for S = QK^T and dP = dO V^T (the rest split block_n)
    warps_n_dkv: int = 4  # warps along block_n for dK and dV (the rest split the head dim)
    warps_m_dq: int = 2  # warps along block_m for dQ (the rest split the head dim)
    stages: int = 2  # Q/dO smem buffers: 2 loads the next query tile while this one computes

    @property
    def name(self) -> str:
        return (
            f"m{self.block_m}n{self.block_n}w{self.num_warps}"
            f"a{self.warps_m_sdp}{self.warps_n_dkv}{self.warps_m_dq}s{self.stages}"
        )

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps


BWD_CONFIG_SPACE = {
    "block_m": (32, 64, 128),
    "block_n": (64, 128),
    "num_warps": (4, 8),
    "warps_m_sdp": (1, 2, 4),
    "warps_n_dkv": (1, 2, 4, 8),
    "warps_m_dq": (1, 2, 4, 8),
    "stages": (1, 2),
}


def bwd_head_dim_mma(key: BwdKey, cfg: BwdConfig) -> int:
    """Head dim the MMAs compute: a multiple of 16 per warp that splits it in the dK/dV and dQ GEMMs (loads
    zero-fill the padding; stores skip it)."""
    step = 16 * max(cfg.num_warps // cfg.warps_n_dkv, cfg.num_warps // cfg.warps_m_dq)
    return -(-key.head_dim // step) * step


def bwd_smem_bytes(key: BwdKey, cfg: BwdConfig) -> int:
    """Q and dO (stages buffers each), K and V, P and dS tiles, 2-byte elements."""
    d = bwd_head_dim_mma(key, cfg)
    return 2 * (2 * cfg.stages * cfg.block_m * d + 2 * cfg.block_n * d + 2 * cfg.block_m * cfg.block_n)


def bwd_accum_regs(key: BwdKey, cfg: BwdConfig) -> int:
    """fp32 accumulator registers per thread at the peak: dK and dV for the whole loop, plus S and dP or dQ,
    whichever is larger, plus the tanh derivative under softcap (counted in full: with it on top ptxas spilled
    at hd 256 where the S/dP/dQ count alone fitted)."""
    d, t = bwd_head_dim_mma(key, cfg), cfg.num_threads
    tile = cfg.block_m * cfg.block_n // t
    return 2 * cfg.block_n * d // t + max(2 * tile, cfg.block_m * d // t) + (tile if key.softcap else 0)


def bwd_infeasible_reason(key: BwdKey, cfg: BwdConfig) -> str | None:
    """Why `cfg` cannot be compiled for `key` (None when it can)."""
    w = cfg.num_warps
    for name in ("warps_m_sdp", "warps_n_dkv", "warps_m_dq"):
        if w % getattr(cfg, name):
            return f"{name}={getattr(cfg, name)} does not divide num_warps={w}"
    checks = (
        ("block_m", cfg.block_m, 16 * cfg.warps_m_sdp, "16*warps_m_sdp"),
        ("block_n", cfg.block_n, 16 * (w // cfg.warps_m_sdp), "16*(num_warps/warps_m_sdp)"),
        ("block_n", cfg.block_n, 16 * cfg.warps_n_dkv, "16*warps_n_dkv"),
        ("block_m", cfg.block_m, 16 * cfg.warps_m_dq, "16*warps_m_dq"),
    )
    for name, value, step, what in checks:
        if value % step:
            return f"{name}={value} is not a multiple of {what}={step}"
    d = bwd_head_dim_mma(key, cfg)
    atom_cols = 64 if d % 64 == 0 else (32 if d % 32 == 0 else 16)
    rows_per_pass = cfg.num_threads // (atom_cols // 8)
    for name, rows in (("block_m", cfg.block_m), ("block_n", cfg.block_n)):
        if rows % rows_per_pass:
            return f"{name}={rows} is not a multiple of the {rows_per_pass} rows one copy pass covers"
    smem = bwd_smem_bytes(key, cfg)
    if smem > MAX_SMEM_PER_BLOCK[key.arch]:
        return f"shared memory {smem} B exceeds the {key.arch} limit of {MAX_SMEM_PER_BLOCK[key.arch]} B"
    regs = bwd_accum_regs(key, cfg)
    if regs > MAX_ACCUM_REGS:
        return f"{regs} accumulator registers per thread exceed the budget of {MAX_ACCUM_REGS}"
    return None


# Starting points with the largest head dim each is tried at, fastest first where measured (fwd+bwd on the H200,
# docs/benchmarks.md, "Backward tilings" and "No default spills"). A key's chain (bwd_fallbacks) is the feasible
# ones, least head-dim padding first; the runtime runs the first that compiles without spills
# (flash_gen.build.spill_free), so the later ones are what sm80/sm100 (or a heavy feature set) fall back to.
_BWD_PREFS = (
    (BwdConfig(128, 128, 8, 2, 4, 4, 2), 256),  # hd <= 64: 8% faster than 64x128 (spills on sm80 and sm100)
    (BwdConfig(64, 128, 8, 2, 4, 4, 2), 64),  # a244: the fastest 64x128 at hd 64, 4-5% over a422
    # hd <= 128: S/dP split 4 x 2 over the warps, dK/dV 2 x 4. With FA2's 2 x 4 / 4 x 2 (a242) ptxas spilled
    # 48-52 B on sm80/sm100 and 36-40 B on sm90 at hd 128; this one spills none on sm80 without deterministic dQ
    # or a packed batch (4-12 B on sm90, NVRTC 13.0) for 2.5% less fwd+bwd on the H200.
    (BwdConfig(64, 128, 8, 4, 2, 2, 2), 256),
    (BwdConfig(64, 64, 8, 4, 2, 2, 2), 256),  # hd <= 256
    (BwdConfig(64, 64, 8, 4, 2, 2, 1), 256),
    (BwdConfig(64, 64, 8, 2, 2, 4, 1), 256),  # a224s1: hd 256 where a422s1 spills; 4% below it, 4% above 32x64
    (BwdConfig(64, 64, 4, 2, 4, 4, 1), 256),  # no head-dim split: no padding beyond 16
    (BwdConfig(64, 128, 8, 2, 4, 4, 1), 96),  # hd 96 + softcap: 1-4% over the 4-warp one, which spills there
    (BwdConfig(64, 64, 4, 4, 4, 4, 2), 256),  # a444s2: the 4-warp one's speed at hd 96, spill-free where it spills
    (BwdConfig(32, 64, 8, 2, 2, 2, 2), 256),  # softcap at hd > 128
)


def bwd_fallbacks(key: BwdKey) -> tuple[BwdConfig, ...]:
    """The feasible starting points for `key`, least head-dim padding first, then in _BWD_PREFS order."""
    feasible = [c for c, max_hd in _BWD_PREFS if key.head_dim <= max_hd and bwd_infeasible_reason(key, c) is None]
    if not feasible:
        raise AssertionError(f"no default backward config fits {key.name}")  # spec tests cover every key
    return tuple(sorted(feasible, key=lambda c: bwd_head_dim_mma(key, c)))  # stable: ties keep their order


def default_bwd_config(key: BwdKey) -> BwdConfig:
    return bwd_fallbacks(key)[0]


def enumerate_bwd_keys(
    archs: tuple[str, ...] = ARCHS,
    dtypes: tuple[str, ...] = DTYPES,
    head_dims: tuple[int, ...] = HEAD_DIMS,
    masks: tuple[str, ...] = MASKS,
    varlen: tuple[bool, ...] = (False, True),
    deterministic: tuple[bool, ...] = (False, True),
) -> Iterator[BwdKey]:
    """The backward key space: every forward key, in either dQ order."""
    for fwd in enumerate_keys(archs, dtypes, head_dims, masks, varlen):
        if fwd.kv != "dense" or fwd.pack_gqa or fwd.split:  # KV caches serve inference; pack-GQA and split-KV are
            # the forward's choices for few query tiles
            continue
        fields = {f.name: getattr(fwd, f.name) for f in dataclasses.fields(BwdKey) if hasattr(fwd, f.name)}
        for det in deterministic:
            yield BwdKey(**{**fields, "deterministic": det})


def bwd_config_from_name(name: str) -> BwdConfig:
    """Inverse of BwdConfig.name, e.g. "m64n128w8a242s2"."""
    m = re.fullmatch(r"m(\d+)n(\d+)w(\d+)a(\d)(\d)(\d)s(\d+)", name)
    if m is None:
        raise ValueError(f"not a backward config name (like m64n128w8a242s2): {name!r}")
    return BwdConfig(*(int(g) for g in m.groups()))


def bwd_key_from_name(name: str) -> BwdKey:
    """Inverse of BwdKey.name, e.g. "bwd_sm90_bf16_hd128_causal_varlen_det"."""
    if not name.startswith("bwd_"):
        raise ValueError(f"not a backward kernel key name: {name!r}")
    deterministic = name.endswith("_det")
    fwd = key_from_name("fwd" + name[3 : -len("_det")] if deterministic else "fwd" + name[3:])
    if fwd.kv != "dense" or fwd.split or fwd.pack_gqa:
        raise ValueError(f"backward keys have no KV-cache features: {name!r}")
    return BwdKey(fwd.arch, fwd.dtype, fwd.head_dim, fwd.mask, fwd.softcap, fwd.alibi, fwd.varlen, deterministic,
                  fwd.dropout)
