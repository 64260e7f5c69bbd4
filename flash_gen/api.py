"""The public, flash_attn 2.8-compatible entry points, differentiable through flash_gen.ops.

These functions check the plain-Python arguments (so errors name them before anything runs) and call one custom
op; tensors are validated inside the op, on real tensors, before any launch. That keeps them traceable by
torch.compile with fullgraph=True. Importing this module loads torch and flash_gen.ops only: never the
compiler, cuda.bindings or optuna.
"""

from __future__ import annotations

import torch

from flash_gen import ops
from flash_gen.validate import check_attn_args, check_varlen_args

_DOC_COMMON = """
    dropout_p must be 0 (dropout is not implemented: NotImplementedError otherwise). softmax_scale defaults to
    head_dim ** -0.5. causal and window_size=(left, right) mask keys with flash_attn's bottom-right alignment
    (query i sees key j iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, -1 meaning
    unbounded; causal sets right = 0). softcap > 0 applies softcap * tanh(scores / softcap). alibi_slopes
    (float32, (nheads,) or (batch, nheads)) adds -slope * |i + seqlen_k - seqlen_q - j| to the scores. Rows that
    see no key output 0 (and get zero gradients). deterministic=True makes the backward pass bitwise
    reproducible (the forward always is). return_attn_probs=True raises NotImplementedError.

    fp16 or bf16 on one CUDA device; stride 1 along head_dim (other strides are free); head_dim a multiple of 8
    up to 256; nheads a multiple of nheads_k (MQA/GQA: dK/dV are summed over the query heads of each KV head).
    Differentiable (autograd, torch.compile(fullgraph=True), CUDA graphs). Raises TypeError / ValueError naming
    the offending argument (see flash_gen.validate).
"""


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor:
    attn = check_attn_args(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs)
    return ops.fwd(q, k, v, None, None, *attn)[0]


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor:
    attn = check_attn_args(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs)
    return ops.fwd_kvpacked(q, kv, None, None, *attn)[0]


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor:
    attn = check_attn_args(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs)
    return ops.fwd_qkvpacked(qkv, None, None, *attn)[0]


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | torch.Tensor | None = None,
    max_seqlen_k: int | torch.Tensor | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    attn = check_attn_args(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs)
    check_varlen_args(max_seqlen_q, max_seqlen_k, block_table)
    return ops.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, *attn)[0]


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | torch.Tensor | None = None,
    max_seqlen_k: int | torch.Tensor | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor:
    attn = check_attn_args(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs)
    check_varlen_args(max_seqlen_q, max_seqlen_k, None)
    return ops.fwd_kvpacked(q, kv, cu_seqlens_q, cu_seqlens_k, *attn)[0]


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | torch.Tensor | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor:
    attn = check_attn_args(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs)
    check_varlen_args(max_seqlen, max_seqlen, None)
    return ops.fwd_qkvpacked(qkv, cu_seqlens, cu_seqlens, *attn)[0]


_DOC_VARLEN = """
    Ragged batch packed along one row axis: entry b owns rows cu_seqlens[b]:cu_seqlens[b + 1] (int32 tensors of
    batch + 1 offsets on q's device; zero-length entries allowed). max_seqlen_* are accepted for flash_attn
    compatibility and never needed: pass an int, a tensor or None; the kernels find every entry's length on the
    device, so a step stays free of host syncs (CUDA graphs, torch.compile). alibi_slopes (batch, nheads) index
    the entries. Under FLASH_GEN_DEBUG=1 the offsets' values are checked on the host too.
"""

flash_attn_func.__doc__ = """Attention over q (batch, seqlen_q, nheads, head_dim) and k, v (batch, seqlen_k,
    nheads_k, head_dim); returns the output shaped and typed like q.""" + _DOC_COMMON
flash_attn_kvpacked_func.__doc__ = """Attention over q (batch, seqlen_q, nheads, head_dim) and kv (batch, seqlen_k,
    2, nheads_k, head_dim) holding k and v; returns the output shaped like q. kv's gradient is one tensor.""" + _DOC_COMMON
flash_attn_qkvpacked_func.__doc__ = """Self-attention over qkv (batch, seqlen, 3, nheads, head_dim) holding q, k and
    v; returns the output (batch, seqlen, nheads, head_dim). qkv's gradient is one tensor.""" + _DOC_COMMON
flash_attn_varlen_func.__doc__ = """Attention over a packed ragged batch: q (total_q, nheads, head_dim), k and v
    (total_k, nheads_k, head_dim); returns the output shaped like q. block_table (paged KV) raises
    NotImplementedError for now.""" + _DOC_VARLEN + _DOC_COMMON
flash_attn_varlen_kvpacked_func.__doc__ = """As flash_attn_varlen_func with kv (total_k, 2, nheads_k, head_dim) holding
    k and v; kv's gradient is one tensor.""" + _DOC_VARLEN + _DOC_COMMON
flash_attn_varlen_qkvpacked_func.__doc__ = """Self-attention over a packed ragged batch qkv (total, 3, nheads,
    head_dim) with one cu_seqlens; returns (total, nheads, head_dim). qkv's gradient is one tensor.""" + (
    _DOC_VARLEN + _DOC_COMMON)
