"""The Hopper backward kernel's tiling (templates/include/flash_gen/bwd_sm90.cuh), the sm90 default for the keys it
supports (flash_gen.bwd_tilings.default_config). Must not import torch or cuda.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from flash_gen.spec import MAX_SMEM_PER_BLOCK
from flash_gen.spec_bwd import BwdKey
from flash_gen.spec_sm90 import WGMMA_BASIC_N


@dataclass(frozen=True)
class Sm90BwdConfig:
    """block_m queries per step x block_n keys per CTA (two warpgroups of 64 keys, or 64 keys shared when the head dim
    is split), two Q/dO buffers; the template takes any block_m, the feasibility rule admits 64 x 128 (and 128 x 128
    at head dims up to 64, 80 x 128 at 72-128 with dQ computed transposed, not narrow) and 64 x 64 at 136-256.
    `overlap`: the dK/dV wgmmas run on through the dS barrier and the dQ GEMM instead of being waited for first (name
    suffix "o"). `dq_bulk`: each step's dQ goes through shared memory and leaves as TMA tensor reductions
    (`cp.reduce.async.bulk.tensor`, one per box of sm90_bwd_dq_box_cols columns, issued by thread 0, or per head dim
    half by each warpgroup's first thread when the head dim is split) instead of each thread's `red.global.add` of
    its accumulators (suffix "b"). `decoupled` (bulk dQ, head dims up to 128): the warpgroups meet once per step, at the
    dS barrier, not also at its end; dS is double-buffered, the next Q/dO tile loads after the dS barrier and each
    warpgroup sends its own half of dQ (suffix "d"). With 128-query steps the warpgroups split dQ's rows (64 each,
    N = 64 dQ wgmmas), with 64 or 80 its columns. `narrow` (head dims 72-96 and 136-192): the GEMMs compute head dim
    96 rather than 128 (192 rather than 256), a quarter less work, in narrower swizzle rows (suffix "_h96", for the
    96-column GEMMs; sm90_bwd_head_dim)."""

    block_m: int = 64
    block_n: int = 128
    overlap: bool = False
    dq_bulk: bool = False
    decoupled: bool = False
    narrow: bool = False

    @property
    def name(self) -> str:
        flags = ("o" if self.overlap else "") + ("b" if self.dq_bulk else "") + ("d" if self.decoupled else "")
        return f"wgbm{self.block_m}n{self.block_n}{flags}" + ("_h96" if self.narrow else "")

    @property
    def num_threads(self) -> int:
        return 256

    @property
    def dq_box_rows(self) -> int:
        """Rows of a bulk dQ reduction box (dq_accum's TMA map): a query step's, but 64 with 128-query steps, whose
        warpgroups each compute and send their own 64 rows of dQ (bwd_sm90.cuh, kDqRowHalves)."""
        return 64 if self.block_m == 128 else self.block_m


# The tuner's axes where this kernel is the default (flash_gen.search.space), pruned by sm90_bwd_infeasible_reason
# (block_n is fixed per head dim, block_m 128 only at head dim 64, 80 only at 128, narrow only at 72-96); stages and
# a producer scheme would join here.
SM90_BWD_CONFIG_SPACE = {"block_m": (64, 80, 128), "block_n": (64, 128), "overlap": (False, True),
                         "dq_bulk": (False, True), "decoupled": (False, True), "narrow": (False, True)}


def narrow_head_dim(head_dim: int) -> int | None:
    """The head dim a `narrow` tiling computes for `head_dim`: 96 at 72-96, 192 at 136-192; None elsewhere."""
    if 64 < head_dim <= 96:
        return 96
    return 192 if 128 < head_dim <= 192 else None


def sm90_bwd_head_dim(key: BwdKey, cfg: Sm90BwdConfig | None = None) -> int:
    """Head dim the GEMMs compute: 64, 128 or 256 (128-byte swizzled rows of 64 columns; TMA and the K/V loads
    zero-fill the columns past the tensors' head dim, the stores skip them), or under a `narrow` tiling (64-byte rows
    of 32 columns) 96 for head dims 72-96 and 192 for 136-192, a quarter less work in all five GEMMs than 128 or 256."""
    d = key.head_dim
    if cfg is not None and cfg.narrow and (narrowed := narrow_head_dim(d)):
        return narrowed
    return 64 if d <= 64 else 128 if d <= 128 else 256


def sm90_bwd_computed_key(key: BwdKey, cfg: Sm90BwdConfig) -> BwdKey:
    """`key` at the head dim its Hopper backward kernel computes under `cfg` (sm90_bwd_head_dim). The kernel takes
    the tensors' head dim at run time, so this key's kernel serves `key`: 72-120 run 128's, or (narrow) 72-88 96's."""
    return replace(key, head_dim=sm90_bwd_head_dim(key, cfg))


def sm90_bwd_tuned_key(key: BwdKey) -> BwdKey:
    """The key whose tuned entries `key` takes where it has none of its own: that of the smallest of 64, 96, 128, 192
    and 256 that holds its head dim, as both run the same kernel under every tiling (64, 128 or 256 wide, or narrow
    96 at 72-96 and 192 at 136-192)."""
    return replace(key, head_dim=next(h for h in (64, 96, 128, 192, 256) if key.head_dim <= h))


def split_head_dim(key: BwdKey) -> bool:
    """Whether the warpgroups split the head dim (136-256, computed as 192 or 256: 64 keys per CTA,
    docs/hopper_backward.md) rather than the keys (64 each of 128)."""
    return key.head_dim > 128


def default_sm90_bwd_config(key: BwdKey, wide_steps: bool = True, narrow: bool = True) -> Sm90BwdConfig:
    """The tiling the kernel takes for `key`'s head dim, overlapping the dK/dV wgmmas where that measured ahead:
    fwd+bwd +1.5-3% at head dim 64 on the H200, at 128 +2% without a mask but -1% causal. Dense unmasked or causal
    batches take bulk dQ with the overlap: at head dim 128 +1-3% over either alone (2k-8k, docs/hopper_backward.md);
    at 64, on the TMA reductions and with 128-query steps (the default there without ALiBi), +8-13% over the
    overlap alone and -1..+3% over 64-query steps with bulk dQ (fwd+bwd, 2k-8k, 2026-12-03, docs/benchmarks.md);
    at 256 (split head dim), the warpgroups' halves of dQ staged in the step's Q and dO buffers, +9-12% (same
    day, then through other buffers). Packed batches and windows take them too: fwd+bwd +9-17% on a ragged batch
    (benchmarks/bench_varlen.py, head dims 64-256) and +7-15% under windows (1024/0 causal at 8k, 512/512 at 4k)
    against the tilings they had (2026-12-03, docs/hopper_backward.md). Deterministic dQ cannot take bulk dQ, so
    the overlap's last condition decides deterministic keys only. Dense unmasked batches at head dims 72-128 take
    80-query steps (dQ transposed) with bulk dQ and without the overlap, which spills 32 B there: fwd+bwd
    +0.3-3.9% at head dims 96 and 128 (2k-8k, 2026-12-03, docs/hopper_backward.md). Masks keep 64-query steps:
    causal at head dim 128 -1..-3% at 2k, +0..2% at 4k-8k, windows -0.5..-1%; with ALiBi or in a packed batch the
    80-query steps spill 4-44 B, and with dropout (the keep bits) 100-416 B at head dims 64 and 128 (NVRTC 13.0,
    2026-12-05), so dropout keys start at 64-query steps rather than compile wider ones bound to spill.
    `wide_steps` False: the 64-query tiling those wider steps fall back to. Head dims 72-96 and 136-192 take the
    `narrow` (_h96) tiling unless `narrow` is False, with bulk dQ without the overlap: fwd+bwd +1-14% over the
    128-wide defaults at 72-96 and ahead of the `o` and `od` forms in every cell (H100, 2k-8k, causal and not,
    2026-12-05), at 160-192 +11-15% over computing them as 256 and level with the `o` form (H100, 2k and 8k,
    2026-12-06; docs/hopper_backward.md). Ordered dQ there takes the overlap as the wide tilings do."""
    bulk = not key.deterministic
    if narrow and narrow_head_dim(key.head_dim):
        overlap = not bulk and key.mask == "none" and not key.varlen
        return Sm90BwdConfig(64, 64 if split_head_dim(key) else 128, overlap, bulk, narrow=True)
    d = sm90_bwd_head_dim(key)
    overlap = d <= 64 or bulk or (key.mask == "none" and not key.varlen)
    # with ALiBi, 128-query steps spill 28-80 B; with dropout, 100-416 B
    if wide_steps and bulk and not key.alibi and not key.dropout:
        if d == 64:
            return Sm90BwdConfig(128, 128, overlap, bulk)
        if d == 128 and key.mask == "none" and not key.varlen:
            return Sm90BwdConfig(80, 128, False, bulk)
    return Sm90BwdConfig(64, 64 if split_head_dim(key) else 128, overlap, bulk)


def sm90_bwd_config_from_name(name: str) -> Sm90BwdConfig | None:
    """Inverse of Sm90BwdConfig.name, or None for a name of another kernel family."""
    m = re.fullmatch(r"wgbm(\d+)n(\d+)(o?)(b?)(d?)(_h96)?", name)
    return Sm90BwdConfig(int(m[1]), int(m[2]), bool(m[3]), bool(m[4]), bool(m[5]), bool(m[6])) if m else None


def sm90_bwd_box_cols(head_dim: int) -> int:
    """Columns of a Q/dO TMA box (a swizzle row) for a computed head dim: 64, or 32 where each warpgroup's dK/dV
    GEMM is 96 columns wide (head dim 96, or 192 split), its MN-major operands whole 32-column atoms."""
    return 64 if (head_dim // 2 if head_dim > 128 else head_dim) % 64 == 0 else 32


def sm90_bwd_dq_box_cols(head_dim: int) -> int:
    """fp32 columns of a bulk dQ box (a swizzle row of dq_accum's TMA map and of the staging buffer) for a computed
    head dim: 32 (128 bytes), or 16 at 96, whose warpgroups' 48-column halves must be whole boxes."""
    return 32 if head_dim % 64 == 0 else 16


def sm90_bwd_needs_extended_wgmma(key: BwdKey, cfg: Sm90BwdConfig) -> bool:
    """Whether the query step (the N of S^T, dP^T and dQ^T) or a warpgroup's half of the head dim (the N of dQ, 48
    at head dim 96) needs CuTe's extended wgmma shapes to stay one instruction per k-step (80 would otherwise split
    into five N = 16 ones)."""
    return cfg.block_m not in WGMMA_BASIC_N or sm90_bwd_head_dim(key, cfg) // 2 not in WGMMA_BASIC_N


def sm90_bwd_smem_bytes(key: BwdKey, cfg: Sm90BwdConfig) -> int:
    """Q, dO (two buffers each), K, V and dS tiles (2-byte elements), with bulk dQ the step's dQ in fp32 (32-column
    boxes, swizzled), when the head dim is split P^T (bulk dQ then stages each half of dQ in the step's Q and dO
    buffers; with dropout or softcap a second P^T, signed or times 1 - tanh^2), decoupled a second dS tile, then per
    buffer the tile's lse and rowsum(dO*O) (4 floats more each: their bulk copies start at a 16-byte boundary) and
    mbarrier."""
    d, tile = sm90_bwd_head_dim(key, cfg), cfg.block_m * cfg.block_n
    split = (4 if key.dropout or key.softcap else 2) * tile if split_head_dim(key) else 0
    dq = 4 * cfg.block_m * d if cfg.dq_bulk and not split else 0
    stats = 2 * 4 * (cfg.block_m + 4)
    ds = 2 * tile if cfg.decoupled else tile
    return 2 * (4 * cfg.block_m * d + 2 * cfg.block_n * d + ds) + dq + split + 2 * (stats + 8)


def sm90_bwd_infeasible_reason(key: BwdKey, cfg: Sm90BwdConfig) -> str | None:
    """Why the Hopper backward cannot run `key` with `cfg` (None when it can)."""
    if key.arch != "sm90":
        return f"wgmma kernels are built for sm90, not {key.arch}"
    if cfg.block_n != (64 if split_head_dim(key) else 128):
        return "block_n: 64 when the warpgroups split the head dim (136-256), else 128"
    if cfg.narrow and narrow_head_dim(key.head_dim) is None:
        return "narrow (_h96): head dims 72-96 and 136-192, computed as 96 and 192"
    d = sm90_bwd_head_dim(key, cfg)
    if cfg.block_m not in (64, 80, 128) or (cfg.block_m == 128 and d != 64) or (cfg.block_m == 80 and d != 128):
        # 128-query steps need 64 more accumulator registers per thread: spill-free at head dim 64 only (246-248
        # registers, NVRTC 13.0, 2026-12-03; 388 B of spills before the register work of 2026-11-30..12-02). 80
        # (no wgmma M) computes dQ transposed, the warpgroups splitting head dim 128 as its M.
        return "block_m: 64, 128 at head dims up to 64, or 80 at head dims 72-128 (not narrow)"
    if cfg.block_m == 80 and not cfg.dq_bulk:
        return "block_m 80: with bulk dQ (the transposed dQ leaves through shared memory)"
    if key.head_dim % 8 or key.head_dim > 256:
        return f"head_dim {key.head_dim}: a multiple of 8 up to 256"
    if cfg.dq_bulk and key.deterministic:
        return "bulk dQ: not with deterministic dQ (ordered reductions)"
    if cfg.decoupled and (not cfg.dq_bulk or split_head_dim(key)):
        return "decoupled: with bulk dQ, at head dims up to 128"
    if sm90_bwd_smem_bytes(key, cfg) > MAX_SMEM_PER_BLOCK[key.arch]:
        return "shared memory"
    return None
