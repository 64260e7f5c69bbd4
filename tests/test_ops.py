"""CPU tests of the custom ops: the fake (meta) kernels give every signature's shapes and dtypes, autograd is
registered, and the public functions reject bad plain arguments by name before any op runs."""

from __future__ import annotations

import pytest
import torch

from flash_gen import api, ops
from flash_gen.memo import BoundedMemo

B, SQ, SK, H, HK, D = 2, 100, 37, 6, 2, 72
# cu_seqlens_q/k, softmax_scale, causal, window, softcap, alibi, deterministic
ATTN = (None, None, None, True, -1, -1, 0.0, None, False, 0.0, None)
TOTAL_Q, TOTAL_K = 150, 90


def meta(*shape):
    return torch.empty(*shape, device="meta", dtype=torch.bfloat16)


def test_fake_forward_shapes():
    q, k, v = meta(B, SQ, H, D), meta(B, SK, HK, D), meta(B, SK, HK, D)
    for out, lse in (ops.fwd(q, k, v, *ATTN), ops.fwd_kvpacked(q, meta(B, SK, 2, HK, D), *ATTN),
                     ops.fwd_qkvpacked(meta(B, SQ, 3, H, D), *ATTN)):
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
        assert lse.shape == (B, H, SQ) and lse.dtype == torch.float32


def test_fake_backward_shapes():
    q, k, v, out, lse = meta(B, SQ, H, D), meta(B, SK, HK, D), meta(B, SK, HK, D), meta(B, SQ, H, D), None
    lse = torch.empty(B, H, SQ, device="meta")
    dq, dk, dv = ops.bwd(out, q, k, v, out, lse, *ATTN)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    kv = meta(B, SK, 2, HK, D)
    dq, dkv = ops.bwd_kvpacked(out, q, kv, out, lse, *ATTN)
    assert (dq.shape, dkv.shape) == (q.shape, kv.shape)
    qkv = meta(B, SQ, 3, H, D)
    assert ops.bwd_qkvpacked(out, qkv, out, lse, *ATTN).shape == qkv.shape


def test_meta_autograd_reaches_the_backward_op():
    q, k, v = (t.requires_grad_() for t in (meta(B, SQ, H, D), meta(B, SK, HK, D), meta(B, SK, HK, D)))
    out = api.flash_attn_func(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    qkv = meta(B, SQ, 3, H, D).requires_grad_()
    (dqkv,) = torch.autograd.grad(api.flash_attn_qkvpacked_func(qkv), (qkv,), torch.empty_like(out))
    assert dqkv.shape == qkv.shape


def test_meta_autograd_with_dropout_carries_the_seed_to_the_backward(monkeypatch):
    """With dropout the public function draws one int64 seed on q's device and hands the same tensor to the
    forward op; the backward op takes it back among the attention arguments."""
    seen = []
    real = ops.dropout_seed

    def recording(like, p):
        seen.append(real(like, p))
        return seen[-1]

    monkeypatch.setattr(ops, "dropout_seed", recording)
    q, k, v = (t.requires_grad_() for t in (meta(B, SQ, H, D), meta(B, SK, HK, D), meta(B, SK, HK, D)))
    out = api.flash_attn_func(q, k, v, dropout_p=0.1, causal=True)
    (rng_state,) = seen
    assert rng_state.dtype == torch.int64 and rng_state.shape == (1,) and rng_state.device == q.device
    assert ops.dropout_seed(q, 0.0) is None
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    dq, dk, dv = ops.bwd(out, q, k, v, out, torch.empty(B, H, SQ, device="meta"), *ATTN[:-2], 0.1, rng_state)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_dropout_seed_is_checked():
    from flash_gen.validate import check_rng_state

    q = torch.empty(2, 3, 4, 8, dtype=torch.bfloat16)
    check_rng_state(0.0, None, q)  # no dropout: no seed needed
    check_rng_state(0.3, torch.zeros(2, dtype=torch.int64), q)
    for bad in (None, torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int64),
                torch.zeros(1, dtype=torch.int64, device="meta")):
        with pytest.raises((TypeError, ValueError), match="^rng_state"):
            check_rng_state(0.3, bad, q)
    with pytest.raises(ValueError, match="^dropout_p"):
        check_rng_state(1.0, torch.zeros(1, dtype=torch.int64), q)


def test_dropout_with_a_paged_cache_says_so():
    q = torch.randn(10, H, 64, dtype=torch.bfloat16)
    cache = torch.randn(4, 16, HK, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    table = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="^dropout_p"):
        api.flash_attn_varlen_func(q, cache, cache, cu, cu, 10, 10, dropout_p=0.1, block_table=table)


@pytest.mark.parametrize(
    "kwargs,exc,name",
    [
        (dict(dropout_p=1.0), ValueError, "dropout_p"),
        (dict(causal=1), TypeError, "causal"),
        (dict(deterministic="yes"), TypeError, "deterministic"),
        (dict(window_size=(1.5, 2)), TypeError, "window_size"),
        (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
        (dict(softcap=float("nan")), ValueError, "softcap"),
        (dict(return_attn_probs="yes"), TypeError, "return_attn_probs"),
    ],
)
def test_public_functions_name_bad_arguments(kwargs, exc, name):
    q = torch.randn(B, SQ, H, 64, dtype=torch.bfloat16)
    for call in (lambda: api.flash_attn_func(q, q, q, **kwargs),
                 lambda: api.flash_attn_kvpacked_func(q, torch.stack([q, q], 2), **kwargs),
                 lambda: api.flash_attn_qkvpacked_func(torch.stack([q, q, q], 2), **kwargs)):
        with pytest.raises(exc, match=f"^{name}"):
            call()


def test_packed_tensors_are_checked_by_name():
    q = torch.randn(B, SQ, H, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^qkv"):
        api.flash_attn_qkvpacked_func(torch.stack([q, q], 2))
    with pytest.raises(ValueError, match="^kv"):
        api.flash_attn_kvpacked_func(q, q)


def test_cpu_tensors_are_rejected_before_launch():
    q = torch.randn(B, SQ, H, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^q: flash_gen needs CUDA tensors"):
        api.flash_attn_func(q, q, q)


def test_backward_inputs_are_checked_by_name():
    from flash_gen.validate import check_bwd

    q = torch.randn(B, SQ, H, 64, dtype=torch.bfloat16)
    lse = torch.zeros(B, H, SQ)
    with pytest.raises(TypeError, match="^dout"):
        check_bwd(q.half(), q, q, lse, False, False)
    with pytest.raises(ValueError, match="^dout"):
        check_bwd(q[:, :10], q, q, lse, False, False)
    with pytest.raises(ValueError, match="^softmax_lse"):
        check_bwd(q, q, q, lse[:, :1], False, False)
    with pytest.raises(ValueError, match="^softmax_lse"):
        check_bwd(q, q, q, lse, False, True)  # a packed batch's lse is (nheads, total_q)
    with pytest.raises(TypeError, match="^deterministic"):
        check_bwd(q, q, q, lse, 1, False)
    expanded = torch.ones((), dtype=torch.bfloat16).expand(q.shape)  # the gradient of out.sum()
    fixed = check_bwd(expanded, q, q, lse, False, False)
    assert fixed.stride(-1) == 1 and torch.equal(fixed, expanded)


def _varlen_attn(batch: int = B) -> tuple:
    cu = torch.empty(batch + 1, dtype=torch.int32, device="meta")
    return (cu, cu, *ATTN[2:])


def test_fake_varlen_shapes():
    q, k, v = meta(TOTAL_Q, H, D), meta(TOTAL_K, HK, D), meta(TOTAL_K, HK, D)
    attn = _varlen_attn()
    for out, lse in (ops.fwd(q, k, v, *attn), ops.fwd_kvpacked(q, meta(TOTAL_K, 2, HK, D), *attn),
                     ops.fwd_qkvpacked(meta(TOTAL_Q, 3, H, D), *attn)):
        assert out.shape == q.shape and lse.shape == (H, TOTAL_Q) and lse.dtype == torch.float32
    lse = torch.empty(H, TOTAL_Q, device="meta")
    dq, dk, dv = ops.bwd(q, q, k, v, q, lse, *attn)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    kv, qkv = meta(TOTAL_K, 2, HK, D), meta(TOTAL_Q, 3, H, D)
    assert ops.bwd_kvpacked(q, q, kv, q, lse, *attn)[1].shape == kv.shape
    assert ops.bwd_qkvpacked(q, qkv, q, lse, *attn).shape == qkv.shape


def test_meta_varlen_autograd():
    qkv = meta(TOTAL_Q, 3, H, D).requires_grad_()
    cu = torch.empty(B + 1, dtype=torch.int32, device="meta")
    out = api.flash_attn_varlen_qkvpacked_func(qkv, cu, None, causal=True)
    assert out.shape == (TOTAL_Q, H, D)
    (dqkv,) = torch.autograd.grad(out, (qkv,), torch.empty_like(out))
    assert dqkv.shape == qkv.shape


@pytest.mark.parametrize(
    "kwargs,exc,name",
    [
        (dict(max_seqlen_q=1.5), TypeError, "max_seqlen_q"),
        (dict(max_seqlen_k=-1), TypeError, "max_seqlen_k"),
    ],
)
def test_varlen_plain_arguments_are_named(kwargs, exc, name):
    q = torch.randn(TOTAL_Q, H, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 100, TOTAL_Q], dtype=torch.int32)
    with pytest.raises(exc, match=f"^{name}"):
        api.flash_attn_varlen_func(q, q, q, cu, cu, **kwargs)


def test_fake_kvcache_shapes():
    q, cache = meta(B, 4, H, D), meta(7, 16, HK, D)
    table = torch.empty(B, 5, dtype=torch.int32, device="meta")
    out, lse = ops.fwd_kvcache(q, cache, cache, None, None, None, None, None, 30, None, None, table, None, True, -1,
                               -1, 0.0, True, None, 0)
    assert out.shape == q.shape and lse.shape == (B, H, 4) and lse.dtype == torch.float32


def test_kvcache_function_names_bad_plain_arguments():
    q = torch.randn(B, 1, H, 64, dtype=torch.bfloat16)
    cache = torch.randn(B, 32, HK, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="^cache_seqlens"):
        api.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=2.5)
    with pytest.raises(TypeError, match="^return_softmax_lse"):
        api.flash_attn_with_kvcache(q, cache, cache, return_softmax_lse=1)
    with pytest.raises(ValueError, match="^q: flash_gen needs CUDA tensors"):
        api.flash_attn_with_kvcache(q, cache, cache)


def test_merge_attention_states_on_cpu():
    out_a, out_b = torch.randn(B, SQ, H, 8), torch.randn(B, SQ, H, 8)
    lse_a, lse_b = torch.randn(B, H, SQ), torch.randn(B, H, SQ)
    out, lse = api.merge_attention_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(lse, torch.logaddexp(lse_a, lse_b))
    wa = torch.exp(lse_a - lse).transpose(1, 2)[..., None]
    torch.testing.assert_close(out, wa * out_a + (1 - wa) * out_b, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="^lse_b"):
        api.merge_attention_states(out_a, lse_a, out_b, lse_b[:, :1])


def test_fake_varlen_paged_shapes():
    q, cache = meta(TOTAL_Q, H, D), meta(9, 16, HK, D)
    cu = torch.empty(B + 1, dtype=torch.int32, device="meta")
    table = torch.empty(B, 4, dtype=torch.int32, device="meta")
    out, lse = ops.fwd_varlen_paged(q, cache, cache, cu, cu, table, None, True, -1, -1, 0.0, None)
    assert out.shape == q.shape and lse.shape == (H, TOTAL_Q)


def _counted(monkeypatch, name: str) -> list:
    """Wrap ops.`name` (a validation step) so that each call is recorded; returns the list of calls."""
    calls, real = [], getattr(ops, name)
    monkeypatch.setattr(ops, name, lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


def _q_and_shifted() -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, SQ, H, 64) and a view of the same layout 2 bytes further on in its buffer (a misaligned base)."""
    n = B * SQ * H * 64
    buf = torch.randn(n + 8, dtype=torch.bfloat16)
    return buf[:n].view(B, SQ, H, 64), buf[1 : n + 1].view(B, SQ, H, 64)


def test_repeated_layout_skips_validation_but_rechecks_alignment(monkeypatch):
    """A dense call's validation is memoised per layout; a hit must still reject a misaligned base address."""
    from flash_gen import validate

    monkeypatch.setattr(validate, "check_device", lambda *a, **k: None)  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(ops, "_checked_memo", BoundedMemo(256))
    calls = _counted(monkeypatch, "validate_fwd")
    q, shifted = _q_and_shifted()
    # cu_seqlens_q/k, softmax_scale, causal, window, softcap, alibi, dropout_p, rng_state
    attn = (None, None, None, True, -1, -1, 0.0, None, 0.0, None)
    first = ops._checked(q, q, q, *attn)
    assert ops._checked(q, q, q, *attn) is first and len(calls) == 1
    assert ops._checked(q, q, q, *attn[:3], False, *attn[4:]) is not first  # other arguments: validated anew
    with pytest.raises(ValueError, match="^q: base address"):
        ops._checked(shifted, shifted, shifted, *attn)


def test_kvcache_checks_are_kept_per_layout_except_under_debug(monkeypatch):
    """flash_attn_with_kvcache's checks are memoised per layout like the dense ops' (a hit still rejects a
    misaligned base address); under FLASH_GEN_DEBUG=1, which checks index values, they run every call."""
    from flash_gen import validate
    from flash_gen.runtime import fwd_kvcache

    monkeypatch.setattr(validate, "check_device", lambda *a, **k: None)  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(ops, "_kvcache_memo", BoundedMemo(256))
    monkeypatch.setattr(fwd_kvcache, "attention_fwd_kvcache", lambda q, *a, **k: (q, None))
    calls = _counted(monkeypatch, "validate_kvcache")
    q, shifted = _q_and_shifted()
    cache = torch.randn(B, 300, HK, 64, dtype=torch.bfloat16)
    lens = torch.tensor([5, 200], dtype=torch.int32)
    # k, v, rotary_cos/sin, cache_seqlens, its int form, batch_idx, leftpad, block_table, then the attention's
    # scale, causal, window, softcap, rotary_interleaved, alibi, num_splits
    tail = (None, None, None, None, lens, -1, None, None, None, None, True, -1, -1, 0.0, True, None, 0)
    impl = ops._IMPLS[ops.fwd_kvcache]
    for _ in range(3):
        impl(q, cache, cache, *tail)
    assert len(calls) == 1
    impl(q, cache, cache, *tail[:4], None, 150, *tail[6:])  # an int length: another layout
    impl(q, cache, cache, *tail[:4], None, 151, *tail[6:])  # which may grow without new checks
    assert len(calls) == 2
    with pytest.raises(ValueError, match="^cache_seqlens: 301 "):  # but not past the cache
        impl(q, cache, cache, *tail[:4], None, 301, *tail[6:])
    with pytest.raises(ValueError, match="^q: base address"):
        impl(shifted, cache, cache, *tail)
    monkeypatch.setenv("FLASH_GEN_DEBUG", "1")
    impl(q, cache, cache, *tail)
    impl(q, cache, cache, *tail)
    assert len(calls) == 6
