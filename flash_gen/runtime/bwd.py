"""Launch the backward pass: preprocess (rowsum(dO*O), lse in base 2, zeroed dQ accumulator), the main kernel
(dK, dV, and dQ accumulated in fp32), then the dQ conversion. Three launches on PyTorch's current stream, no
host synchronisation, every buffer from PyTorch's caching allocator (so CUDA graphs capture it).

Inputs arrive validated and normalised by flash_gen.validate. Must not import optuna.
"""

from __future__ import annotations

import ctypes

import torch

from flash_gen.gen.render import bwd_aux_prefix, entry_name, render_bwd, render_bwd_aux
from flash_gen.runtime import driver, loader
from flash_gen.runtime.score_params import DTYPES, check_grid, mask_kind, set_score_fields, set_strides
from flash_gen.spec_bwd import (
    BwdConfig,
    BwdKey,
    bwd_head_dim_mma,
    bwd_infeasible_reason,
    bwd_smem_bytes,
    default_bwd_config,
)

_AUX_THREADS, _AUX_ROWS = 128, 32  # kAuxThreads, kAuxRows in templates/include/flash_gen/bwd_aux.cuh


class BwdParams(ctypes.Structure):
    """Mirror of flash_gen::BwdParams (templates/include/flash_gen/bwd_params.cuh): keep the two in step."""

    _fields_ = (
        [(name, ctypes.c_void_p) for name in ("q", "k", "v", "o", "dout", "dq", "dk", "dv")]
        + [(name, ctypes.c_void_p) for name in ("lse", "lse_log2", "dsum", "dq_accum", "dq_semaphore", "alibi_slopes")]
        + [
            (f"{t}_{s}_stride", ctypes.c_int64)
            for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv")
            for s in ("batch", "row", "head")
        ]
        + [("alibi_batch_stride", ctypes.c_int64)]
        + [
            (name, ctypes.c_int)
            for name in (
                "batch", "nheads", "nheads_k", "seqlen_q", "seqlen_k", "seqlen_q_rounded", "head_dim",
                "dq_accum_cols", "num_m_blocks", "window_left", "window_right",
            )
        ]
        + [(name, ctypes.c_float) for name in ("score_scale", "scale_log2", "alibi_scale", "softmax_scale")]
    )


class _Variant:
    """The main kernel of one backward key with its tiling, plus the dtype's two helper kernels."""

    __slots__ = ("main", "preprocess", "convert_dq", "cfg", "smem", "head_dim_mma")

    def __init__(self, key: BwdKey, cfg: BwdConfig, device: int) -> None:
        self.cfg, self.smem, self.head_dim_mma = cfg, bwd_smem_bytes(key, cfg), bwd_head_dim_mma(key, cfg)
        self.main = loader.get_kernel(lambda: render_bwd(key, cfg), entry_name(key, cfg), key.arch, self.smem, device)
        prefix = bwd_aux_prefix(key.arch, key.dtype)
        aux_source = lambda: render_bwd_aux(key.arch, key.dtype)  # noqa: E731
        self.preprocess = loader.get_kernel(aux_source, f"{prefix}_preprocess", key.arch, 0, device)
        self.convert_dq = loader.get_kernel(aux_source, f"{prefix}_convert_dq", key.arch, 0, device)


_variants: dict[tuple, _Variant] = {}


def _variant(device: int, dtype: str, head_dim: int, mask: str, softcap: bool, alibi: bool, deterministic: bool,
             config: BwdConfig | None) -> _Variant:
    lookup = (device, dtype, head_dim, mask, softcap, alibi, deterministic, config)
    var = _variants.get(lookup)
    if var is None:
        key = BwdKey(driver.device_arch(device), dtype, head_dim, mask, softcap, alibi, deterministic)
        cfg = config or default_bwd_config(key)
        why = bwd_infeasible_reason(key, cfg)
        if why is not None:
            raise ValueError(f"config: {cfg.name} cannot run {key.name}: {why}")
        var = _variants[lookup] = _Variant(key, cfg, device)
    return var


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
    config: BwdConfig | None = None,
) -> None:
    """Write the gradients of attention into dq, dk, dv (shaped like q, k, v; last dim contiguous, any other
    strides, e.g. views of one packed gradient). dout and out are shaped like q, lse is the forward's
    (b, h, sq) float32 softmax_lse. Arguments as for runtime.fwd.attention_fwd; `deterministic` orders the dQ
    accumulation so repeated runs give bitwise-equal gradients."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    check_grid(batch, max(nheads, nheads_k))
    mask = mask_kind(causal, window_size)
    var = _variant(q.device.index, DTYPES[q.dtype], head_dim, mask, softcap > 0, alibi_slopes is not None,
                   deterministic, config)
    block_m = var.cfg.block_m
    m_blocks = -(-seqlen_q // block_m)
    rows = m_blocks * block_m

    f32 = dict(dtype=torch.float32, device=q.device)
    lse_log2 = torch.empty((batch, nheads, rows), **f32)
    dsum = torch.empty((batch, nheads, rows), **f32)
    dq_accum = torch.empty((batch, nheads, rows, var.head_dim_mma), **f32)
    semaphore = torch.empty((batch, nheads, m_blocks), dtype=torch.int32, device=q.device) if deterministic else None

    p = BwdParams()
    tensors = (("q", q), ("k", k), ("v", v), ("o", out), ("do", dout), ("dq", dq), ("dk", dk), ("dv", dv))
    for prefix, t in tensors:
        setattr(p, "dout" if prefix == "do" else prefix, t.data_ptr())
        set_strides(p, prefix, t)
    p.lse, p.lse_log2, p.dsum, p.dq_accum = lse.data_ptr(), lse_log2.data_ptr(), dsum.data_ptr(), dq_accum.data_ptr()
    p.dq_semaphore = semaphore.data_ptr() if semaphore is not None else None
    set_score_fields(p, batch=batch, nheads=nheads, nheads_k=nheads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                     causal=causal, window_size=window_size, softmax_scale=softmax_scale, softcap=softcap,
                     alibi_slopes=alibi_slopes)
    p.seqlen_q_rounded, p.head_dim, p.dq_accum_cols, p.num_m_blocks = rows, head_dim, var.head_dim_mma, m_blocks
    p.softmax_scale = softmax_scale

    stream = torch.cuda.current_stream(q.device).cuda_stream
    aux_block = (_AUX_THREADS, 1, 1)
    var.preprocess.launch((-(-rows // _AUX_ROWS), nheads, batch), aux_block, 0, stream, p)
    n_blocks = -(-seqlen_k // var.cfg.block_n)
    var.main.launch((n_blocks, nheads_k, batch), (var.cfg.num_threads, 1, 1), var.smem, stream, p)
    var.convert_dq.launch((-(-seqlen_q // _AUX_ROWS), nheads, batch), aux_block, 0, stream, p)
