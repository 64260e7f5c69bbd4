"""Launch the forward attention kernel: pick the variant for a call, fill its parameter struct, launch.

Inputs arrive validated and normalised by flash_gen.validate. The per-call path is: one dict hit for the
loaded kernel (keyed by plain scalars), one ctypes struct, one cuLaunchKernel on PyTorch's current stream;
no host synchronisation. Must not import optuna.
"""

from __future__ import annotations

import ctypes

import torch

from flash_gen import settings
from flash_gen.gen.render import entry_name, render_fwd
from flash_gen.runtime import driver, loader
from flash_gen.runtime.score_params import (
    DTYPES,
    check_grid,
    mask_kind,
    set_score_fields,
    set_strides,
    varlen_tiles,
)
from flash_gen.spec import FwdConfig, FwdKey, config_from_name, default_config, infeasible_reason, smem_bytes


class FwdParams(ctypes.Structure):
    """Mirror of flash_gen::FwdParams (templates/include/flash_gen/fwd_params.cuh): keep the two in step."""

    _fields_ = (
        [(name, ctypes.c_void_p) for name in ("q", "k", "v", "o", "lse", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k")]
        + [
            (f"{t}_{s}_stride", ctypes.c_int64)
            for t in ("q", "k", "v", "o")
            for s in ("batch", "row", "head")
        ]
        + [(name, ctypes.c_int64) for name in ("alibi_batch_stride", "lse_batch_stride", "lse_head_stride")]
        + [
            (name, ctypes.c_int)
            for name in ("batch", "nheads", "nheads_k", "seqlen_q", "seqlen_k", "window_left", "window_right")
        ]
        + [(name, ctypes.c_float) for name in ("score_scale", "scale_log2", "alibi_scale")]
    )


class _Variant:
    """A loaded kernel with its launch shape, cached per (device, dtype, head dim, mask, features)."""

    __slots__ = ("kernel", "cfg", "smem", "block")

    def __init__(self, kernel: driver.Kernel, cfg: FwdConfig, smem: int) -> None:
        self.kernel, self.cfg, self.smem = kernel, cfg, smem
        self.block = (cfg.num_threads, 1, 1)


_variants: dict[tuple, _Variant] = {}


def _variant(
    device: int, dtype: str, head_dim: int, mask: str, softcap: bool, alibi: bool, varlen: bool,
    config: FwdConfig | None,
) -> _Variant:
    lookup = (device, dtype, head_dim, mask, softcap, alibi, varlen, config)
    var = _variants.get(lookup)
    if var is None:
        arch = driver.device_arch(device)
        key = FwdKey(arch, dtype, head_dim, mask, softcap, alibi, varlen)
        cfg = config or _config(key)
        why = infeasible_reason(key, cfg)
        if why is not None:
            raise ValueError(f"config: {cfg.name} cannot run {key.name}: {why}")
        smem = smem_bytes(key, cfg)
        kernel = loader.get_kernel(lambda: render_fwd(key, cfg), entry_name(key, cfg), arch, smem, device)
        var = _variants[lookup] = _Variant(kernel, cfg, smem)
    return var


def _config(key: FwdKey) -> FwdConfig:
    forced = settings.fwd_config()
    if forced is not None:
        cfg = config_from_name(forced)
        if infeasible_reason(key, cfg) is None:
            return cfg
    return default_config(key)


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
    out: torch.Tensor | None = None,
    config: FwdConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward attention on validated inputs; returns (out, softmax_lse).

    q (b, sq, h, d), k/v (b, sk, hk, d), last dim contiguous; `window_size` uses -1 for an unbounded side and
    `causal` is exclusive with a finite window (validate normalises both). softmax_lse is (b, h, sq) float32,
    +inf for rows that see no key. With cu_seqlens_q/k (int32, batch + 1 row offsets) the batch is packed:
    q (total_q, h, d), k/v (total_k, hk, d), softmax_lse (h, total_q). `out`, when given, is written in place
    (shape of q, last dim contiguous). `config` forces a tiling (benchmarks, the tuner); ValueError if it cannot
    run this key.
    """
    varlen = cu_seqlens_q is not None
    *lead_q, nheads, head_dim = q.shape
    *lead_k, nheads_k, _ = k.shape
    batch = cu_seqlens_q.numel() - 1 if varlen else q.shape[0]
    seqlen_q, seqlen_k = lead_q[-1], lead_k[-1]  # the totals when varlen
    check_grid(batch, nheads)
    mask = mask_kind(causal, window_size)
    var = _variant(q.device.index, DTYPES[q.dtype], head_dim, mask, softcap > 0, alibi_slopes is not None, varlen,
                   config)

    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse_shape = (nheads, seqlen_q) if varlen else (batch, nheads, seqlen_q)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)

    p = FwdParams()
    p.q, p.k, p.v, p.o, p.lse = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()
    for prefix, t in (("q", q), ("k", k), ("v", v), ("o", out)):
        set_strides(p, prefix, t)
    p.lse_batch_stride, p.lse_head_stride = (0, seqlen_q) if varlen else (nheads * seqlen_q, seqlen_q)
    set_score_fields(p, batch=batch, nheads=nheads, nheads_k=nheads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                     causal=causal, window_size=window_size, softmax_scale=softmax_scale, softcap=softcap,
                     alibi_slopes=alibi_slopes)

    if varlen:
        p.cu_seqlens_q, p.cu_seqlens_k = cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr()
        grid = (varlen_tiles(seqlen_q, batch, var.cfg.block_m), nheads, 1)
    else:
        grid = (-(-seqlen_q // var.cfg.block_m), nheads, batch)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    var.kernel.launch(grid, var.block, var.smem, stream, p)
    return out, lse
