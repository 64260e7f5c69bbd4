"""Kernel-parameter fields that the forward and backward structs share: strides, masks and score scales.

Both FwdParams and BwdParams carry these under the same names, so one place turns validated user arguments
into the form the kernels compare and multiply with.
"""

from __future__ import annotations

import ctypes
import math

import torch

from flash_gen.spec import dropout_keep_threshold

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
MAX_GRID_YZ = 65535  # heads and batch index gridDim.y and gridDim.z
_LOG2E = math.log2(math.e)


def mask_kind(causal: bool, window_size: tuple[int, int]) -> str:
    """The kernel family for validated arguments: "causal", "local" (a finite window) or "none"."""
    if causal:
        return "causal"
    return "local" if window_size[0] >= 0 or window_size[1] >= 0 else "none"


def set_strides(p: ctypes.Structure, prefix: str, t: torch.Tensor) -> None:
    """p.<prefix>_{batch,row,head}_stride from a (batch, seqlen, heads, head_dim) tensor, or from a packed
    varlen (total_rows, heads, head_dim) one (batch stride 0: the kernels find rows through cu_seqlens)."""
    batch_stride, row_stride, head_stride = t.stride()[:3] if t.dim() == 4 else (0, *t.stride()[:2])
    setattr(p, f"{prefix}_batch_stride", batch_stride)
    setattr(p, f"{prefix}_row_stride", row_stride)
    setattr(p, f"{prefix}_head_stride", head_stride)


def varlen_tiles(total: int, batch: int, block: int) -> int:
    """Grid bound for a packed batch: sum over entries of ceil(len / block) never exceeds this."""
    return (total + batch * (block - 1)) // block


def set_score_fields(
    p: ctypes.Structure,
    *,
    batch: int,
    nheads: int,
    nheads_k: int,
    seqlen_q: int,
    seqlen_k: int,
    causal: bool,
    window_size: tuple[int, int],
    softmax_scale: float,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
) -> None:
    """Sizes, window bounds (an unbounded side becomes a bound past every key, so kernels compare plain
    integers), the base-2 score scales and the ALiBi slopes."""
    p.batch, p.nheads, p.nheads_k, p.seqlen_q, p.seqlen_k = batch, nheads, nheads_k, seqlen_q, seqlen_k
    left, right = window_size
    unbounded = seqlen_q + seqlen_k
    p.window_left = left if not causal and left >= 0 else unbounded
    p.window_right = 0 if causal else (right if right >= 0 else unbounded)
    if softcap > 0:
        p.score_scale = softmax_scale / softcap
        p.scale_log2 = softcap * _LOG2E
        p.alibi_scale = 1.0 / softcap
    else:
        p.score_scale = 1.0
        p.scale_log2 = softmax_scale * _LOG2E
        p.alibi_scale = 1.0 / softmax_scale
    if alibi_slopes is not None:
        p.alibi_slopes = alibi_slopes.data_ptr()
        p.alibi_batch_stride = alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0


def set_dropout_fields(p: ctypes.Structure, dropout_p: float) -> None:
    """Dropout's keep threshold and scale (the seed's address is patched in per call)."""
    p.dropout_threshold, p.dropout_scale = dropout_keep_threshold(dropout_p), 1.0 / (1.0 - dropout_p)


def check_grid(batch: int, nheads: int) -> None:
    if batch > MAX_GRID_YZ or nheads > MAX_GRID_YZ:
        raise ValueError(f"q: batch ({batch}) and nheads ({nheads}) must each be <= {MAX_GRID_YZ} (CUDA grid limit)")
