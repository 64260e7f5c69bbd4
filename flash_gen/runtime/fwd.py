"""Launch the forward attention kernel: pick the variant for a call, fill its parameter struct, launch.

Inputs arrive validated and normalised by flash_gen.validate. A call is planned (plan_fwd: the loaded kernel,
the parameter template and the grid, all fixed by shapes, strides and score arguments) and run (run_fwd: out and
lse allocated, the template copied with this call's addresses, one cuLaunchKernel on PyTorch's current stream; no
host synchronisation). Plans are kept per argument layout (flash_gen.ops, attention_fwd; KV caches:
flash_gen.runtime.fwd_kvcache), so a repeated eager call only runs one: the addresses (tensors, KV-cache indices)
are patched in at launch.
Must not import optuna.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from flash_gen import fwd_tilings, settings
from flash_gen.fwd_tilings import FwdTiling
from flash_gen.gen.render import combine_entry, entry_name, render_combine, render_many
from flash_gen.memo import BoundedMemo, layout
from flash_gen.runtime import driver, loader, tma
from flash_gen.runtime.section_schedule import CausalLaunch, choose_section_pairs
from flash_gen.runtime.score_params import (
    DTYPES,
    check_grid,
    mask_kind,
    set_dropout_fields,
    set_score_fields,
    set_strides,
    varlen_tiles,
)
from flash_gen.spec import FwdKey, bucket_name
from flash_gen.spec_sm90 import (
    ROWS_PER_CONSUMER,
    Sm90FwdConfig,
    StreamKPlan,
    sm90_box_cols,
    sm90_head_dim,
    sm90_stream_k,
    stream_k_plan,
)

if TYPE_CHECKING:  # run_fwd's cache argument; that module imports this one
    from flash_gen.runtime.fwd_kvcache import KvCache


class FwdParams(ctypes.Structure):
    """Mirror of flash_gen::FwdParams (templates/include/flash_gen/fwd_params.cuh): keep the two in step."""

    _fields_ = (
        [
            (name, ctypes.c_void_p)
            for name in ("q", "k", "v", "o", "lse", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "seqused_k",
                         "leftpad_k", "kv_batch_idx", "block_table", "o_partial", "lse_partial")
        ]
        + [
            (f"{t}_{s}_stride", ctypes.c_int64)
            for t in ("q", "k", "v", "o")
            for s in ("batch", "row", "head")
        ]
        + [
            (name, ctypes.c_int64)
            for name in ("alibi_batch_stride", "lse_batch_stride", "lse_head_stride", "block_table_stride")
        ]
        + [
            (name, ctypes.c_int)
            for name in ("batch", "nheads", "nheads_k", "seqlen_q", "seqlen_k", "window_left", "window_right",
                         "kv_batches", "page_size", "num_splits", "head_dim")
        ]
        + [(name, ctypes.c_float) for name in ("score_scale", "scale_log2", "alibi_scale")]
        + [("dropout_threshold", ctypes.c_uint), ("dropout_scale", ctypes.c_float), ("rng_state", ctypes.c_void_p)]
    )


class Sm90FwdParams(ctypes.Structure):
    """Mirror of flash_gen::Sm90FwdParams (templates/include/flash_gen/fwd_sm90_params.cuh): TMA maps of q, k, v,
    o, then the portable kernel's parameters, padded to the maps' 64-byte alignment as the C++ struct is."""

    _fields_ = ([(f"tma_{t}", ctypes.c_uint8 * tma.MAP_BYTES) for t in "qkvo"] + [("base", FwdParams)]
                + [("qk_shift_bits", ctypes.c_int), ("v_shift_bits", ctypes.c_int), ("sk_flags", ctypes.c_void_p)]
                + [(f"sk_{f}", ctypes.c_int) for f in ("rounds", "tiles", "steps", "chunk")]
                + [("section_pairs", ctypes.c_int)])
    _fields_.append(("_pad", ctypes.c_uint8 * (-(4 * tma.MAP_BYTES + ctypes.sizeof(FwdParams) + 36) % tma.MAP_ALIGN)))


# Byte offsets of the per-call addresses in FwdParams (run_fwd patches them into the shape's template), and of
# FwdParams inside the Hopper struct.
_OFF_Q, _OFF_K, _OFF_V, _OFF_O, _OFF_LSE, _OFF_ALIBI, _OFF_CU_Q, _OFF_CU_K, _OFF_O_PARTIAL, _OFF_LSE_PARTIAL = (
    getattr(FwdParams, f).offset for f in ("q", "k", "v", "o", "lse", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k",
                                           "o_partial", "lse_partial"))
_OFF_SEQUSED_K, _OFF_LEFTPAD_K, _OFF_KV_BATCH_IDX, _OFF_BLOCK_TABLE = (
    getattr(FwdParams, f).offset for f in ("seqused_k", "leftpad_k", "kv_batch_idx", "block_table"))
_OFF_RNG_STATE = FwdParams.rng_state.offset
_OFF_SK_FLAGS = Sm90FwdParams.sk_flags.offset - Sm90FwdParams.base.offset  # patched relative to the base
_SM90_BASE = Sm90FwdParams.base.offset
# seqlen_k (int32) of a KV-cache call with an int length, patched per call into its length class's plan: launch
# patches are 8 bytes wide, so the patch carries the field that shares its word (window_left) unchanged.
_OFF_SEQLEN_K = FwdParams.seqlen_k.offset
assert _OFF_SEQLEN_K % 8 == 0 and FwdParams.window_left.offset == _OFF_SEQLEN_K + 4


class _Variant:
    """A loaded kernel with its launch shape, cached per (device, dtype, head dim, mask, features)."""

    __slots__ = ("kernel", "cfg", "smem", "block", "pack_gqa", "head_dim", "box_cols", "stream_k")

    def __init__(self, kernel: driver.Kernel, key: FwdKey, cfg: FwdTiling, smem: int) -> None:
        self.kernel, self.cfg, self.smem, self.pack_gqa = kernel, cfg, smem, key.pack_gqa
        self.block = (cfg.num_threads, 1, 1)
        # The head dim the kernel computes with, and the Hopper kernel's TMA box width (a swizzle row of it)
        self.head_dim = sm90_head_dim(key) if isinstance(cfg, Sm90FwdConfig) else key.head_dim
        self.box_cols = sm90_box_cols(self.head_dim) if isinstance(cfg, Sm90FwdConfig) else 0
        self.stream_k = isinstance(cfg, Sm90FwdConfig) and sm90_stream_k(key, cfg)


_variants: dict[tuple, _Variant] = {}


def _variant(
    device: int, dtype: str, head_dim: int, mask: str, softcap: bool, alibi: bool, varlen: bool,
    config: FwdTiling | None, kv: str = "dense", split: bool = False, pack_gqa: bool = False,
    bucket: str = "", dropout: bool = False,
) -> _Variant:
    lookup = (device, dtype, head_dim, mask, softcap, alibi, varlen, config, kv, split, pack_gqa, bucket, dropout)
    var = _variants.get(lookup)
    if var is None:
        arch = driver.device_arch(device)
        key = FwdKey(arch, dtype, head_dim, mask, softcap, alibi, varlen, kv, split, pack_gqa, dropout)
        cfg = config or _config(key, bucket)
        why = fwd_tilings.infeasible_reason(key, cfg)
        if why is not None:
            raise ValueError(f"config: {cfg.name} cannot run {key.name}: {why}")
        smem = fwd_tilings.smem_bytes(key, cfg)
        kernel = loader.get_kernel(lambda: render_many([(key, cfg)]), entry_name(key, cfg), arch, smem, device)
        var = _variants[lookup] = _Variant(kernel, key, cfg, smem)
    return var


def _config(key: FwdKey, bucket: str, start: FwdTiling | None = None) -> FwdTiling:
    """FLASH_GEN_FWD_CONFIG where feasible, else the tuning database's entry for the bucket if it is of the kernel
    family the chain walk starts in, else the first default that compiles without spills: from the chain's head
    (the Hopper kernel where it supports the key) or from `start`. (A KV cache's decoding steps start at the
    portable kernel and its chunks at the Hopper one, in the same buckets.)"""
    forced = settings.fwd_config()
    if forced is not None:
        cfg = fwd_tilings.config_from_name(forced)
        if fwd_tilings.infeasible_reason(key, cfg) is None:
            return cfg
    tuned = loader.tuned_config(key, bucket)
    if tuned is not None and type(tuned) is type(start or fwd_tilings.default_config(key)):
        return tuned
    return loader.spill_free_config(key, start)


class FwdPlan:
    """Everything a dense or packed forward launch needs that the call's shapes, strides, dtype, device and score
    arguments fix: the variant, the parameter template, the grid. flash_gen.ops keeps one per validated
    argument layout, so a repeated eager call goes straight to run_fwd. A split-KV plan (splits > 1) has its own
    template (the shape's with the split count) and the combine kernel that merges the splits. The Hopper
    kernel's encoded TMA maps are kept per address set (`maps`), a stream-K kernel's walk of its tiles
    (`stream_k`), and a persistent causal or local kernel's section width (`section_pairs`, 0: its own rule)."""

    __slots__ = ("var", "shape", "grid", "lse_like", "splits", "params", "combine", "maps", "stream_k",
                 "section_pairs")

    def __init__(self, var: _Variant, shape: _Shape, grid: tuple[int, int, int], device: torch.device,
                 splits: int = 1, params: FwdParams | None = None, combine: driver.Kernel | None = None,
                 stream_k: StreamKPlan | None = None, section_pairs: int = 0) -> None:
        self.var, self.shape, self.grid = var, shape, grid
        self.splits, self.params, self.combine, self.stream_k = splits, params, combine, stream_k
        self.section_pairs = section_pairs
        self.maps = BoundedMemo(tma.MAPS_PER_SHAPE)
        # softmax_lse's shape, dtype and device over one float: torch.empty_like of it allocates a contiguous lse
        # faster than new_empty(shape, dtype=) parses its arguments.
        self.lse_like = torch.empty((), dtype=torch.float32, device=device).expand(shape.lse_shape)


def plan_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: FwdTiling | None = None,
    pack_gqa: bool | None = None,
    num_splits: int = 0,
    dropout_p: float = 0.0,
) -> FwdPlan:
    """The plan of an attention_fwd call (same arguments; only the shapes and strides of the tensors count). With
    dropout: neither split-KV nor pack-GQA (training shapes fill the SMs), the keep threshold and scale in the
    plan's own parameters (the seed's address is patched in per call: run_fwd's rng_state)."""
    dropout = dropout_p > 0
    if dropout and (block_table is not None or pack_gqa or num_splits > 1):
        raise ValueError("dropout_p: dropout runs on dense or packed K/V, one query head per tile row, unsplit")
    varlen = cu_seqlens_q is not None
    batch = cu_seqlens_q.numel() - 1 if varlen else q.shape[0]
    kv, seqlen_k = "dense", k.shape[-3]  # the total when varlen
    if block_table is not None:  # pages holding whole key tiles (block_n <= 128) are read tile by tile
        kv, seqlen_k = ("paged" if k.shape[1] % 128 else "cache"), block_table.shape[1] * k.shape[1]
    device = q.device.index
    nheads, seqlen_q, nheads_k = q.shape[-2], q.shape[-3], k.shape[-2]
    group = nheads // nheads_k
    features = (device, DTYPES[q.dtype], q.shape[-1], mask_kind(causal, window_size), softcap > 0,
                alibi_slopes is not None, varlen)
    out_stride = out.stride() if out is not None else _contiguous_strides(q.shape)
    paged_fields = _cache_fields(k, block_table) if block_table is not None else ()
    shape = _shape(q, k, v, out_stride, batch, seqlen_k, paged_fields, causal=causal, window_size=window_size,
                   softmax_scale=softmax_scale, softcap=softcap, alibi_slopes=alibi_slopes)
    if num_splits < 0 or (num_splits > 1 and (varlen or kv != "dense")):
        raise ValueError(f"num_splits must be >= 0 (0: chosen here), and 0 or 1 for packed or paged batches; got "
                         f"{num_splits}")
    if (not varlen and kv == "dense" and not dropout
            and (num_splits > 1 or (num_splits == 0 and config is None and pack_gqa is None))):
        split = _split_plan(features, q, shape, seqlen_k, nheads_k, num_splits, config, pack_gqa)
        if split is not None:
            return split
    if pack_gqa is None:
        pack_gqa = kv == "dense" and not dropout and fwd_tilings.pack_gqa_pays(
            FwdKey(driver.device_arch(device), *features[1:]), seqlen_q, group)
    var = _variant(*features, config, kv, pack_gqa=pack_gqa, bucket=bucket_name("fwd", seqlen_k), dropout=dropout)
    if varlen:
        grid = (varlen_tiles(seqlen_q, batch, var.cfg.block_m), nheads, 1)
    elif pack_gqa:  # tiles of a KV head's whole group of query heads
        grid = (_query_tiles(var.cfg, seqlen_q, group), nheads_k, batch)
    else:
        grid = (-(-seqlen_q // var.cfg.block_m), nheads, batch)
    stream_k, section_pairs = None, 0
    if isinstance(var.cfg, Sm90FwdConfig):  # a 1-D grid of query tiles; persistent: as many CTAs as fit walk them
        # A cluster's CTAs serve consecutive query tiles of one head: query tiles per head rounded up to whole
        # clusters (the extra tile's rows lie past seqlen_q: loaded as zeros, never stored).
        cluster, pairs = var.cfg.cluster, grid[1] * grid[2]
        tiles = -(-grid[0] // cluster) * cluster * grid[1] * grid[2]
        resident = driver.sm_count(device) * var.cfg.ctas_per_sm // cluster * cluster
        grid = (min(tiles, resident) if var.cfg.persistent else tiles, 1, 1)
        if var.stream_k:  # the kernel reads its walk from the plan, stream-K or not
            stream_k = stream_k_plan(tiles, resident, -(-seqlen_k // var.cfg.block_n), not settings.no_stream_k())
            grid = (stream_k.ctas, 1, 1)
        if var.cfg.persistent and features[3] != "none":  # the masks whose tiles the kernel orders in sections
            section_pairs = settings.section_pairs()
            if section_pairs is None:  # the model's width (the default; FLASH_GEN_SECTION_PAIRS=0: the kernel's rule)
                section_pairs = (_model_section_pairs(var, seqlen_q, pairs, group, grid[0], q.element_size())
                                 if features[3] == "causal" and kv == "dense" and seqlen_q == seqlen_k else 0)
    params = None
    if dropout:
        params = FwdParams.from_buffer_copy(shape.params)
        set_dropout_fields(params, dropout_p)
    return FwdPlan(var, shape, grid, q.device, params=params, stream_k=stream_k, section_pairs=section_pairs)


def _model_section_pairs(var: _Variant, seqlen: int, pairs: int, group: int, ctas: int, element_bytes: int) -> int:
    """The section width section_schedule.choose_section_pairs picks for a dense causal launch with as many keys
    as queries (what its model covers); 0, the kernel's own rule, with clusters."""
    launch = sm90_causal_launch(var, seqlen, pairs, group, ctas, element_bytes)
    return 0 if launch is None else choose_section_pairs(launch)


def sm90_causal_launch(var: _Variant, seqlen: int, pairs: int, group: int, ctas: int,
                       element_bytes: int) -> CausalLaunch | None:
    """A persistent Hopper variant's dense causal launch as section_schedule models it (None with clusters, whose
    tile order the model does not cover)."""
    cfg = var.cfg
    if cfg.cluster > 1:
        return None
    positions = ROWS_PER_CONSUMER // group if var.pack_gqa else ROWS_PER_CONSUMER
    return CausalLaunch(seqlen, pairs, cfg.consumers * positions, cfg.block_n, ctas, 2 * var.head_dim * element_bytes,
                        1 if var.pack_gqa else group, positions)


def _split_plan(features: tuple, q: torch.Tensor, shape: _Shape, seqlen_k: int, nheads_k: int, num_splits: int,
                config: FwdTiling | None, pack_gqa: bool | None) -> FwdPlan | None:
    """A split-KV plan of a dense batch, or None where one split is chosen. With num_splits 0 the keys are split
    when the query tiles would fill at most half of the resident CTA slots (choose_num_splits), into as many
    splits as fill one wave. The split kernel is the unsplit one's family and tiling (Hopper: one CTA per tile);
    what a split call adds, the partials' round trip and the combine kernel, needs at least SPLIT_MIN_KEYS keys,
    and below twice that at least four splits, to pay (H200, benchmarks/bench_dense_split.py, 2026-12-01: two
    splits over 2048 keys ran 0.91-0.94x unsplit, four 1.06-1.16x; docs/benchmarks.md)."""
    device, dtype, head_dim, mask, softcap, alibi, _ = features
    if not num_splits and seqlen_k < SPLIT_MIN_KEYS:
        return None
    batch, seqlen_q, nheads, _ = q.shape
    group = nheads // nheads_k
    arch = driver.device_arch(device)
    if pack_gqa is None:
        pack_gqa = fwd_tilings.pack_gqa_pays(FwdKey(arch, *features[1:]), seqlen_q, group)
    key = FwdKey(arch, *features[1:], split=True, pack_gqa=pack_gqa)
    tile_heads = nheads_k if pack_gqa else nheads
    if not num_splits:  # decided on the default tiling, before any kernel is looked up
        cfg = config or fwd_tilings.default_config(key)
        slots = driver.sm_count(device) * fwd_tilings.ctas_per_sm(key, cfg)
        ctas = batch * tile_heads * _query_tiles(cfg, seqlen_q, group if pack_gqa else 1)
        num_splits = choose_num_splits(ctas, -(-seqlen_k // cfg.block_n), slots)
        if num_splits < (2 if seqlen_k >= 2 * SPLIT_MIN_KEYS else 4):
            return None
    var = _variant(device, dtype, head_dim, mask, softcap, alibi, False, config, split=True, pack_gqa=pack_gqa,
                   bucket=bucket_name("fwd", seqlen_k))
    m_tiles = _query_tiles(var.cfg, seqlen_q, group if pack_gqa else 1)
    params = FwdParams.from_buffer_copy(shape.params)
    params.num_splits = num_splits
    grid = ((m_tiles * tile_heads * batch * num_splits, 1, 1) if isinstance(var.cfg, Sm90FwdConfig)
            else (m_tiles, tile_heads, batch * num_splits))
    return FwdPlan(var, shape, grid, q.device, num_splits, params, _combine_kernel(device, dtype))


SPLIT_MIN_KEYS = 2048  # below, the partials' round trip and the combine cost more than idle SMs


def _query_tiles(cfg: FwdTiling, seqlen_q: int, group: int) -> int:
    """Query tiles per head (per KV head when `group` > 1 query heads are packed in each)."""
    tiles = fwd_tilings.packed_query_tiles(cfg, seqlen_q, group)
    if tiles is None:
        raise ValueError(f"pack_gqa: {group} query heads per KV head do not fit one warpgroup's "
                         f"{ROWS_PER_CONSUMER} rows")
    return tiles


def run_fwd(
    plan: FwdPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alibi_slopes: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    cache: KvCache | None = None,
    seqlen_k: int | None = None,
    rng_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch a planned forward on tensors laid out as the plan's; returns (out, softmax_lse). `cache`: a KV-cache
    call's index tensors (block_table is then the cache's); `seqlen_k`: its int length, over the plan's own;
    `rng_state`: a dropout plan's seed (int64, element 0)."""
    var, shape = plan.var, plan.shape
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # cheaper than torch.empty(shape, ...)
    lse = torch.empty_like(plan.lse_like)
    stream = torch._C._cuda_getCurrentRawStream(q.device.index)  # as Inductor's code reads it: no Stream object
    # The shape's template with this call's addresses patched in at launch (driver.Kernel.launch).
    patches = (_OFF_Q, q.data_ptr(), _OFF_K, k.data_ptr(), _OFF_V, v.data_ptr(), _OFF_O, out.data_ptr(), _OFF_LSE,
               lse.data_ptr())
    if alibi_slopes is not None:
        patches += (_OFF_ALIBI, alibi_slopes.data_ptr())
    if cu_seqlens_q is not None:
        patches += (_OFF_CU_Q, cu_seqlens_q.data_ptr(), _OFF_CU_K, cu_seqlens_k.data_ptr())
    if block_table is not None:
        patches += (_OFF_BLOCK_TABLE, block_table.data_ptr())
    if rng_state is not None:
        patches += (_OFF_RNG_STATE, rng_state.data_ptr())
    if cache is not None:
        for offset, t in ((_OFF_SEQUSED_K, cache.seqused_k), (_OFF_LEFTPAD_K, cache.leftpad_k),
                          (_OFF_KV_BATCH_IDX, cache.batch_idx), (_OFF_BLOCK_TABLE, cache.block_table)):
            if t is not None:
                patches += (offset, t.data_ptr())
    params, base = plan.params or shape.params, 0
    if seqlen_k is not None:
        patches += (_OFF_SEQLEN_K, seqlen_k | (params.window_left & 0xFFFFFFFF) << 32)
    workspace = None  # kept alive through the launch
    if isinstance(var.cfg, Sm90FwdConfig):
        params, base = _sm90_params(plan, q, k, v, out), _SM90_BASE
        if plan.stream_k is not None and plan.stream_k.chunk:
            workspace, sk_patches = _stream_k_workspace(plan, q.device, stream)
            patches += sk_patches
    if plan.splits > 1:
        _launch_split(var, plan.combine, plan.grid, params, q, plan.splits, stream, patches, base)
    else:
        var.kernel.launch(plan.grid, var.block, var.smem, stream, params, patches, base)
    del workspace  # once the launch is queued: the allocator reuses it only after, in stream order
    return out, lse


def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: FwdTiling | None = None,
    pack_gqa: bool | None = None,
    num_splits: int = 0,
    dropout_p: float = 0.0,
    rng_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward attention on validated inputs; returns (out, softmax_lse).

    q (b, sq, h, d), k/v (b, sk, hk, d), last dim contiguous; `window_size` uses -1 for an unbounded side and
    `causal` is exclusive with a finite window (validate normalises both). softmax_lse is (b, h, sq) float32,
    +inf for rows that see no key. With cu_seqlens_q/k (int32, batch + 1 row offsets) the batch is packed:
    q (total_q, h, d), k/v (total_k, hk, d), softmax_lse (h, total_q); with a block_table (batch, pages; int32) as
    well, k/v are a paged cache (num_blocks, page_size, hk, d) holding entry b's cu_seqlens_k[b+1] -
    cu_seqlens_k[b] keys in its pages. `out`, when given, is written in place (shape of q, last dim contiguous).
    `config` forces a tiling (benchmarks, the tuner); ValueError if it cannot run this key. `pack_gqa` forces
    pack-GQA on or off for dense batches (None: where fwd_tilings.pack_gqa_pays says so). `num_splits` > 1
    splits a dense batch's keys over that many CTAs per query tile (then a combine kernel merges them), 1 never
    splits, 0 splits where few query tiles leave SMs idle (_split_plan; not when `config` or `pack_gqa` is forced).
    `dropout_p` > 0 drops probabilities with keep decisions drawn from `rng_state[0]` (int64; flash_gen.ops.fwd)
    (neither pack-GQA nor splits then). The plan is kept per argument layout (_plans).
    """
    lookup = (layout(q), layout(k), layout(v), None if out is None else out.stride(), softmax_scale, causal,
              window_size, softcap, layout(alibi_slopes), layout(cu_seqlens_q), layout(block_table), config,
              pack_gqa, num_splits, dropout_p)
    plan = _plans.get(lookup)
    if plan is None:
        plan = _plans.put(lookup, plan_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                           window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                           cu_seqlens_q=cu_seqlens_q, block_table=block_table, out=out,
                                           config=config, pack_gqa=pack_gqa, num_splits=num_splits,
                                           dropout_p=dropout_p))
    return run_fwd(plan, q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, block_table, out, rng_state=rng_state)


# attention_fwd's plans by argument layout (all plan_fwd reads): planning walks the tiling chain and the split
# heuristic, ~100 µs a call, which the int-length KV-cache route and the varlen paged op would pay every step.
_plans: BoundedMemo = BoundedMemo(256)


def _sm90_params(plan: FwdPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor) -> Sm90FwdParams:
    """The Hopper kernel's parameter template: 5-D TMA maps of q and out (boxes of a consumer warpgroup's rows: 64
    positions of one head, or packed 64 // group positions of a group's heads) and 4-D ones of k and v (a key
    tile's rows), all boxes as wide as a swizzle row of the computed head dim, then the plan's FwdParams, kept per
    plan and address set (tma.params_with_maps)."""
    var = plan.var
    group = q.shape[-2] // k.shape[-2] if var.pack_gqa else 1
    positions, rows = ROWS_PER_CONSUMER // group, var.cfg.block_n // var.cfg.cluster  # a CTA's share of K/V tiles
    stream_k = plan.stream_k

    def fill(params: Sm90FwdParams) -> None:
        params.section_pairs = plan.section_pairs
        if var.cfg.align:
            params.qk_shift_bits, params.v_shift_bits = _row_shift_bits(k), _row_shift_bits(v)
        if stream_k is not None:
            params.sk_rounds, params.sk_tiles = stream_k.rounds, stream_k.left
            params.sk_steps, params.sk_chunk = stream_k.steps, stream_k.chunk

    return tma.params_with_maps(Sm90FwdParams, plan.params or plan.shape.params, plan.maps,
                                (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()),
                                (("tma_q", q, positions, group), ("tma_k", k, rows), ("tma_v", v, rows),
                                 ("tma_o", out, positions, group)), var.box_cols, fill)


def _row_shift_bits(t: torch.Tensor) -> int:
    """Sm90FwdParams.qk_shift_bits / v_shift_bits of K or V (b, s, h, d), or packed (s, h, d): bit 0 when head 0's
    rows start 16 bytes into a 32-byte sector, bit 1 when the head stride moves the next head's by 16 more; 0 when
    the sequence or batch stride is not a whole number of sectors (the offset would then change from row to row)."""
    t = t if t.dim() == 4 else t[None]
    size = t.element_size()
    b, s = t.shape[0], t.shape[1]
    if (s > 1 and t.stride(1) * size % 32) or (b > 1 and t.stride(0) * size % 32):
        return 0
    return int(t.data_ptr() % 32 == 16) | int(t.stride(2) * size % 32 == 16) << 1


def _stream_k_workspace(plan: FwdPlan, device: torch.device,
                        stream: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A stream-K launch's fp32 partials in one allocation (a query tile of the computed head dim per CTA, then
    its lse rows), and the patches pointing the kernel at them and at the stream's flags."""
    sk, cfg = plan.stream_k, plan.var.cfg
    rows = sk.ctas * cfg.block_m
    partials = torch.empty(rows * (plan.var.head_dim + 1), dtype=torch.float32, device=device)
    flags = _stream_k_flags(device, stream, sk.ctas * cfg.consumers)
    base = partials.data_ptr()
    return partials, (_OFF_O_PARTIAL, base, _OFF_LSE_PARTIAL, base + 4 * rows * plan.var.head_dim, _OFF_SK_FLAGS,
                      flags.data_ptr())


def _stream_k_flags(device: torch.device, stream: int, count: int) -> torch.Tensor:
    """Stream-K flags (fwd_sm90.cuh, sk_arrive_written): zeroed once per device and stream, every launch leaving
    them at multiples of 256, so launches in stream order share them. A launch captured into a CUDA graph gets its
    own, which the graph zeroes at every replay (the graph may replay on any stream, beside eager launches)."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(count, dtype=torch.int32, device=device)
    flags = _sk_flags.get((device.index, stream))
    if flags is None or flags.numel() < count:
        flags = _sk_flags[(device.index, stream)] = torch.zeros(count, dtype=torch.int32, device=device)
    return flags


_sk_flags: dict[tuple[int, int], torch.Tensor] = {}


def _launch_split(var: _Variant, combine: driver.Kernel, grid: tuple[int, int, int], params: ctypes.Structure,
                  q: torch.Tensor, splits: int, stream: int, patches: tuple[int, ...] = (), base: int = 0) -> None:
    """A split-KV launch (each CTA writes its share of the keys' fp32 partial O and lse) and the combine kernel
    that merges them into out and lse. `params` (FwdParams, or the Hopper struct with FwdParams at `base`) holds
    num_splits and, with `patches`, the call's addresses."""
    batch, seqlen_q, nheads, head_dim = q.shape
    f32 = dict(dtype=torch.float32, device=q.device)
    o_partial = torch.empty((splits, batch, nheads, seqlen_q, head_dim), **f32)
    lse_partial = torch.empty((splits, batch, nheads, seqlen_q), **f32)
    patches += (_OFF_O_PARTIAL, o_partial.data_ptr(), _OFF_LSE_PARTIAL, lse_partial.data_ptr())
    var.kernel.launch(grid, var.block, var.smem, stream, params, patches, base)
    fwd_params = params.base if base else params  # the combine kernel takes FwdParams alone
    rows_per_cta = _COMBINE_WARPS if seqlen_q >= _COMBINE_WARPS else 1  # combine_warps_per_row in the kernel
    combine.launch((-(-seqlen_q // rows_per_cta), nheads, batch), (_COMBINE_THREADS, 1, 1), 0, stream, fwd_params,
                   patches)


_COMBINE_THREADS = 256  # kCombineThreads in templates/include/flash_gen/fwd_combine.cuh
_COMBINE_WARPS = _COMBINE_THREADS // 32
_MAX_SPLITS = 128


def choose_num_splits(ctas: int, key_tiles: int, slots: int) -> int:
    """Split-KV heuristic: split only when the CTAs without splitting leave resident slots (SMs x CTAs per SM)
    idle, then into as many splits as fill one wave without starting a second, keeping at least two key tiles
    per split (each split costs a partial write and a read in the combine)."""
    if ctas >= slots:
        return 1
    return max(1, min(slots // ctas, key_tiles // 2, _MAX_SPLITS))


def _combine_kernel(device: int, dtype: str) -> driver.Kernel:
    arch = driver.device_arch(device)
    return loader.get_kernel(lambda: render_combine(arch, dtype), combine_entry(arch, dtype), arch, 0, device)


class _Shape:
    """What a call's shapes, strides and score arguments fix: the parameter struct without tensor addresses (a
    repeated shape copies it instead of setting ~30 ctypes fields) and softmax_lse's shape."""

    __slots__ = ("params", "lse_shape")

    def __init__(self, params: FwdParams, lse_shape: tuple[int, ...]) -> None:
        self.params, self.lse_shape = params, lse_shape


_shapes: BoundedMemo = BoundedMemo(256)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_stride: tuple[int, ...], batch: int,
           seqlen_k: int, cache_fields: tuple[tuple[str, int], ...] = (), **score) -> _Shape:
    """The _Shape of a call whose output has strides `out_stride`; `cache_fields` (_cache_fields) set a KV
    cache's layout fields."""
    alibi = score["alibi_slopes"]
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), out_stride, batch, seqlen_k, cache_fields,
           score["causal"], score["window_size"], score["softmax_scale"], score["softcap"],
           None if alibi is None else alibi.stride())
    shape = _shapes.get(key)
    if shape is None:
        *lead_q, nheads, _ = q.shape
        seqlen_q, nheads_k, varlen = lead_q[-1], k.shape[-2], q.dim() == 3
        check_grid(batch, nheads)
        template = FwdParams()
        for prefix, t in (("q", q), ("k", k), ("v", v)):
            set_strides(template, prefix, t)
        o_strides = out_stride[:3] if len(out_stride) == 4 else (0, *out_stride[:2])
        template.o_batch_stride, template.o_row_stride, template.o_head_stride = o_strides
        template.lse_batch_stride, template.lse_head_stride = (0, seqlen_q) if varlen else (nheads * seqlen_q, seqlen_q)
        set_score_fields(template, batch=batch, nheads=nheads, nheads_k=nheads_k, seqlen_q=seqlen_q,
                         seqlen_k=seqlen_k, **score)
        template.head_dim = q.shape[-1]
        for name, value in cache_fields:
            setattr(template, name, value)
        lse_shape = (nheads, seqlen_q) if varlen else (batch, nheads, seqlen_q)
        shape = _shapes.put(key, _Shape(template, lse_shape))
    return shape


def _cache_fields(k: torch.Tensor, block_table: torch.Tensor | None) -> tuple[tuple[str, int], ...]:
    """A KV cache's FwdParams layout fields: its entries (or pages), rows per entry (or page) and the block table's
    row stride."""
    return (("kv_batches", k.shape[0]), ("page_size", k.shape[1]),
            ("block_table_stride", 0 if block_table is None else block_table.stride(0)))
