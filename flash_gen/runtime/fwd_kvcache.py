"""Forward attention over a KV cache (flash_attn_with_kvcache, after flash_gen.runtime.kvcache appended the new
keys): how a call runs, kept per argument layout and length bucket (its route). A contiguous cache whose entries
use one host-known length runs as a dense call over views of it (flash_gen.runtime.fwd.attention_fwd); other calls
read the cache tile by tile, with the Hopper kernel's cache form for chunks of many query rows and the portable
kernel for decoding steps, split over the keys where few query tiles leave SMs idle. A decoding loop's step then
only launches: an int length growing every step is patched into a plan whose template holds the capacity.
Must not import optuna.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from flash_gen import fwd_tilings
from flash_gen.fwd_tilings import FwdTiling
from flash_gen.memo import BoundedMemo, layout
from flash_gen.runtime import driver
from flash_gen.runtime.fwd import (
    FwdParams,
    FwdPlan,
    _cache_fields,
    _combine_kernel,
    _config,
    _contiguous_strides,
    _query_tiles,
    _shape,
    _variant,
    attention_fwd,
    choose_num_splits,
    run_fwd,
)
from flash_gen.runtime.score_params import DTYPES, mask_kind
from flash_gen.spec import FwdKey, bucket_name
from flash_gen.spec_sm90 import ROWS_PER_CONSUMER, Sm90FwdConfig


@dataclass(frozen=True)
class KvCache:
    """Where a decoding call's keys live, validated (flash_gen.validate.check_kvcache) and with new keys already
    appended. K/V are (cache entries, seqlen_cache, hk, d), or (pages, page_size, hk, d) with `block_table`."""

    seqused_k: torch.Tensor | None  # (batch,) int32 keys per entry; None: `used` (or all) rows
    used: int | None  # keys per entry when the same for all (a host int)
    leftpad_k: torch.Tensor | None  # (batch,) int32 first valid key
    batch_idx: torch.Tensor | None  # (batch,) int32 cache entry of each batch entry
    block_table: torch.Tensor | None  # (batch, pages per entry) int32
    num_splits: int  # 0: chosen here


def attention_fwd_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache: KvCache,
    *,
    softmax_scale: float,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    config: FwdTiling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward attention of q (b, sq, h, d) over a KV cache (see KvCache); returns (out, softmax_lse (b, h, sq)).
    With more than one split (cache.num_splits, or the heuristic when 0) the keys of each query tile are shared
    out over several CTAs and a combine kernel merges their fp32 partial results. Under GQA/MQA (without ALiBi)
    one CTA serves every query head of a KV head (pack_gqa), so each K/V tile is read once per KV head. A
    contiguous cache whose entries all use the same host-known length (_dense_rows) runs as a dense call where
    the Hopper kernel supports it and the query tiles fill the SMs unsplit (unless `config` forces a cache
    tiling). Other calls read the cache tile by tile (kv "cache"): the Hopper kernel's cache form for chunks of
    many query rows, the portable kernel for decoding steps (fwd_tilings.cache_chunk_runs_hopper); `config`
    forces either. What the argument layout and the length's bucket fix is kept (_cache_routes), and the plans of
    each split count under it, so a decoding loop's step only launches: an int length growing every step is
    patched in (run_fwd's seqlen_k) into a plan whose template holds the capacity."""
    score = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                 alibi_slopes=alibi_slopes)
    capacity = _capacity(k_cache, cache)
    seqlen_k = capacity if cache.used is None else min(cache.used, capacity)
    lookup = (layout(q), layout(k_cache), layout(v_cache), layout(cache.seqused_k), cache.used is None,
              bucket_name("decode", seqlen_k), seqlen_k > 0, layout(cache.leftpad_k), layout(cache.batch_idx),
              layout(cache.block_table), cache.num_splits, softmax_scale, causal, window_size, softcap,
              layout(alibi_slopes), config)
    route = _cache_routes.get(lookup, _UNPLANNED)
    if route is _UNPLANNED:
        route = _cache_routes.put(lookup, _cache_route(q, k_cache, cache, seqlen_k, score, config))
    if route is None:  # every entry's first rows, in order: dense K/V views of them
        return attention_fwd(q, k_cache[:, :seqlen_k], v_cache[:, :seqlen_k], **score, num_splits=cache.num_splits)
    plan = route.plan(q, k_cache, v_cache, cache, seqlen_k, score)
    return run_fwd(plan, q, k_cache, v_cache, alibi_slopes, cache=cache,
                   seqlen_k=None if cache.used is None else seqlen_k)


_cache_routes: BoundedMemo = BoundedMemo(256)
_UNPLANNED = object()


def _capacity(k_cache: torch.Tensor, cache: KvCache) -> int:
    """Keys a cache entry can hold: its rows, or its block table's pages of rows."""
    return k_cache.shape[1] if cache.block_table is None else cache.block_table.shape[1] * k_cache.shape[1]


class _CacheRoute:
    """A KV-cache call read tile by tile, as its argument layout and length bucket fix it: the unsplit tiling,
    its resident-CTA slots and CTAs (the split heuristic's inputs), and the plans of each split count."""

    __slots__ = ("tiling", "cfg", "slots", "ctas", "plans")

    def __init__(self, tiling: tuple, cfg: FwdTiling, slots: int, ctas: int) -> None:
        self.tiling, self.cfg, self.slots, self.ctas, self.plans = tiling, cfg, slots, ctas, {}

    def plan(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache: KvCache, seqlen_k: int,
             score: dict) -> FwdPlan:
        """The plan of a call with `seqlen_k` keys per entry (at most): kept per split count."""
        splits = cache.num_splits or choose_num_splits(self.ctas, -(-seqlen_k // self.cfg.block_n), self.slots)
        plan = self.plans.get(splits)
        if plan is None:
            plan = self.plans[splits] = self._new_plan(q, k_cache, v_cache, cache, splits, score)
        return plan

    def _new_plan(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache: KvCache, splits: int,
                  score: dict) -> FwdPlan:
        batch, seqlen_q, nheads, _ = q.shape
        device, dtype, head_dim, mask, *feats, kv, pack, _, _, _ = self.tiling
        cfg = self.cfg
        if splits > 1:  # the split key's own spill-free tiling (a split kernel can spill where the unsplit one does not)
            cfg, _ = _cache_tiling(*self.tiling, True)
        m_blocks = _query_tiles(cfg, seqlen_q, nheads // k_cache.shape[2] if pack else 1)
        tile_heads = k_cache.shape[2] if pack else nheads
        var = _variant(device, dtype, head_dim, mask, *feats, cfg, kv, splits > 1, pack)
        # The capacity's template, so an unbounded window side lies past every key of any length; kv_cache_rows
        # clamps each entry's length to p.seqlen_k, the capacity or an int length patched in per call.
        shape = _shape(q, k_cache, v_cache, _contiguous_strides(q.shape), batch, _capacity(k_cache, cache),
                       _cache_fields(k_cache, cache.block_table), **score)
        hopper = isinstance(cfg, Sm90FwdConfig)  # a 1-D grid of (query tile, KV head, entry, split)
        grid = (m_blocks * tile_heads * batch * splits, 1, 1) if hopper else (m_blocks, tile_heads, batch * splits)
        params = None
        if splits > 1:
            params = FwdParams.from_buffer_copy(shape.params)
            params.num_splits = splits
        combine = _combine_kernel(device, dtype) if splits > 1 else None
        return FwdPlan(var, shape, grid, q.device, splits, params, combine)


def _cache_route(q: torch.Tensor, k_cache: torch.Tensor, cache: KvCache, seqlen_k: int, score: dict,
                 config: FwdTiling | None) -> _CacheRoute | None:
    """How an attention_fwd_kvcache call with `seqlen_k` keys per entry runs (its tensors' layouts, the length's
    bucket and the score arguments fix it): None where it runs as a dense call over views of the cache's first
    rows, else read tile by tile."""
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_k = k_cache.shape[2]
    group = nheads // nheads_k
    pack = group > 1 and score["alibi_slopes"] is None
    device, dtype = q.device.index, DTYPES[q.dtype]
    mask = mask_kind(score["causal"], score["window_size"])
    feats = (score["softcap"] > 0, score["alibi_slopes"] is not None, False)
    if (config is None and seqlen_k > 0 and _dense_rows(cache)
            and batch * nheads * -(-seqlen_q // _DENSE_TILE_ROWS) >= driver.sm_count(device)
            and _hopper_runs(device, dtype, head_dim, mask, *feats)):
        # The Hopper kernel over views, whose TMA loads zero-fill past them, with its persistent and tuned
        # tilings. Smaller calls, which would split, run as fast in the cache form (H200, 2026-12-01: 64-256 rows,
        # docs/benchmarks.md), whose maps cover the whole cache: a length growing every step re-encodes nothing.
        return None
    # Pages holding whole key tiles (block_n <= 128 divides them) are read tile by tile; others row by row.
    paged = cache.block_table is not None
    kv = "paged" if paged and (k_cache.shape[1] % 128 or cache.leftpad_k is not None) else "cache"
    tiling = (device, dtype, head_dim, mask, *feats, kv, pack, bucket_name("decode", seqlen_k), config,
              fwd_tilings.cache_chunk_runs_hopper(kv, seqlen_q, group, pack))
    cfg, slots = _cache_tiling(*tiling, False)
    ctas = batch * (nheads_k if pack else nheads) * _query_tiles(cfg, seqlen_q, group if pack else 1)
    return _CacheRoute(tiling, cfg, slots, ctas)


_DENSE_TILE_ROWS = 2 * ROWS_PER_CONSUMER  # the Hopper kernel's query tile, two consumer warpgroups


def _dense_rows(cache: KvCache) -> bool:
    """Whether a contiguous cache's entries all use their first rows up to one host-known length (int or no
    cache_seqlens, no left padding, no batch index): dense K/V in all but their strides."""
    return (cache.block_table is None and cache.seqused_k is None and cache.leftpad_k is None
            and cache.batch_idx is None)


@functools.lru_cache(maxsize=None)
def _hopper_runs(device: int, dtype: str, head_dim: int, mask: str, softcap: bool, alibi: bool, varlen: bool) -> bool:
    """Whether the dense key's default tiling is the Hopper kernel's on `device` (once per key, not per step)."""
    key = FwdKey(driver.device_arch(device), dtype, head_dim, mask, softcap, alibi, varlen)
    return isinstance(fwd_tilings.default_config(key), Sm90FwdConfig)


@functools.lru_cache(maxsize=None)
def _cache_tiling(device: int, dtype: str, head_dim: int, mask: str, softcap: bool, alibi: bool, varlen: bool,
                  kv: str, pack: bool, bucket: str, config: FwdTiling | None, hopper: bool,
                  split: bool) -> tuple[FwdTiling, int]:
    """A KV-cache key's tiling and its resident-CTA slots on the device (the split heuristic's inputs): worked
    out once per key and bucket, not per decoding step. `hopper`: the key's default chain (the Hopper kernel
    first where it supports the key); otherwise the portable kernel's tilings (a forced or tuned one first)."""
    key = FwdKey(driver.device_arch(device), dtype, head_dim, mask, softcap, alibi, varlen, kv, split, pack)
    cfg = config or _config(key, bucket, None if hopper else fwd_tilings.portable_config(key))
    return cfg, driver.sm_count(device) * fwd_tilings.ctas_per_sm(key, cfg)
