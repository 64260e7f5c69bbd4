"""flash_gen's attention as PyTorch custom ops (torch.library), with fake kernels and autograd.

Three forward ops take q/k/v separately, k and v packed (kv: (b, sk, 2, hk, d)) or all three packed
(qkv: (b, s, 3, h, d)); each has a backward op whose gradient has the same packing, written by the kernels
straight into one allocation (no stack/cat copy, no zero fill). torch.compile traces the ops as opaque nodes
through their fake kernels, so a compiled graph runs exactly the kernels the eager call runs.

Every argument is validated inside the real implementations, on real tensors and before any launch; the public
functions in flash_gen.api only forward arguments, so tracing them needs no data pointers.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from flash_gen.validate import FwdArgs, check_bwd, check_packed, validate_fwd

# Trailing arguments every op takes, in this order: the attention's semantics plus the backward's dQ order.
# softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int, softcap: float,
# alibi_slopes: Optional[Tensor], deterministic: bool


def _validated(q: Tensor, k: Tensor, v: Tensor, softmax_scale, causal, window_left, window_right, softcap,
               alibi_slopes) -> FwdArgs:
    return validate_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
                        softcap=softcap, alibi_slopes=alibi_slopes)


def _runtime_kwargs(args: FwdArgs, alibi_slopes: Optional[Tensor]) -> dict:
    return dict(softmax_scale=args.softmax_scale, causal=args.causal, window_size=args.window_size,
                softcap=args.softcap, alibi_slopes=alibi_slopes)


def _forward(q: Tensor, k: Tensor, v: Tensor, softmax_scale, causal, window_left, window_right, softcap,
             alibi_slopes) -> tuple[Tensor, Tensor]:
    args = _validated(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes)
    if args.empty:
        return empty_outputs(q, args)
    from flash_gen.runtime.fwd import attention_fwd

    return attention_fwd(q, k, v, **_runtime_kwargs(args, alibi_slopes))


def empty_outputs(q: Tensor, args: FwdArgs) -> tuple[Tensor, Tensor]:
    """(out, softmax_lse) when seqlen_q or seqlen_k is 0: rows that see no key output 0, lse +inf."""
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((args.batch, args.nheads, args.seqlen_q), float("inf"), dtype=torch.float32, device=q.device)
    return out, lse


def _backward_into(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dq: Tensor, dk: Tensor,
                   dv: Tensor, *attn) -> None:
    softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, deterministic = attn
    args = _validated(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes)
    dout = check_bwd(dout, q, out, lse, deterministic)
    if args.empty:
        for g in (dq, dk, dv):
            g.zero_()
        return
    from flash_gen.runtime.bwd import attention_bwd

    attention_bwd(dout, q, k, v, out, lse, dq, dk, dv, deterministic=deterministic,
                  **_runtime_kwargs(args, alibi_slopes))


def _fake_lse(q: Tensor) -> Tensor:
    b, s, h, _ = q.shape
    return q.new_empty((b, h, s), dtype=torch.float32)


# --- separate q, k, v -------------------------------------------------------------------------------------


@torch.library.custom_op("flash_gen::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float], causal: bool, window_left: int,
        window_right: int, softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool) -> tuple[Tensor, Tensor]:
    return _forward(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes)


@fwd.register_fake
def _(q, k, v, *attn):
    return torch.empty_like(q, memory_format=torch.contiguous_format), _fake_lse(q)


@torch.library.custom_op("flash_gen::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, softmax_scale: Optional[float],
        causal: bool, window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
        deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    _backward_into(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, window_left, window_right, softcap,
                   alibi_slopes, deterministic)
    return dq, dk, dv


@bwd.register_fake
def _(dout, q, k, v, out, lse, *attn):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


# --- k and v packed: kv (b, sk, 2, hk, d) -----------------------------------------------------------------


@torch.library.custom_op("flash_gen::fwd_kvpacked", mutates_args=())
def fwd_kvpacked(q: Tensor, kv: Tensor, softmax_scale: Optional[float], causal: bool, window_left: int,
                 window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                 deterministic: bool) -> tuple[Tensor, Tensor]:
    check_packed("kv", kv, 2)
    return _forward(q, kv[:, :, 0], kv[:, :, 1], softmax_scale, causal, window_left, window_right, softcap,
                    alibi_slopes)


@fwd_kvpacked.register_fake
def _(q, kv, *attn):
    return torch.empty_like(q, memory_format=torch.contiguous_format), _fake_lse(q)


@torch.library.custom_op("flash_gen::bwd_kvpacked", mutates_args=())
def bwd_kvpacked(dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor, softmax_scale: Optional[float],
                 causal: bool, window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                 deterministic: bool) -> tuple[Tensor, Tensor]:
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dkv = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
    _backward_into(dout, q, kv[:, :, 0], kv[:, :, 1], out, lse, dq, dkv[:, :, 0], dkv[:, :, 1], softmax_scale,
                   causal, window_left, window_right, softcap, alibi_slopes, deterministic)
    return dq, dkv


@bwd_kvpacked.register_fake
def _(dout, q, kv, out, lse, *attn):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, kv))


# --- q, k and v packed: qkv (b, s, 3, h, d) ---------------------------------------------------------------


@torch.library.custom_op("flash_gen::fwd_qkvpacked", mutates_args=())
def fwd_qkvpacked(qkv: Tensor, softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                  softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool) -> tuple[Tensor, Tensor]:
    check_packed("qkv", qkv, 3)
    return _forward(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], softmax_scale, causal, window_left, window_right,
                    softcap, alibi_slopes)


@fwd_qkvpacked.register_fake
def _(qkv, *attn):
    q = qkv[:, :, 0]
    return torch.empty_like(q, memory_format=torch.contiguous_format), _fake_lse(q)


@torch.library.custom_op("flash_gen::bwd_qkvpacked", mutates_args=())
def bwd_qkvpacked(dout: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, softmax_scale: Optional[float], causal: bool,
                  window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                  deterministic: bool) -> Tensor:
    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    _backward_into(dout, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], out, lse, dqkv[:, :, 0], dqkv[:, :, 1],
                   dqkv[:, :, 2], softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                   deterministic)
    return dqkv


@bwd_qkvpacked.register_fake
def _(dout, qkv, out, lse, *attn):
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


# --- autograd -------------------------------------------------------------------------------------------------

_N_ATTN = 7  # trailing non-differentiable arguments
_ALIBI = 5  # index of alibi_slopes among them


def _register_autograd(fwd_op, bwd_op, n_inputs: int) -> None:
    """Gradients of `fwd_op`'s first `n_inputs` tensors come from `bwd_op(dout, *inputs, out, lse, *attn)`; the
    attention arguments get None (alibi_slopes is a buffer, not a parameter)."""

    def setup_context(ctx, inputs, output):
        attn = list(inputs[n_inputs:])
        ctx.save_for_backward(*inputs[:n_inputs], *output, attn[_ALIBI])
        attn[_ALIBI] = None  # tensors travel through save_for_backward only
        ctx.attn = attn
        ctx.mark_non_differentiable(output[1])  # softmax_lse
        ctx.set_materialize_grads(False)  # else autograd fills a zero gradient for lse: an extra kernel

    def backward(ctx, dout, _dlse):
        if dout is None:  # the output did not reach the loss
            return (None,) * (n_inputs + _N_ATTN)
        *inputs, out, lse, alibi_slopes = ctx.saved_tensors
        attn = list(ctx.attn)
        attn[_ALIBI] = alibi_slopes
        grads = bwd_op(dout, *inputs, out, lse, *attn)
        grads = grads if isinstance(grads, tuple) else (grads,)
        return (*grads, *(None,) * _N_ATTN)

    fwd_op.register_autograd(backward, setup_context=setup_context)


_register_autograd(fwd, bwd, 3)
_register_autograd(fwd_kvpacked, bwd_kvpacked, 2)
_register_autograd(fwd_qkvpacked, bwd_qkvpacked, 1)
