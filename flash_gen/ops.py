"""flash_gen's attention as PyTorch custom ops (torch.library), with fake kernels and autograd.

Three forward ops take q/k/v separately, k and v packed (kv: (b, sk, 2, hk, d)) or all three packed
(qkv: (b, s, 3, h, d)); each has a backward op whose gradient has the same packing, written by the kernels
straight into one allocation (no stack/cat copy, no zero fill). Given cu_seqlens_q/k (int32, batch + 1 row
offsets), every op takes a ragged batch packed along one row axis instead: q (total_q, h, d), kv
(total_k, 2, hk, d), qkv (total, 3, h, d), and softmax_lse is (h, total_q), as in flash_attn's varlen API. torch.compile traces the ops as opaque nodes
through their fake kernels, so a compiled graph runs exactly the kernels the eager call runs.

Every argument is validated inside the real implementations, on real tensors and before any launch; the public
functions in flash_gen.api only forward arguments, so tracing them needs no data pointers.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from flash_gen import settings
from flash_gen.memo import BoundedMemo, layout
from flash_gen.validate import (
    VECTOR_BYTES,
    FwdArgs,
    check_bwd,
    check_packed,
    check_rng_state,
    lse_shape,
    validate_fwd,
    validate_kvcache,
)

# Trailing arguments every op takes, in this order: the ragged-batch offsets, the attention's semantics, the
# backward's dQ order and dropout. cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
# softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int, softcap: float,
# alibi_slopes: Optional[Tensor], deterministic: bool, dropout_p: float, rng_state: Optional[Tensor] (the seed
# the forward draws its keep decisions from and the backward redraws them from: dropout_seed's, an input rather
# than drawn inside the op, so the op stays a pure function of its arguments for torch.compile and CUDA graphs).


class _Checked:
    """validate_fwd's result for one argument layout, and the runtime's launch plan for it once a forward has run
    (flash_gen.runtime.fwd.FwdPlan: variant, parameter template, grid)."""

    __slots__ = ("args", "plan")

    def __init__(self, args: FwdArgs) -> None:
        self.args, self.plan = args, None


# _Checked entries for dense calls (no cu_seqlens), keyed by everything validation reads except the base
# addresses, whose alignment is re-checked on every hit: a repeated shape skips the checks and the planning. Exact
# because the scalars arrive with their types fixed (flash_gen.api normalises them; a direct op call goes through
# the dispatcher's schema), so equal keys are equal arguments. Varlen calls are not memoised (FLASH_GEN_DEBUG adds
# value checks there). Cleared when full, so shapes that never repeat cannot grow it.
_checked_memo: BoundedMemo = BoundedMemo(256)


def _checked(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left,
             window_right, softcap, alibi_slopes, dropout_p, rng_state) -> _Checked:
    if dropout_p:
        check_rng_state(dropout_p, rng_state, q)
    memo_key = None
    if cu_seqlens_q is None and cu_seqlens_k is None:
        memo_key = (layout(q), layout(k), layout(v), softmax_scale, causal, window_left, window_right, softcap,
                    layout(alibi_slopes), dropout_p)
        entry = _checked_memo.get(memo_key)
        if entry is not None and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) % VECTOR_BYTES:
            return entry
    entry = _Checked(validate_fwd(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                  softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
                                  softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p))
    return entry if memo_key is None else _checked_memo.put(memo_key, entry)


def _score_kwargs(args: FwdArgs, alibi_slopes: Optional[Tensor]) -> dict:
    return dict(softmax_scale=args.softmax_scale, causal=args.causal, window_size=args.window_size,
                softcap=args.softcap, alibi_slopes=alibi_slopes)


def _runtime_kwargs(args: FwdArgs, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                    alibi_slopes: Optional[Tensor]) -> dict:
    return dict(_score_kwargs(args, alibi_slopes), cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)


def _forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left,
             window_right, softcap, alibi_slopes, dropout_p, rng_state) -> tuple[Tensor, Tensor]:
    entry = _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right, softcap,
                     alibi_slopes, dropout_p, rng_state)
    if entry.args.empty:
        return empty_outputs(q, entry.args)
    from flash_gen.runtime.fwd import plan_fwd, run_fwd

    plan = entry.plan
    if plan is None:
        plan = plan_fwd(q, k, v, cu_seqlens_q=cu_seqlens_q, dropout_p=dropout_p,
                        **_score_kwargs(entry.args, alibi_slopes))
        if cu_seqlens_q is None:  # memoised entries only: a varlen entry is built per call
            entry.plan = plan
    return run_fwd(plan, q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                   rng_state=rng_state if dropout_p else None)


def dropout_seed(like: Tensor, dropout_p: float) -> Optional[Tensor]:
    """The seed of a dropout call (None without dropout): one int64 drawn by PyTorch's generator on `like`'s
    device, so torch.manual_seed reproduces the keep decisions and CUDA graphs replay fresh ones."""
    if not dropout_p:
        return None
    return torch.randint(0, 1 << 62, (1,), dtype=torch.int64, device=like.device)


def empty_outputs(q: Tensor, args: FwdArgs) -> tuple[Tensor, Tensor]:
    """(out, softmax_lse) when seqlen_q or seqlen_k is 0: rows that see no key output 0, lse +inf."""
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full(lse_shape(q, args.varlen), float("inf"), dtype=torch.float32, device=q.device)
    return out, lse


def _backward_into(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dq: Tensor, dk: Tensor,
                   dv: Tensor, *attn) -> None:
    (cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, det,
     dropout_p, rng_state) = attn
    args = _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right, softcap,
                    alibi_slopes, dropout_p, rng_state).args
    dout = check_bwd(dout, q, out, lse, det, args.varlen)
    if args.empty:
        for g in (dq, dk, dv):
            g.zero_()
        return
    from flash_gen.runtime.bwd import attention_bwd

    attention_bwd(dout, q, k, v, out, lse, dq, dk, dv, deterministic=det, dropout_p=dropout_p,
                  rng_state=rng_state if dropout_p else None,
                  **_runtime_kwargs(args, cu_seqlens_q, cu_seqlens_k, alibi_slopes))


def _fake_outputs(q: Tensor, cu_seqlens_q: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty(lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)


def _parts(packed: Tensor, n: int) -> tuple[Tensor, ...]:
    """Views of the n tensors packed along dim -3 (kv: n=2, qkv: n=3; dense or varlen)."""
    return tuple(packed.select(-3, i) for i in range(n))


# --- custom ops and the direct eager call ---------------------------------------------------------------------

_IMPLS: dict[object, Callable] = {}  # custom op -> its Python implementation
_EAGER_AUTOGRAD: dict[object, type] = {}  # differentiable custom op -> autograd.Function around its implementation


def _custom_op(name: str, mutates_args: tuple[str, ...] = ()) -> Callable:
    """torch.library.custom_op, remembering the implementation for `call`."""
    def register(fn: Callable):
        op = torch.library.custom_op(name, fn, mutates_args=mutates_args)
        _IMPLS[op] = fn
        return op
    return register


# Argument types that cannot be tensors: skipped without isinstance(a, Tensor), which costs ~0.2 µs per argument
# (torch.Tensor's metaclass checks instances in Python).
_PLAIN_ARGS = frozenset({type(None), bool, int, float})


def call(op, *args):
    """op(*args). Eager calls on plain CUDA tensors, with no torch function or dispatch mode and no torch.func
    transform active, skip the dispatcher and custom-op layers, which cost most of the host time of a small call
    and do nothing there: with no gradient to record the implementation runs directly, else an autograd.Function
    with the op's own autograd formulas wraps it. torch.compile traces the op itself (is_compiling() is checked
    first, so dynamo never reaches the C-level checks)."""
    if (torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled()
            or torch._C._len_torch_dispatch_stack() or torch._C._functorch.peek_interpreter_stack() is not None):
        return op(*args)  # traced, intercepted, or under a torch.func transform (whose tensors look plain)
    grad = torch.is_grad_enabled()
    record = False
    for a in args:
        kind = type(a)
        if kind is Tensor:
            if not a.is_cuda:  # meta/CPU tensors: the op's own handling
                return op(*args)
            record = record or (grad and a.requires_grad)
        elif kind not in _PLAIN_ARGS and isinstance(a, Tensor):  # subclasses: the op's own handling
            return op(*args)
    if not record:
        return _IMPLS[op](*args)
    function = _EAGER_AUTOGRAD.get(op)
    return function.apply(*args) if function is not None else op(*args)


# --- separate q, k, v -------------------------------------------------------------------------------------


@_custom_op("flash_gen::fwd")
def fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
        softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int, softcap: float,
        alibi_slopes: Optional[Tensor], deterministic: bool, dropout_p: float,
        rng_state: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right, softcap,
                    alibi_slopes, dropout_p, rng_state)


@fwd.register_fake
def _(q, k, v, cu_seqlens_q, *attn):
    return _fake_outputs(q, cu_seqlens_q)


@_custom_op("flash_gen::bwd")
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Optional[Tensor],
        cu_seqlens_k: Optional[Tensor], softmax_scale: Optional[float], causal: bool, window_left: int,
        window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
        deterministic: bool, dropout_p: float, rng_state: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    _backward_into(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                   window_left, window_right, softcap, alibi_slopes, deterministic, dropout_p, rng_state)
    return dq, dk, dv


@bwd.register_fake
def _(dout, q, k, v, out, lse, *attn):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


# --- k and v packed: kv (b, sk, 2, hk, d) or (total_k, 2, hk, d) ---------------------------------------------


@_custom_op("flash_gen::fwd_kvpacked")
def fwd_kvpacked(q: Tensor, kv: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                 softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int, softcap: float,
                 alibi_slopes: Optional[Tensor], deterministic: bool, dropout_p: float,
                 rng_state: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    check_packed("kv", kv, 2, cu_seqlens_q is not None)
    return _forward(q, *_parts(kv, 2), cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right,
                    softcap, alibi_slopes, dropout_p, rng_state)


@fwd_kvpacked.register_fake
def _(q, kv, cu_seqlens_q, *attn):
    return _fake_outputs(q, cu_seqlens_q)


@_custom_op("flash_gen::bwd_kvpacked")
def bwd_kvpacked(dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Optional[Tensor],
                 cu_seqlens_k: Optional[Tensor], softmax_scale: Optional[float], causal: bool, window_left: int,
                 window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                 deterministic: bool, dropout_p: float, rng_state: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dkv = torch.empty_like(kv, memory_format=torch.contiguous_format)
    _backward_into(dout, q, *_parts(kv, 2), out, lse, dq, *_parts(dkv, 2), cu_seqlens_q, cu_seqlens_k,
                   softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, deterministic, dropout_p,
                   rng_state)
    return dq, dkv


@bwd_kvpacked.register_fake
def _(dout, q, kv, out, lse, *attn):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, kv))


# --- q, k and v packed: qkv (b, s, 3, h, d) or (total, 3, h, d) -------------------------------------------------


@_custom_op("flash_gen::fwd_qkvpacked")
def fwd_qkvpacked(qkv: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                  softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int, softcap: float,
                  alibi_slopes: Optional[Tensor], deterministic: bool, dropout_p: float,
                  rng_state: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    check_packed("qkv", qkv, 3, cu_seqlens_q is not None)
    return _forward(*_parts(qkv, 3), cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right,
                    softcap, alibi_slopes, dropout_p, rng_state)


@fwd_qkvpacked.register_fake
def _(qkv, cu_seqlens_q, *attn):
    return _fake_outputs(qkv.select(-3, 0), cu_seqlens_q)


@_custom_op("flash_gen::bwd_qkvpacked")
def bwd_qkvpacked(dout: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Optional[Tensor],
                  cu_seqlens_k: Optional[Tensor], softmax_scale: Optional[float], causal: bool, window_left: int,
                  window_right: int, softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool,
                  dropout_p: float, rng_state: Optional[Tensor]) -> Tensor:
    dqkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
    _backward_into(dout, *_parts(qkv, 3), out, lse, *_parts(dqkv, 3), cu_seqlens_q, cu_seqlens_k, softmax_scale,
                   causal, window_left, window_right, softcap, alibi_slopes, deterministic, dropout_p, rng_state)
    return dqkv


@bwd_qkvpacked.register_fake
def _(dout, qkv, out, lse, *attn):
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


# --- inference only (no gradient) ---------------------------------------------------------------------------


@_custom_op("flash_gen::fwd_varlen_paged")
def fwd_varlen_paged(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     block_table: Tensor, softmax_scale: Optional[float], causal: bool, window_left: int,
                     window_right: int, softcap: float, alibi_slopes: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """flash_attn_varlen_func with block_table: q packed (total_q, h, d), K/V in a paged cache."""
    args = validate_fwd(q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                        block_table=block_table, softmax_scale=softmax_scale, causal=causal,
                        window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes)
    if args.empty:
        return empty_outputs(q, args)
    from flash_gen.runtime.fwd import attention_fwd

    return attention_fwd(q, k_cache, v_cache, block_table=block_table,
                         **_runtime_kwargs(args, cu_seqlens_q, cu_seqlens_k, alibi_slopes))


@fwd_varlen_paged.register_fake
def _(q, k_cache, v_cache, cu_seqlens_q, *args):
    return _fake_outputs(q, cu_seqlens_q)


@_custom_op("flash_gen::fwd_kvcache", mutates_args=("k_cache", "v_cache"))
def fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Optional[Tensor],
                cache_seqlens_int: int, cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor],
                block_table: Optional[Tensor], softmax_scale: Optional[float], causal: bool, window_left: int,
                window_right: int, softcap: float, rotary_interleaved: bool, alibi_slopes: Optional[Tensor],
                num_splits: int) -> tuple[Tensor, Tensor]:
    """flash_attn_with_kvcache (cache_seqlens_int: the int form of cache_seqlens, -1 for none)."""
    seqlens = cache_seqlens if cache_seqlens is not None else (None if cache_seqlens_int < 0 else cache_seqlens_int)
    tensors = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
               block_table, alibi_slopes)
    # Checks are kept per argument layout as _checked's are (a decoding loop repeats one layout; an int length,
    # which may grow every step, is only range-checked on a hit); under FLASH_GEN_DEBUG=1 they run every call, as
    # they read index values.
    memo_key = None if settings.debug() else (*map(layout, tensors), cache_seqlens_int < 0, softmax_scale, causal,
                                               window_left, window_right, softcap, rotary_interleaved, num_splits)
    checked = _kvcache_memo.get(memo_key)
    if (checked is None or (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) % VECTOR_BYTES
            or cache_seqlens_int + checked.new_rows > checked.attn.seqlen_k):
        checked = validate_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, cache_batch_idx,
                                   cache_leftpad, block_table, softmax_scale=softmax_scale, causal=causal,
                                   window_size=(window_left, window_right), softcap=softcap,
                                   alibi_slopes=alibi_slopes, num_splits=num_splits,
                                   rotary_interleaved=rotary_interleaved)
        if memo_key is not None:
            _kvcache_memo.put(memo_key, checked)
    from flash_gen.runtime import kvcache
    from flash_gen.runtime.fwd_kvcache import KvCache, attention_fwd_kvcache

    args = checked.attn
    if k is not None or checked.rotary:
        # New keys sit at rows cache_seqlens[b] + i; queries there too when the call asks for a causal or local
        # mask, else all at cache_seqlens[b] (flash_attn's convention, decided on the arguments as given).
        masked = causal or window_left >= 0 or window_right >= 0
        q = kvcache.append_and_rotate(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                      seqlens if isinstance(seqlens, Tensor) else None,
                                      seqlens if isinstance(seqlens, int) else 0, cache_batch_idx, block_table,
                                      interleaved=rotary_interleaved, q_same_pos=not masked)
    used = None if isinstance(seqlens, Tensor) or seqlens is None else seqlens + checked.new_rows
    seqused = None
    if isinstance(seqlens, Tensor):
        seqused = seqlens + checked.new_rows if checked.new_rows else seqlens
    cache = KvCache(seqused_k=seqused, used=used, leftpad_k=cache_leftpad, batch_idx=cache_batch_idx,
                    block_table=block_table, num_splits=checked.num_splits)
    return attention_fwd_kvcache(q, k_cache, v_cache, cache, **_score_kwargs(args, alibi_slopes))


_kvcache_memo: BoundedMemo = BoundedMemo(256)  # validate_kvcache's results by argument layout


@fwd_kvcache.register_fake
def _(q, *args):
    b, s, h, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((b, h, s), dtype=torch.float32)


# --- autograd -------------------------------------------------------------------------------------------------

_N_ATTN = 11  # trailing non-differentiable arguments
_TENSOR_ARGS = (0, 1, 7, 10)  # cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state among them


def _register_autograd(fwd_op, bwd_op, n_inputs: int) -> None:
    """Gradients of `fwd_op`'s first `n_inputs` tensors come from `bwd_op(dout, *inputs, out, lse, *attn)`; the
    attention arguments get None (cu_seqlens, alibi_slopes and the dropout seed are buffers, not parameters)."""

    def setup_context(ctx, inputs, output):
        attn = list(inputs[n_inputs:])
        ctx.save_for_backward(*inputs[:n_inputs], *output, *(attn[i] for i in _TENSOR_ARGS))
        for i in _TENSOR_ARGS:
            attn[i] = None  # tensors travel through save_for_backward only
        ctx.attn = attn
        ctx.mark_non_differentiable(output[1])  # softmax_lse
        ctx.set_materialize_grads(False)  # else autograd fills a zero gradient for lse: an extra kernel

    def backward(ctx, dout, _dlse):
        if dout is None:  # the output did not reach the loss
            return (None,) * (n_inputs + _N_ATTN)
        saved = ctx.saved_tensors
        inputs, (out, lse), buffers = saved[:n_inputs], saved[n_inputs : n_inputs + 2], saved[n_inputs + 2 :]
        attn = list(ctx.attn)
        for i, t in zip(_TENSOR_ARGS, buffers):
            attn[i] = t
        grads = call(bwd_op, dout, *inputs, out, lse, *attn)
        grads = grads if isinstance(grads, tuple) else (grads,)
        return (*grads, *(None,) * _N_ATTN)

    fwd_op.register_autograd(backward, setup_context=setup_context)
    impl = _IMPLS[fwd_op]

    def forward(ctx, *inputs):  # the ctx-taking form: with a separate setup_context, apply() would bind the
        output = impl(*inputs)  # arguments through inspect.signature on every call
        setup_context(ctx, inputs, output)
        return output

    _EAGER_AUTOGRAD[fwd_op] = type(f"Eager_{impl.__name__}", (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "backward": staticmethod(backward),
    })


_register_autograd(fwd, bwd, 3)
_register_autograd(fwd_kvpacked, bwd_kvpacked, 2)
_register_autograd(fwd_qkvpacked, bwd_qkvpacked, 1)
