"""Launch the backward pass: preprocess (rowsum(dO*O), lse in base 2, zeroed dQ accumulator), the main kernel
(dK, dV, and dQ accumulated in fp32), then the dQ conversion. Three launches on PyTorch's current stream, no
host synchronisation, every buffer from PyTorch's caching allocator (so CUDA graphs capture it).

Inputs arrive validated and normalised by flash_gen.validate. Must not import optuna.
"""

from __future__ import annotations

import ctypes

import torch

from flash_gen import bwd_tilings, settings
from flash_gen.bwd_tilings import BwdTiling
from flash_gen.gen.render import bwd_aux_prefix, entry_name, render_bwd_aux, render_many
from flash_gen.memo import BoundedMemo
from flash_gen.runtime import driver, loader, tma
from flash_gen.runtime.score_params import (
    DTYPES,
    check_grid,
    mask_kind,
    set_dropout_fields,
    set_score_fields,
    set_strides,
    varlen_tiles,
)
from flash_gen.spec import bucket_name
from flash_gen.spec_bwd import BwdKey
from flash_gen.spec_bwd_sm90 import Sm90BwdConfig, sm90_bwd_box_cols, sm90_bwd_dq_box_cols

_AUX_THREADS, _AUX_ROWS = 128, 32  # kAuxThreads, kAuxRows in templates/include/flash_gen/bwd_aux.cuh


class BwdParams(ctypes.Structure):
    """Mirror of flash_gen::BwdParams (templates/include/flash_gen/bwd_params.cuh): keep the two in step."""

    _fields_ = (
        [(name, ctypes.c_void_p) for name in ("q", "k", "v", "o", "dout", "dq", "dk", "dv")]
        + [
            (name, ctypes.c_void_p)
            for name in ("lse", "lse_log2", "dsum", "dq_accum", "dq_semaphore", "alibi_slopes", "cu_seqlens_q",
                         "cu_seqlens_k")
        ]
        + [
            (f"{t}_{s}_stride", ctypes.c_int64)
            for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv")
            for s in ("batch", "row", "head")
        ]
        + [
            (name, ctypes.c_int64)
            for name in ("alibi_batch_stride", "lse_batch_stride", "lse_head_stride", "acc_batch_stride",
                         "acc_head_stride")
        ]
        + [
            (name, ctypes.c_int)
            for name in (
                "batch", "nheads", "nheads_k", "seqlen_q", "seqlen_k", "block_m", "head_dim", "dq_accum_cols",
                "window_left", "window_right",
            )
        ]
        + [(name, ctypes.c_float) for name in ("score_scale", "scale_log2", "alibi_scale", "softmax_scale")]
        + [("dropout_threshold", ctypes.c_uint), ("dropout_scale", ctypes.c_float), ("rng_state", ctypes.c_void_p)]
    )


class Sm90BwdParams(ctypes.Structure):
    """Mirror of flash_gen::Sm90BwdParams (templates/include/flash_gen/bwd_sm90_params.cuh): TMA maps of q, dout
    and dq_accum, then BwdParams, padded to the maps' 64-byte alignment as the C++ struct is."""

    _fields_ = [(name, ctypes.c_uint8 * tma.MAP_BYTES) for name in ("tma_q", "tma_do", "tma_dq")] + [
        ("base", BwdParams)]
    _fields_.append(("_pad", ctypes.c_uint8 * (-(3 * tma.MAP_BYTES + ctypes.sizeof(BwdParams)) % tma.MAP_ALIGN)))


# Byte offsets of the per-call addresses in BwdParams (attention_bwd patches them into the shape's template),
# and of BwdParams inside the Hopper struct.
(_OFF_Q, _OFF_K, _OFF_V, _OFF_O, _OFF_DO, _OFF_DQ, _OFF_DK, _OFF_DV, _OFF_LSE, _OFF_LSE_LOG2, _OFF_DSUM,
 _OFF_DQ_ACCUM, _OFF_SEMAPHORE, _OFF_ALIBI, _OFF_CU_Q, _OFF_CU_K) = (
    getattr(BwdParams, f).offset for f in ("q", "k", "v", "o", "dout", "dq", "dk", "dv", "lse", "lse_log2", "dsum",
                                           "dq_accum", "dq_semaphore", "alibi_slopes", "cu_seqlens_q",
                                           "cu_seqlens_k"))
_OFF_RNG_STATE = BwdParams.rng_state.offset
_SM90_BASE = Sm90BwdParams.base.offset


class _Variant:
    """The main kernel of one backward key with its tiling, plus the dtype's two helper kernels. Hopper tilings: the
    columns of a Q/dO TMA box (one swizzle row: 64, or 32 at head dim 96) and of a bulk dQ box (32 fp32, or 16)."""

    __slots__ = ("main", "preprocess", "convert_dq", "cfg", "smem", "head_dim_mma", "box_cols", "dq_box_cols")

    def __init__(self, key: BwdKey, cfg: BwdTiling, device: int) -> None:
        self.cfg, self.smem, self.head_dim_mma = cfg, bwd_tilings.smem_bytes(key, cfg), bwd_tilings.head_dim_mma(key, cfg)
        hopper = isinstance(cfg, Sm90BwdConfig)
        self.box_cols = sm90_bwd_box_cols(self.head_dim_mma) if hopper else 0
        self.dq_box_cols = sm90_bwd_dq_box_cols(self.head_dim_mma) if hopper else 0
        self.main = loader.get_kernel(lambda: render_many([(key, cfg)]), entry_name(key, cfg), key.arch, self.smem,
                                      device)
        prefix = bwd_aux_prefix(key.arch, key.dtype)
        aux_source = lambda: render_bwd_aux(key.arch, key.dtype)  # noqa: E731
        self.preprocess = loader.get_kernel(aux_source, f"{prefix}_preprocess", key.arch, 0, device)
        self.convert_dq = loader.get_kernel(aux_source, f"{prefix}_convert_dq", key.arch, 0, device)


_variants: dict[tuple, _Variant] = {}


def _forced_config(key: BwdKey) -> BwdTiling | None:
    """FLASH_GEN_BWD_CONFIG where it is feasible for `key`."""
    forced = settings.bwd_config()
    cfg = bwd_tilings.config_from_name(forced) if forced else None
    return cfg if cfg is not None and bwd_tilings.infeasible_reason(key, cfg) is None else None


def _variant(device: int, dtype: str, head_dim: int, mask: str, softcap: bool, alibi: bool, varlen: bool,
             deterministic: bool, config: BwdTiling | None, bucket: str, dropout: bool = False) -> _Variant:
    lookup = (device, dtype, head_dim, mask, softcap, alibi, varlen, deterministic, config, bucket, dropout)
    var = _variants.get(lookup)
    if var is None:
        key = BwdKey(driver.device_arch(device), dtype, head_dim, mask, softcap, alibi, varlen, deterministic,
                     dropout)
        cfg = config or _forced_config(key) or loader.tuned_config(key, bucket) or loader.spill_free_config(key)
        why = bwd_tilings.infeasible_reason(key, cfg)
        if why is not None:
            raise ValueError(f"config: {cfg.name} cannot run {key.name}: {why}")
        var = _variants[lookup] = _Variant(key, cfg, device)
    return var


class _Shape:
    """What a call's shapes, strides and score arguments fix: the parameter struct without addresses (a repeated
    shape copies it instead of setting ~40 ctypes fields), the three grids and the fp32 buffers' layout."""

    __slots__ = ("params", "grids", "part", "rows", "maps")

    def __init__(self, params: BwdParams, grids: list[tuple[int, int, int]], part: int, rows: int) -> None:
        self.params, self.grids, self.part, self.rows = params, grids, part, rows
        self.maps = BoundedMemo(tma.MAPS_PER_SHAPE)  # the Hopper kernel's encoded TMA maps per address set


_shapes: BoundedMemo = BoundedMemo(256)


def _shape(var: _Variant, tensors: tuple[tuple[str, torch.Tensor], ...], lse: torch.Tensor, batch: int,
           varlen: bool, dropout_p: float, **score) -> _Shape:
    q, k = tensors[0][1], tensors[1][1]
    *lead_q, nheads, head_dim = q.shape
    *lead_k, nheads_k, _ = k.shape
    seqlen_q, seqlen_k = lead_q[-1], lead_k[-1]  # the totals when varlen
    check_grid(batch, max(nheads, nheads_k))
    block_m, cols = var.cfg.block_m, var.head_dim_mma
    p = BwdParams()
    for prefix, t in tensors:
        set_strides(p, prefix, t)
    set_score_fields(p, batch=batch, nheads=nheads, nheads_k=nheads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k, **score)
    p.block_m, p.head_dim, p.dq_accum_cols = block_m, head_dim, cols
    p.softmax_scale = score["softmax_scale"]
    if dropout_p > 0:
        set_dropout_fields(p, dropout_p)
    p.lse_batch_stride, p.lse_head_stride = (0, lse.stride(0)) if varlen else lse.stride()[:2]
    # Row-padded fp32 buffers (acc_row0 in bwd_params.cuh), (batch, nheads, rows rounded up to block_m) or
    # (nheads, total_q + batch * block_m): lse_log2, dsum and dq_accum (dq_accum_cols per row) in one allocation
    # (the host cost is per tensor), each part 256-byte aligned for vector accesses.
    head_rows = seqlen_q + batch * block_m if varlen else -(-seqlen_q // block_m) * block_m
    p.acc_batch_stride, p.acc_head_stride = (0 if varlen else nheads * head_rows), head_rows
    rows = (1 if varlen else batch) * nheads * head_rows
    if varlen:  # grid-x bounds: each entry's padded rows (preprocess), key tiles (main), rows (convert)
        grids = [(-(-(seqlen_q + batch * (block_m - 1)) // _AUX_ROWS), nheads, 1),
                 (varlen_tiles(seqlen_k, batch, var.cfg.block_n), nheads_k, 1),
                 (varlen_tiles(seqlen_q, batch, _AUX_ROWS), nheads, 1)]
    else:
        grids = [(-(-head_rows // _AUX_ROWS), nheads, batch),  # block_m 80: not whole _AUX_ROWS blocks
                 (-(-seqlen_k // var.cfg.block_n), nheads_k, batch),
                 (-(-seqlen_q // _AUX_ROWS), nheads, batch)]
    return _Shape(p, grids, -(-rows // 64) * 64, rows)


def attention_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    config: BwdTiling | None = None,
    dropout_p: float = 0.0,
    rng_state: torch.Tensor | None = None,
) -> None:
    """Write the gradients of attention into dq, dk, dv (shaped like q, k, v; last dim contiguous, any other
    strides, e.g. views of one packed gradient). dout and out are shaped like q, lse is the forward's float32
    softmax_lse. Arguments as for runtime.fwd.attention_fwd (packed batches included); `deterministic` orders the
    dQ accumulation so repeated runs give bitwise-equal gradients; `dropout_p` > 0 with the forward's `rng_state`
    redraws its keep decisions."""
    varlen = cu_seqlens_q is not None
    batch = cu_seqlens_q.numel() - 1 if varlen else q.shape[0]
    var = _variant(q.device.index, DTYPES[q.dtype], q.shape[-1], mask_kind(causal, window_size), softcap > 0,
                   alibi_slopes is not None, varlen, deterministic, config, bucket_name("bwd", k.shape[-3]),
                   dropout_p > 0)
    tensors = (("q", q), ("k", k), ("v", v), ("o", out), ("do", dout), ("dq", dq), ("dk", dk), ("dv", dv))
    lookup = (var, batch, *(t.shape for t in (q, k)), *(t.stride() for _, t in tensors), lse.stride(), causal,
              window_size, softmax_scale, softcap, None if alibi_slopes is None else alibi_slopes.stride(), dropout_p)
    shape = _shapes.get(lookup)
    if shape is None:
        shape = _shapes.put(lookup, _shape(var, tensors, lse, batch, varlen, dropout_p, causal=causal,
                                           window_size=window_size, softmax_scale=softmax_scale, softcap=softcap,
                                           alibi_slopes=alibi_slopes))
    f32 = q.new_empty((2 * shape.part + shape.rows * var.head_dim_mma,), dtype=torch.float32)
    base = f32.data_ptr()
    # The shape's template with this call's addresses patched in at launch (driver.Kernel.launch).
    patches = (_OFF_Q, q.data_ptr(), _OFF_K, k.data_ptr(), _OFF_V, v.data_ptr(), _OFF_O, out.data_ptr(), _OFF_DO,
               dout.data_ptr(), _OFF_DQ, dq.data_ptr(), _OFF_DK, dk.data_ptr(), _OFF_DV, dv.data_ptr(), _OFF_LSE,
               lse.data_ptr(), _OFF_LSE_LOG2, base, _OFF_DSUM, base + 4 * shape.part, _OFF_DQ_ACCUM,
               base + 8 * shape.part)
    if deterministic:
        semaphore = torch.empty(shape.rows, dtype=torch.int32, device=q.device)
        patches += (_OFF_SEMAPHORE, semaphore.data_ptr())
    if alibi_slopes is not None:
        patches += (_OFF_ALIBI, alibi_slopes.data_ptr())
    if varlen:
        patches += (_OFF_CU_Q, cu_seqlens_q.data_ptr(), _OFF_CU_K, cu_seqlens_k.data_ptr())
    if rng_state is not None:
        patches += (_OFF_RNG_STATE, rng_state.data_ptr())

    stream = torch._C._cuda_getCurrentRawStream(q.device.index)  # no Stream object per call
    aux_block = (_AUX_THREADS, 1, 1)
    var.preprocess.launch(shape.grids[0], aux_block, 0, stream, shape.params, patches)
    main_block = (var.cfg.num_threads, 1, 1)
    if isinstance(var.cfg, Sm90BwdConfig):  # TMA maps: Q and dO by query tile, and (bulk dQ) dq_accum
        rows, d, bulk = var.cfg.block_m, var.head_dim_mma, var.cfg.dq_bulk

        def maps() -> tuple[tuple, ...]:
            q_do = (("tma_q", q, rows), ("tma_do", dout, rows))
            if not bulk:
                return q_do
            dq_accum = f32[2 * shape.part:2 * shape.part + shape.rows * d].view(1, shape.rows, 1, d)
            return (*q_do, ("tma_dq", dq_accum, var.cfg.dq_box_rows, None, var.dq_box_cols))

        main = tma.params_with_maps(Sm90BwdParams, shape.params, shape.maps,
                                    (var, q.data_ptr(), dout.data_ptr(), base if bulk else 0), maps, var.box_cols)
        var.main.launch(shape.grids[1], main_block, var.smem, stream, main, patches, _SM90_BASE)
    else:
        var.main.launch(shape.grids[1], main_block, var.smem, stream, shape.params, patches)
    var.convert_dq.launch(shape.grids[2], aux_block, 0, stream, shape.params, patches)
