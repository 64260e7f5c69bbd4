"""CPU checks of the GPU tests' reference helpers (tests/attn_reference.py)."""

from __future__ import annotations

import pytest
import torch

from attn_reference import attention_ref, grad_leaves, reference_grads


@pytest.mark.parametrize("causal,softcap,dropout_p", [(False, 0.0, 0.0), (True, 0.0, 0.3), (False, 20.0, 0.0)])
def test_reference_grads_shift_is_what_the_stored_output_moves(causal: bool, softcap: float, dropout_p: float):
    """grads - shift equals a float64 backward written out as the kernels compute it, with D = rowsum(dO O) over the
    output rounded to bf16 (seqlen_q > seqlen_k with causal: rows that see no key)."""
    gen = torch.Generator().manual_seed(0)
    b, sq, sk, h, d = 2, 7, 5, 3, 16
    q, k, v, dout = (torch.randn(b, n, h, d, generator=gen).bfloat16() for n in (sq, sk, sk, sq))
    keep = torch.rand(b, h, sq, sk, generator=gen) >= dropout_p
    leaves = grad_leaves((q, k, v), upcast=True)
    assert all(t.dtype == torch.float64 for t in leaves)
    scale = d ** -0.5
    out, lse = attention_ref(*leaves, scale=scale, causal=causal, window=(-1, -1), softcap=softcap,
                             alibi_slopes=None, upcast=True, dropout_mask=keep if dropout_p else None,
                             dropout_p=dropout_p)
    grads, shift = reference_grads(out, lse, leaves, dout, torch.bfloat16)

    qd, kd, vd, dod = (t.double() for t in (q, k, v, dout))
    raw = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    s = softcap * torch.tanh(raw / softcap) if softcap else raw
    row = torch.arange(sq)[:, None] + (sk - sq)
    seen = ~(causal & (torch.arange(sk)[None, :] > row))
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0)
    z = keep.double() / (1.0 - dropout_p)
    stored = out.detach().bfloat16().double()
    rowsum = (dod * stored).sum(-1).transpose(1, 2)[..., None]
    ds = p * (z * torch.einsum("bqhd,bkhd->bhqk", dod, vd) - rowsum)
    if softcap:
        ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kd) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qd) * scale
    torch.testing.assert_close(grads[0] - shift[0], dq, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[1] - shift[1], dk, rtol=1e-10, atol=1e-12)
    assert torch.equal(shift[2], torch.zeros_like(shift[2]))  # dV does not read D
    assert shift[0].abs().max() > 0  # the rounding does move dQ
