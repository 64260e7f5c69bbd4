"""The forward's tilings across its two kernel families behind one set of functions: the portable template
(flash_gen.spec.FwdConfig, every arch and feature) and the Hopper template (flash_gen.spec_sm90.Sm90FwdConfig,
the sm90 keys it supports). Callers (runtime, library build, tuner database, CLI) need not branch on the family.
Must not import torch or cuda.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Union

from flash_gen import spec, spec_sm90
from flash_gen.spec import FwdConfig, FwdKey
from flash_gen.spec_sm90 import Sm90FwdConfig

FwdTiling = Union[FwdConfig, Sm90FwdConfig]


@functools.lru_cache(maxsize=None)
def default_configs(key: FwdKey) -> tuple[FwdTiling, ...]:
    """`key`'s chain of default tilings, fastest first: the Hopper kernel's default where it supports `key`
    (1.5-1.9x the portable kernel on the H200, docs/benchmarks.md), then the portable kernel's
    (spec.default_configs). The runtime takes the first that compiles without spills (flash_gen.build.spill_free).
    A function of the key alone, kept per key: planning a call (the split and pack-GQA heuristics) reads it."""
    hopper = spec_sm90.default_sm90_config(key)
    if hopper is None:
        return spec.default_configs(key)
    # Lighter Hopper tilings before the portable kernel (NVRTC 13.0, softcap + ALiBi): at head dim 256 non-causal the
    # persistent 80-key head spills 12 B (softcap), 4 B (ALiBi) or 60 B (both) where one CTA per tile does not, at
    # 1.8x the portable kernel (H200, 2026-12-03, docs/benchmarks.md "Softcap and ALiBi at head dim 256"); at head dim
    # 64 three consumer warpgroups (192 rows, 128 registers each) spill 8-28 B where two (168 each) do not; at 256 and
    # packed, 64-key steps spill 8-24 B where 48-key steps do not (KV caches: 32, as key tiles must divide 128; the
    # causal split pack-GQA cache key spills 8 B at 64 and none at 32).
    lighter = [dataclasses.replace(hopper, align=False)] if hopper.align else []  # shifts cost registers
    lighter += [dataclasses.replace(hopper, persistent=False)] if hopper.persistent else []
    lighter += [dataclasses.replace(hopper, block_m=128)] if hopper.block_m == 192 else []
    lighter += [dataclasses.replace(hopper, block_n=48 if key.kv == "dense" else 32)] if hopper.block_n == 64 else []
    if key.dropout and hopper.block_n > 64:  # the draws' registers: at head dim 128 causal both 128-key forms spill
        # 4-12 B and 96-key steps none (NVRTC 13.0, 2026-12-05, docs/dropout.md)
        narrow = dataclasses.replace(hopper, block_n=hopper.block_n - 32)
        lighter += [narrow] + ([dataclasses.replace(narrow, persistent=False)] if narrow.persistent else [])
    return (hopper, *(c for c in lighter if spec_sm90.sm90_infeasible_reason(key, c) is None),
            *spec.default_configs(key))


def portable_config(key: FwdKey) -> FwdConfig:
    """The portable kernel's default for `key`, where default_configs' chain leaves the Hopper tilings: what
    decoding steps over a KV cache run on sm90 too (cache_chunk_runs_hopper)."""
    return spec.default_configs(key)[0]


def measured_defaults(key: FwdKey) -> tuple[FwdTiling, ...]:
    """The defaults a tuned entry of `key` may be measured against: the chain's head (with its unaligned form where
    the head has aligned rows: head dim 72's entries were tuned against that, with the aligned one a candidate), and
    for a KV cache read tile by tile also the portable kernel's, which decoding steps run (the tuner's decode
    family)."""
    head = default_config(key)
    if isinstance(head, Sm90FwdConfig) and head.align:
        return head, dataclasses.replace(head, align=False)
    return (head, portable_config(key)) if key.kv == "cache" and portable_config(key) != head else (head,)


HOPPER_CACHE_ROWS = 64  # one consumer warpgroup's rows


def cache_chunk_runs_hopper(kv: str, seqlen_q: int, group: int, pack_gqa: bool) -> bool:
    """Whether a call over a KV cache read tile by tile (kv "cache") takes its key's default chain, the Hopper
    kernel first on sm90, rather than the portable kernel's tilings: when a KV head's query rows (positions x
    packed heads) fill at least one consumer warpgroup's HOPPER_CACHE_ROWS (chunked prefill, speculative
    decoding). Decoding steps, few rows bound by reading the cache, keep the portable kernel, which reads it near
    the copy ceiling (docs/benchmarks.md, KV-cache decoding). Groups over 64 do not pack in the Hopper kernel."""
    return kv == "cache" and seqlen_q * (group if pack_gqa else 1) >= HOPPER_CACHE_ROWS and group <= 64


def default_config(key: FwdKey) -> FwdTiling:
    """The head of default_configs: the tiling tuned entries are measured against."""
    return default_configs(key)[0]


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


def ctas_per_sm(key: FwdKey, cfg: FwdTiling) -> int:
    """Resident CTAs per SM of `key` tiled by `cfg`."""
    if isinstance(cfg, Sm90FwdConfig):
        return cfg.ctas_per_sm
    return spec.ctas_per_sm(key, cfg)


def packed_query_tiles(cfg: FwdTiling, seqlen_q: int, group: int) -> int | None:
    """Query tiles per KV head of a pack-GQA launch tiled by `cfg` (`group` query heads stacked per tile); None
    where the Hopper kernel cannot stack that many heads (spec_sm90.packed_positions)."""
    if isinstance(cfg, Sm90FwdConfig):
        positions = spec_sm90.packed_positions(cfg, group)
        return -(-seqlen_q // positions) if positions else None
    return -(-seqlen_q * group // cfg.block_m)


@functools.lru_cache(maxsize=4096)  # planning a call asks it once or twice, per call of a new layout
def pack_gqa_pays(key: FwdKey, seqlen_q: int, group: int) -> bool:
    """Whether a call of the unpacked `key` with `group` query heads per KV head should run its pack-GQA key:
    when the packed kernel's default tiling takes no more query tiles per KV head than the unpacked one's. A tile
    costs the same key steps either way, so with few query positions (decoding-like steps, chunked prefill)
    unpacked tiles run mostly empty rows; with as many tiles, packed ones still read each K/V tile once per group
    instead of once per head (H200, head dim 128, 8k keys: 1.06-1.5x at 128-512 positions, where the tile counts
    are equal; docs/benchmarks.md). Not for ALiBi (a slope per head) or packed ragged batches."""
    if group == 1 or key.alibi or key.varlen or key.pack_gqa:
        return False
    packed = packed_query_tiles(default_config(dataclasses.replace(key, pack_gqa=True)), seqlen_q, group)
    unpacked = group * -(-seqlen_q // default_config(key).block_m)
    return packed is not None and packed <= unpacked
