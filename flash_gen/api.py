"""The public, flash_attn 2.8-compatible entry points, differentiable through flash_gen.ops.

These functions check the plain-Python arguments (so errors name them before anything runs) and call one custom
op; tensors are validated inside the op, on real tensors, before any launch. That keeps them traceable by
torch.compile with fullgraph=True. Importing this module loads torch and flash_gen.ops only: never the
compiler, cuda.bindings or optuna.
"""

from __future__ import annotations

import torch

from flash_gen import ops
from flash_gen.validate import check_attn_args, check_flag, check_varlen_args

_DOC_COMMON = """
    dropout_p in [0, 1): the softmax probabilities are dropped with that probability and the kept ones scaled by
    1 / (1 - dropout_p) before P V (softmax_lse is that of all scores); the keep decisions come from a seed drawn
    with PyTorch's CUDA generator (torch.manual_seed reproduces them) and the backward redraws the same ones.
    softmax_scale defaults to
    head_dim ** -0.5. causal and window_size=(left, right) mask keys with flash_attn's bottom-right alignment
    (query i sees key j iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, -1 meaning
    unbounded; causal sets right = 0). softcap > 0 applies softcap * tanh(scores / softcap). alibi_slopes
    (float32, (nheads,) or (batch, nheads)) adds -slope * |i + seqlen_k - seqlen_q - j| to the scores. Rows that
    see no key output 0 (and get zero gradients). deterministic=True makes the backward pass bitwise
    reproducible (the forward always is). return_attn_probs=True returns (out, softmax_lse, None), as flash_attn does
    without dropout (with dropout flash_attn's third output is a test-only probability tensor; flash_gen's is None):
    softmax_lse float32, (batch, nheads, seqlen_q) or, packed, (nheads, total_q); the natural-log
    logsumexp of each query row's scores after scale, softcap and ALiBi (+inf for rows that see no key), not
    differentiable.

    fp16 or bf16 on one CUDA device; stride 1 along head_dim (other strides are free); head_dim a multiple of 8
    up to 256; nheads a multiple of nheads_k (MQA/GQA: dK/dV are summed over the query heads of each KV head).
    Differentiable (autograd, torch.compile(fullgraph=True), CUDA graphs). Raises TypeError / ValueError naming
    the offending argument (see flash_gen.validate).
"""


def _outputs(outputs: tuple[torch.Tensor, torch.Tensor],
             return_attn_probs: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
    """out, or with return_attn_probs (out, softmax_lse, None): flash_attn returns probabilities only with dropout,
    for its tests; flash_gen returns none."""
    return (outputs[0], outputs[1], None) if return_attn_probs else outputs[0]


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
    attn = check_attn_args(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs)
    return _outputs(ops.call(ops.fwd, q, k, v, None, None, *attn, ops.dropout_seed(q, attn[-1])), return_attn_probs)


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
    attn = check_attn_args(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs)
    return _outputs(ops.call(ops.fwd_kvpacked, q, kv, None, None, *attn, ops.dropout_seed(q, attn[-1])),
                    return_attn_probs)


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
    attn = check_attn_args(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs)
    return _outputs(ops.call(ops.fwd_qkvpacked, qkv, None, None, *attn, ops.dropout_seed(qkv, attn[-1])),
                    return_attn_probs)


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
    attn = check_attn_args(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs)
    check_varlen_args(max_seqlen_q, max_seqlen_k)
    if block_table is not None:  # paged K/V: inference only
        if attn[-1] > 0:
            raise NotImplementedError("dropout_p: not with block_table (a paged K/V cache serves inference; no "
                                      "dropout)")
        outputs = ops.call(ops.fwd_varlen_paged, q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, *attn[:-2])
        return _outputs(outputs, return_attn_probs)
    return _outputs(ops.call(ops.fwd, q, k, v, cu_seqlens_q, cu_seqlens_k, *attn, ops.dropout_seed(q, attn[-1])),
                    return_attn_probs)


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
    attn = check_attn_args(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs)
    check_varlen_args(max_seqlen_q, max_seqlen_k)
    return _outputs(ops.call(ops.fwd_kvpacked, q, kv, cu_seqlens_q, cu_seqlens_k, *attn,
                             ops.dropout_seed(q, attn[-1])), return_attn_probs)


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
    attn = check_attn_args(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs)
    check_varlen_args(max_seqlen, max_seqlen)
    return _outputs(ops.call(ops.fwd_qkvpacked, qkv, cu_seqlens, cu_seqlens, *attn,
                             ops.dropout_seed(qkv, attn[-1])), return_attn_probs)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (batch, seqlen_q, nheads, head_dim) over a KV cache, flash_attn 2.8's decoding entry point.

    k_cache/v_cache: (batch_cache, seqlen_cache, nheads_k, head_dim), or with block_table (batch, pages per
    entry; int32) a paged cache (num_blocks, page_size, nheads_k, head_dim) with any page_size >= 1. Entry b uses
    cache rows [cache_leftpad[b], cache_seqlens[b] + seqlen_new) (cache_seqlens an int32 tensor or an int; None:
    the whole cache) of cache entry cache_batch_idx[b] (default b). k/v (batch, seqlen_new, nheads_k, head_dim),
    when given, are written into the cache in place at rows cache_seqlens[b] + i first; rotary_cos/sin
    (seqlen_ro, rotary_dim / 2) rotate q and the new keys at those positions (q at cache_seqlens[b] + i under a
    causal or local mask, else all at cache_seqlens[b]), interleaved (GPT-J) or not (GPT-NeoX). Masks are aligned
    to each entry's last key as in flash_attn_func. num_splits > 1 shares each query tile's keys among that many
    CTAs (split-KV) whose partial results a combine kernel merges; 0 picks it from the shape. Returns out, and
    softmax_lse (batch, nheads, seqlen_q) when return_softmax_lse. No gradient. Raises TypeError / ValueError /
    NotImplementedError naming the offending argument; FLASH_GEN_DEBUG=1 also checks index values on the host.
    """
    softmax_scale, causal, left, right, softcap, alibi_slopes, *_ = check_attn_args(
        0.0, softmax_scale, causal, window_size, softcap, alibi_slopes, False, False)
    tensor_seqlens = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    int_seqlens = -1 if cache_seqlens is None or tensor_seqlens is not None else cache_seqlens
    if not isinstance(int_seqlens, int) or isinstance(int_seqlens, bool) or (int_seqlens < 0 and int_seqlens != -1):
        raise TypeError(f"cache_seqlens: expected an int32 tensor or an int >= 0, got {cache_seqlens!r}")
    interleaved, with_lse = check_flag("rotary_interleaved", rotary_interleaved), check_flag(
        "return_softmax_lse", return_softmax_lse)
    out, lse = ops.call(ops.fwd_kvcache, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, tensor_seqlens,
                        int_seqlens, cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, left, right,
                        softcap, interleaved, alibi_slopes, num_splits)
    return (out, lse) if with_lse else out


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from the results over each: out (batch, seqlen, nheads,
    head_dim) and lse (batch, nheads, seqlen) as flash_attn returns them (or out (total, nheads, head_dim) with
    lse (nheads, total) for packed batches). lse = log(exp(lse_a) + exp(lse_b)), out = exp(lse_a - lse) * out_a
    + exp(lse_b - lse) * out_b: the split-KV combine's math, for context parallelism and ring attention. A side
    with lse = -inf or +inf (no key) contributes nothing; rows with no key on either side get out 0, lse +inf.
    Computed in fp32; returns out in out_a's dtype and float32 lse."""
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if out_b.shape != out_a.shape:
        raise ValueError(f"out_b: shape {tuple(out_b.shape)} differs from out_a's {tuple(out_a.shape)}")
    expected = (out_a.shape[1], out_a.shape[0]) if out_a.dim() == 3 else (out_a.shape[0], out_a.shape[2],
                                                                          out_a.shape[1])
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name}: expected shape {expected} for out of shape {tuple(out_a.shape)}, got "
                             f"{tuple(t.shape)}")
    a, b = lse_a.float(), lse_b.float()
    a, b = (x.masked_fill(x == float("inf"), float("-inf")) for x in (a, b))  # "no key" either way
    top = torch.maximum(a, b)
    safe = top.masked_fill(top == float("-inf"), 0.0)
    wa, wb = torch.exp(a - safe), torch.exp(b - safe)
    total = wa + wb
    lse = (safe + torch.log(total)).masked_fill(total == 0, float("inf"))
    norm = total.masked_fill(total == 0, 1.0)
    # (b, h, s) weights -> (b, s, h, 1) next to out; packed: (h, t) -> (t, h, 1)
    to_out = (lambda w: w.transpose(0, 1)[..., None]) if out_a.dim() == 3 else (lambda w: w.transpose(1, 2)[..., None])
    out = to_out(wa / norm) * out_a.float() + to_out(wb / norm) * out_b.float()
    return out.to(out_a.dtype), lse


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
    (total_k, nheads_k, head_dim); returns the output shaped like q. With block_table (batch, pages per entry;
    int32), k and v are a paged KV cache (num_blocks, page_size, nheads_k, head_dim) of any page size, entry b's
    cu_seqlens_k[b+1] - cu_seqlens_k[b] keys in the pages its row lists; that form has no gradient.""" + (
    _DOC_VARLEN + _DOC_COMMON)
flash_attn_varlen_kvpacked_func.__doc__ = """As flash_attn_varlen_func with kv (total_k, 2, nheads_k, head_dim) holding
    k and v; kv's gradient is one tensor.""" + _DOC_VARLEN + _DOC_COMMON
flash_attn_varlen_qkvpacked_func.__doc__ = """Self-attention over a packed ragged batch qkv (total, 3, nheads,
    head_dim) with one cu_seqlens; returns (total, nheads, head_dim). qkv's gradient is one tensor.""" + (
    _DOC_VARLEN + _DOC_COMMON)
