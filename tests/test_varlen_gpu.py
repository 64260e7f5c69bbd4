"""GPU tests of packed ragged batches (flash_attn_varlen_func and its packed variants): forward output and lse,
and dQ/dK/dV, against the float64 reference run entry by entry, with flash_attn's rule (error at most twice
that of PyTorch's math in the input dtype, plus 1e-4). Entries of length zero, seqlen_q != seqlen_k per entry,
batches longer than one 32-entry scan step, every mask kind, softcap, ALiBi per entry, MQA/GQA; outputs and
gradients poisoned with NaN before the launch. Inputs are fresh random numbers each run; the seed is in every
failure message.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from flash_gen import flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func
from flash_gen.spec_sm90 import sm90_config_from_name
from flash_gen.validate import validate_fwd

from attn_reference import DTYPES, MASKS, SOFTCAP, attention_ref, budgets, fresh_seed, grad_leaves, reference_grads

pytestmark = pytest.mark.gpu


@dataclass(frozen=True)
class Case:
    dtype: str
    head_dim: int
    lens_q: tuple[int, ...]
    lens_k: tuple[int, ...]
    nheads: int
    nheads_k: int
    mask: str
    feature: str = "plain"  # plain | softcap | alibi
    deterministic: bool = False
    sm90_config: str = ""  # a Hopper forward tiling forced (sm_90 GPUs only); "": the runtime's choice

    def __str__(self) -> str:
        lens = "_".join(f"{a}x{b}" for a, b in zip(self.lens_q[:4], self.lens_k[:4]))
        more = f"+{len(self.lens_q) - 4}" if len(self.lens_q) > 4 else ""
        det = "-det" if self.deterministic else ""
        cfg = f"-{self.sm90_config}" if self.sm90_config else ""
        return (f"{self.dtype}-d{self.head_dim}-{lens}{more}-h{self.nheads}_{self.nheads_k}-{self.mask}"
                f"-{self.feature}{det}{cfg}")


def _cases() -> list[Case]:
    rng = random.Random(20261129)
    ragged_q = (0, 1, 130, 77, 256, 300)  # zero-length entry, one row, lengths off the tiles
    ragged_k = (5, 0, 200, 77, 100, 513)  # seqlen_k != seqlen_q per entry (both directions), zero keys
    cases = [Case("bf16", 64, ragged_q, ragged_k, 4, 2, m) for m in ("none", "causal", "win32_0", "win64_64")]
    cases += [Case("bf16", 64, ragged_q, ragged_q, 4, 4, "causal", "softcap"),
              Case("bf16", 64, ragged_q, ragged_k, 4, 1, "none", "alibi"),
              Case("fp16", 128, (300, 17, 129), (300, 17, 129), 2, 2, "causal"),
              Case("bf16", 128, (1000, 3), (999, 1500), 4, 2, "none", deterministic=True),
              # sm90: the Hopper backward spills for this key; the runtime runs a spill-free portable tiling
              Case("bf16", 128, ragged_q, ragged_k, 4, 2, "win32_0", "alibi", deterministic=True)]
    # Entries of thousands of rows over 16 heads: grids of thousands of CTAs, many waves of the GPU. Head dim 128
    # causal: on sm_90 the backward's bulk-dQ tilings spill for this key and dQ goes by reductions instead.
    long_q, long_k = (2000, 77, 3001, 0, 1500, 2500), (2000, 77, 2900, 5, 1700, 2500)
    cases += [Case("bf16", 64, long_q, long_q, 16, 8, "causal"),
              Case("bf16", 64, long_q, long_q, 16, 8, "causal", deterministic=True),
              Case("bf16", 128, long_q, long_k, 16, 8, "causal"),
              Case("bf16", 128, long_q, long_k, 16, 8, "none"),
              Case("bf16", 192, ragged_q, ragged_k, 4, 2, "causal")]  # the Hopper backward computing 192 (narrow)
    many = tuple(rng.choice((0, 1, 17, 64, 65, 150)) for _ in range(70))  # three 32-entry scan steps
    cases.append(Case("bf16", 64, many, tuple(reversed(many)), 2, 1, "causal"))
    # Hopper forward tilings the defaults do not reach (the defaults above run it on sm_90 too)
    cases += [Case("bf16", 256, ragged_q, ragged_k, 2, 1, "causal", sm90_config="wgm128n64s2"),
              Case("fp16", 64, ragged_q, ragged_k, 4, 2, "win32_0", "softcap", sm90_config="wgm64n128s2"),
              Case("bf16", 128, many, tuple(reversed(many)), 2, 1, "none", "alibi", sm90_config="wgm128n128s3p"),
              Case("bf16", 96, ragged_q, ragged_q, 4, 4, "causal", sm90_config="wgm128n128s2p"),
              # 192-row tiles (three consumer warpgroups), 80-key steps: the packed forward's candidate at 128
              Case("bf16", 128, ragged_q, ragged_k, 4, 2, "causal", sm90_config="wgm192n80s3"),
              Case("fp16", 128, many, tuple(reversed(many)), 2, 2, "none", sm90_config="wgm192n80s3")]
    # aligned rows ("_al"): two or more KV heads of rows 16 bytes past a sector multiple (72: 144 bytes, 120: 240),
    # so the odd heads' boxes shift; the runtime's default at 72, then two forced tilings
    cases += [Case("bf16", 72, ragged_q, ragged_k, 4, 2, "causal"),
              Case("fp16", 72, long_q, long_k, 16, 8, "none", sm90_config="wgm192n96s4p_al"),
              Case("bf16", 120, ragged_q, ragged_q, 4, 2, "win32_0", "softcap", sm90_config="wgm128n128s2p_al")]
    return cases


CASES = _cases()


def _cu(lens: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _inputs(case: Case, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device="cuda", dtype=DTYPES[case.dtype])  # noqa: E731
    tq, tk = sum(case.lens_q), sum(case.lens_k)
    q, dout = randn(tq, case.nheads, case.head_dim), randn(tq, case.nheads, case.head_dim)
    k, v = randn(tk, case.nheads_k, case.head_dim), randn(tk, case.nheads_k, case.head_dim)
    alibi = None
    if case.feature == "alibi":
        alibi = torch.rand((len(case.lens_q), case.nheads), generator=gen, device="cuda") * 0.3 + 0.01
    return q, k, v, dout, alibi


def _kwargs(case: Case, alibi) -> dict:
    causal, window = MASKS[case.mask]
    return dict(causal=causal, window_size=window, softcap=SOFTCAP if case.feature == "softcap" else 0.0,
                alibi_slopes=alibi)


def _reference(case: Case, q, k, v, dout, *, upcast: bool, causal, window_size, softcap, alibi_slopes):
    """(out, lse (h, total_q), (dq, dk, dv), and the gradients' budgets for the kernels' reading of their stored
    output (attn_reference.reference_grads)): the dense reference applied to each entry's rows."""
    leaves = grad_leaves((q, k, v), upcast)
    outs, lses = [], []
    cq, ck = _cu(case.lens_q).tolist(), _cu(case.lens_k).tolist()
    for b in range(len(case.lens_q)):
        qb = leaves[0][cq[b]:cq[b + 1]][None]
        kb, vb = (t[ck[b]:ck[b + 1]][None] for t in leaves[1:])
        slopes = alibi_slopes[b] if alibi_slopes is not None else None
        out, lse = attention_ref(qb, kb, vb, scale=q.shape[-1] ** -0.5, causal=causal, window=window_size,
                                 softcap=softcap, alibi_slopes=slopes, upcast=upcast)
        if kb.shape[1] == 0:  # no keys: flash_attn's convention (the reference's softmax is NaN there)
            out, lse = torch.zeros_like(out), torch.full_like(lse, float("inf"))
        outs.append(out[0])
        lses.append(lse[0])
    out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    grads, shift = reference_grads(out, lse, leaves, dout, q.dtype)
    return out.detach(), lse.detach(), grads, budgets(shift)


def _check(name: str, got: torch.Tensor, ref64: torch.Tensor, low: torch.Tensor, where: str,
           extra: float = 0.0) -> None:
    assert not got.isnan().any(), f"{where}: {name} has {int(got.isnan().sum())} unwritten (NaN) elements"
    if got.numel() == 0:
        return
    finite = ref64.isfinite()
    assert torch.equal(finite, got.isfinite()), f"{where}: {name} differs in which elements are infinite"
    err = (got.double() - ref64)[finite].abs().max().item() if finite.any() else 0.0
    tol = 2 * (low.double() - ref64)[finite].abs().max().item() + extra + 1e-4 if finite.any() else 0.0
    assert err <= tol, f"{where}: {name} max|err| = {err:.3e} > {tol:.3e}"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_varlen_matches_reference(case: Case):
    from flash_gen.runtime.bwd import attention_bwd
    from flash_gen.runtime.fwd import attention_fwd

    config = None
    if case.sm90_config:
        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("forces a Hopper forward tiling: needs an sm_90 GPU")
        config = sm90_config_from_name(case.sm90_config)
    seed = fresh_seed()
    where = f"{case} seed={seed}"
    q, k, v, dout, alibi = _inputs(case, seed)
    kwargs = _kwargs(case, alibi)
    cu_q, cu_k = _cu(case.lens_q), _cu(case.lens_k)
    args = validate_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kwargs)
    norm = dict(softmax_scale=args.softmax_scale, causal=args.causal, window_size=args.window_size,
                softcap=args.softcap, alibi_slopes=alibi, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out = torch.full_like(q, float("nan"))
    out, lse = attention_fwd(q, k, v, out=out, config=config, **norm)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    attention_bwd(dout, q, k, v, out, lse, *grads, deterministic=case.deterministic, **norm)

    out64, lse64, grads64, budgets = _reference(case, q, k, v, dout, upcast=True, **kwargs)
    out_lo, lse_lo, grads_lo, _ = _reference(case, q, k, v, dout, upcast=False, **kwargs)
    _check("out", out, out64, out_lo, where)
    _check("lse", lse, lse64, lse_lo, where)
    for name, g, r, lo, extra in zip(("dq", "dk", "dv"), grads, grads64, grads_lo, budgets):
        _check(name, g, r, lo, where, extra)


def _autograd(fn, inputs, dout, *args, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves, *args, **kwargs)
    out.backward(dout)
    return out, [t.grad for t in leaves]


def test_varlen_packed_variants_agree():
    """The kv- and qkv-packed varlen functions give flash_attn_varlen_func's output and gradients (one packed
    gradient tensor), with max_seqlen given as an int, a tensor or None."""
    lens = (100, 0, 257, 31)
    case = Case("bf16", 64, lens, lens, 4, 4, "causal", deterministic=True)
    q, k, v, dout, _ = _inputs(case, fresh_seed())
    cu = _cu(lens)
    kwargs = dict(causal=True, deterministic=True)
    out, (dq, dk, dv) = _autograd(flash_attn_varlen_func, (q, k, v), dout, cu, cu, 257, 257, **kwargs)
    out_kv, (dq2, dkv) = _autograd(flash_attn_varlen_kvpacked_func, (q, torch.stack([k, v], 1)), dout, cu, cu,
                                   torch.tensor(257), None, **kwargs)
    out_qkv, (dqkv,) = _autograd(flash_attn_varlen_qkvpacked_func, (torch.stack([q, k, v], 1),), dout, cu, None,
                                 **kwargs)
    assert torch.equal(out_kv, out) and torch.equal(out_qkv, out)
    assert torch.equal(dq2, dq) and torch.equal(dkv, torch.stack([dk, dv], 1))
    assert torch.equal(dqkv, torch.stack([dq, dk, dv], 1))


def test_varlen_step_captures_in_a_cuda_graph():
    """No host sync anywhere in a varlen forward+backward (capture would fail), and replay recomputes."""
    lens = (300, 5, 128)
    case = Case("bf16", 64, lens, lens, 4, 4, "causal")
    q, k, v, dout, _ = _inputs(case, fresh_seed())
    cu = _cu(lens)
    qkv = torch.stack([q, k, v], 1).requires_grad_()

    def step():
        out = flash_attn_varlen_qkvpacked_func(qkv, cu, None, causal=True)
        (grad,) = torch.autograd.grad(out, (qkv,), dout)
        return out, grad

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = step()  # warm-up (loads the kernels) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        qkv.mul_(0.5)
    graph.replay()
    expected = step()
    torch.cuda.synchronize()
    assert not torch.equal(eager[0], expected[0])
    assert torch.equal(captured[0], expected[0])
    torch.testing.assert_close(captured[1], expected[1], atol=2e-2, rtol=0)


@pytest.mark.parametrize("page", [1, 16, 256])
def test_varlen_over_a_paged_cache(page: int):
    """flash_attn_varlen_func with block_table: each entry's keys live in shuffled pages of a paged cache (pages of
    256 rows: on sm90 the Hopper kernel's cache form). Rows no entry uses are NaN: none may reach the result."""
    case = Case("bf16", 64, (0, 1, 130, 300), (5, 0, 200, 513), 4, 2, "causal")
    seed = fresh_seed()
    q, k, v, dout, _ = _inputs(case, seed)
    cu_q, cu_k = _cu(case.lens_q), _cu(case.lens_k)
    pages_per = -(-max(case.lens_k) // page)
    blocks = len(case.lens_k) * pages_per + 3
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    table = torch.randperm(blocks, generator=gen, device="cuda")[: len(case.lens_k) * pages_per].view(-1, pages_per)
    k_cache, v_cache = (torch.full((blocks, page, 2, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    starts = cu_k.tolist()
    for b, n in enumerate(case.lens_k):
        rows = torch.arange(n, device="cuda")
        index = (table[b].long()[rows // page], rows % page)
        k_cache[index], v_cache[index] = k[starts[b] : starts[b] + n], v[starts[b] : starts[b] + n]
    out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, None, None, causal=True,
                                 block_table=table.to(torch.int32))
    kwargs = _kwargs(case, None)
    out64 = _reference(case, q, k, v, dout, upcast=True, **kwargs)[0]
    out_lo = _reference(case, q, k, v, dout, upcast=False, **kwargs)[0]
    _check("out", out, out64, out_lo, f"page {page} seed={seed}")
