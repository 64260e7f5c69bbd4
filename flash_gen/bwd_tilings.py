"""The backward's tilings across its two kernel families behind one set of functions: the portable template
(flash_gen.spec_bwd.BwdConfig) and the Hopper template (flash_gen.spec_bwd_sm90.Sm90BwdConfig). Must not import
torch or cuda.
"""

from __future__ import annotations

import dataclasses
from typing import Union

from flash_gen import spec_bwd, spec_bwd_sm90
from flash_gen.spec_bwd import BwdConfig, BwdKey
from flash_gen.spec_bwd_sm90 import Sm90BwdConfig

BwdTiling = Union[BwdConfig, Sm90BwdConfig]


def default_configs(key: BwdKey) -> tuple[BwdTiling, ...]:
    """`key`'s chain of default tilings, fastest first: the Hopper kernel where it supports `key` (1.2x the
    portable kernel's fwd+bwd at head dim 128 on the H200, docs/benchmarks.md), at head dims 72-96 and 136-192
    its narrow (_h96) form ahead of the wide chain that follows; with bulk dQ, the same with
    decoupled warpgroups, which keep the dK/dV overlap where the coupled form spills (packed causal batches at
    head dims 96-128: +1.2-1.6% fwd+bwd at 128 over the tiling without the overlap, H200 2026-12-04); then
    without the overlap; then (after 128- or 80-query steps) the 64-query tiling and its own fallbacks; with bulk
    dQ, then the same tilings adding dQ by `red.global.add`, then the portable kernel's (spec_bwd.bwd_fallbacks).
    The runtime takes the first that compiles without spills (flash_gen.build.spill_free). The dQ by reductions
    need fewer registers: at head dim 128, causal, in a packed batch both bulk tilings spill 4-28 B (NVRTC 13.0,
    2026-12-04), and the portable kernel that then ran gave 0.53x the fwd+bwd of `wgbm64n128o`."""
    tiles = [spec_bwd_sm90.default_sm90_bwd_config(key)]
    if tiles[-1].narrow:  # should a narrow form spill, the wide tilings follow
        tiles.append(spec_bwd_sm90.default_sm90_bwd_config(key, narrow=False))
    if tiles[-1].block_m != 64:
        tiles.append(spec_bwd_sm90.default_sm90_bwd_config(key, False, narrow=False))
    chain = [c for t in tiles for c in ([t, dataclasses.replace(t, decoupled=t.dq_bulk),
                                         dataclasses.replace(t, overlap=False)] if t.overlap else [t])]
    chain += [dataclasses.replace(c, dq_bulk=False, decoupled=False) for c in chain if c.dq_bulk]
    chain = [c for c in dict.fromkeys(chain) if spec_bwd_sm90.sm90_bwd_infeasible_reason(key, c) is None]
    return (*chain, *spec_bwd.bwd_fallbacks(key))


def default_config(key: BwdKey) -> BwdTiling:
    """The head of default_configs: the tiling tuned entries are measured against."""
    return default_configs(key)[0]


def config_from_name(name: str) -> BwdTiling:
    """Inverse of either family's config name; ValueError for anything else."""
    cfg = spec_bwd_sm90.sm90_bwd_config_from_name(name)
    return cfg if cfg is not None else spec_bwd.bwd_config_from_name(name)


def infeasible_reason(key: BwdKey, cfg: BwdTiling) -> str | None:
    if isinstance(cfg, Sm90BwdConfig):
        return spec_bwd_sm90.sm90_bwd_infeasible_reason(key, cfg)
    return spec_bwd.bwd_infeasible_reason(key, cfg)


def smem_bytes(key: BwdKey, cfg: BwdTiling) -> int:
    if isinstance(cfg, Sm90BwdConfig):
        return spec_bwd_sm90.sm90_bwd_smem_bytes(key, cfg)
    return spec_bwd.bwd_smem_bytes(key, cfg)


def head_dim_mma(key: BwdKey, cfg: BwdTiling) -> int:
    """Columns of the fp32 dQ accumulator rows (what the main kernel's dQ GEMM computes)."""
    if isinstance(cfg, Sm90BwdConfig):
        return spec_bwd_sm90.sm90_bwd_head_dim(key, cfg)
    return spec_bwd.bwd_head_dim_mma(key, cfg)
