"""The forward's tilings across its two kernel families behind one set of functions: the portable template
(flash_gen.spec.FwdConfig, every arch and feature) and the Hopper template (flash_gen.spec_sm90.Sm90FwdConfig,
the sm90 keys it supports). Callers (runtime, library build, tuner database, CLI) need not branch on the family.
Must not import torch or cuda.
"""

from __future__ import annotations

from typing import Union

from flash_gen import spec, spec_sm90
from flash_gen.spec import FwdConfig, FwdKey
from flash_gen.spec_sm90 import Sm90FwdConfig

FwdTiling = Union[FwdConfig, Sm90FwdConfig]


def default_config(key: FwdKey) -> FwdTiling:
    """The Hopper kernel's default where it supports `key` (1.5-1.9x the portable kernel on the H200,
    docs/benchmarks.md), else the portable kernel's."""
    cfg = spec_sm90.default_sm90_config(key)
    return cfg if cfg is not None else spec.default_config(key)


def config_from_name(name: str) -> FwdTiling:
    """Inverse of either family's config name; ValueError for anything else."""
    cfg = spec_sm90.sm90_config_from_name(name)
    return cfg if cfg is not None else spec.config_from_name(name)


def infeasible_reason(key: FwdKey, cfg: FwdTiling) -> str | None:
    if isinstance(cfg, Sm90FwdConfig):
        return spec_sm90.sm90_infeasible_reason(key, cfg)
    return spec.infeasible_reason(key, cfg)


def smem_bytes(key: FwdKey, cfg: FwdTiling) -> int:
    if isinstance(cfg, Sm90FwdConfig):
        return spec_sm90.sm90_smem_bytes(key, cfg)
    return spec.smem_bytes(key, cfg)
