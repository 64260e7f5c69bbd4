"""GPU tests of flash_attn_with_kvcache and merge_attention_states against a float64 reference built entry by
entry (flash_attn's rule: error at most twice PyTorch's own in the input dtype, plus 1e-4): contiguous and paged
caches (page sizes 1, 16, 256), appended keys, rotary (interleaved or not), cache_batch_idx, cache_leftpad, int
and tensor cache_seqlens, seqlen_q 1 and 4 (decoding: the portable kernel) and 40-100 (chunks: on sm90 the Hopper
kernel), masks, softcap, ALiBi, MQA/GQA, split-KV 1..N and the heuristic. Cache rows an entry does not use (past its
length, before its left padding) hold NaN: no kernel may let them into the result. The cache after an append must
equal the reference's (V bit for bit; K after rotary within one rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from flash_gen import flash_attn_with_kvcache, merge_attention_states
from flash_gen.memo import BoundedMemo

from attn_reference import DTYPES, MASKS, SOFTCAP, attention_ref, fresh_seed

pytestmark = pytest.mark.gpu


@dataclass(frozen=True)
class Case:
    page: int  # 0: contiguous cache
    seqlen_q: int = 1
    new: int = 0  # appended rows
    rotary: str = ""  # "" | "interleaved" | "neox"
    batch_idx: bool = False
    leftpad: bool = False
    mask: str = "causal"
    feature: str = "plain"  # plain | softcap | alibi
    splits: int = 1
    int_seqlens: bool = False
    dtype: str = "bf16"
    head_dim: int = 128
    nheads_k: int = 2  # of 8 query heads: 2 (GQA), 1 (MQA) or 8 (one query head per KV head: no packing)

    def __str__(self) -> str:
        parts = [f"page{self.page}" if self.page else "contig", f"q{self.seqlen_q}", f"new{self.new}",
                 self.rotary or "norot", self.mask, self.feature, f"split{self.splits}", self.dtype,
                 f"d{self.head_dim}", f"hk{self.nheads_k}"]
        parts += [p for p, on in (("bidx", self.batch_idx), ("leftpad", self.leftpad), ("intlen", self.int_seqlens))
                  if on]
        return "-".join(parts)


CASES = [
    Case(0, splits=1),
    Case(0, splits=3),
    Case(0, splits=0),
    Case(0, seqlen_q=4, new=4, rotary="interleaved", batch_idx=True, leftpad=True, splits=2),
    Case(0, new=1, rotary="neox", mask="none", int_seqlens=True, splits=4),
    Case(16, new=3, rotary="neox", mask="none", splits=1),
    Case(16, seqlen_q=4, new=4, rotary="interleaved", leftpad=True, splits=5),
    Case(256, new=2, splits=1),
    Case(256, seqlen_q=4, new=4, rotary="interleaved", splits=3),
    Case(1, new=1, mask="win64_64", feature="softcap", splits=2),
    Case(0, mask="none", feature="alibi", splits=2, dtype="fp16", head_dim=64),
    Case(16, seqlen_q=4, new=2, mask="causal", splits=3, nheads_k=1),
    Case(0, seqlen_q=4, new=2, mask="win32_0", splits=1, nheads_k=8),
    # One host-known length for every entry of a contiguous cache: read tile by tile with the length as a per-call
    # field, or (600+ positions, whose query tiles fill an H200's SMs) the dense Hopper kernel over views of it.
    Case(0, seqlen_q=4, new=4, int_seqlens=True, splits=0),
    Case(0, seqlen_q=650, int_seqlens=True, splits=0),
    Case(0, seqlen_q=660, new=20, mask="none", int_seqlens=True, splits=0, nheads_k=8),
    Case(0, seqlen_q=100, new=3, mask="none", int_seqlens=True, splits=0),
    Case(0, new=2, mask="win32_0", feature="softcap", int_seqlens=True, splits=3, nheads_k=8),
    Case(0, mask="none", feature="alibi", int_seqlens=True, splits=2, dtype="fp16", head_dim=64),
    Case(0, seqlen_q=4, new=2, rotary="interleaved", int_seqlens=True, nheads_k=1),
    # A KV head's query rows fill a consumer warpgroup (fwd_tilings.cache_chunk_runs_hopper): on sm90 the Hopper
    # kernel's cache form, the last key tile's stale (NaN) V rows zeroed in shared memory.
    Case(0, seqlen_q=64, new=64, splits=0),
    Case(256, seqlen_q=40, new=40, rotary="neox", splits=1),
    Case(0, seqlen_q=100, leftpad=True, batch_idx=True, mask="win64_64", feature="softcap", splits=3, nheads_k=8),
    Case(128, seqlen_q=64, new=5, mask="none", feature="alibi", splits=0, dtype="fp16", head_dim=64),
    Case(512, seqlen_q=70, mask="causal", splits=2, head_dim=256, nheads_k=1),
    Case(256, seqlen_q=48, new=48, rotary="interleaved", mask="win32_0", splits=0, dtype="fp16", head_dim=96),
    Case(128, seqlen_q=32, new=7, mask="causal", splits=0, head_dim=80),  # the Hopper cache form, 32-byte swizzle
]

BATCH, NHEADS, CAPACITY = 3, 8, 700


def _rotate64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, interleaved: bool):
    """The reference rotary embedding in float64: x (b, s, h, d), pos (b, s)."""
    half = cos.shape[1]
    c, s = cos.double()[pos][:, :, None], sin.double()[pos][:, :, None]
    x = x.double()
    if interleaved:
        x1, x2 = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = x[..., :half], x[..., half : 2 * half]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot, x[..., 2 * half :]), dim=-1)


def _setup(case: Case, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = DTYPES[case.dtype]
    randn = lambda *shape: torch.randn(*shape, generator=gen, device="cuda", dtype=dtype)  # noqa: E731
    randint = lambda lo, hi, shape: torch.randint(lo, hi, shape, generator=gen, device="cuda")  # noqa: E731
    d = case.head_dim
    q = randn(BATCH, case.seqlen_q, NHEADS, d)
    entries = BATCH + 2 if case.batch_idx else BATCH
    k_logical, v_logical = randn(entries, CAPACITY, case.nheads_k, d), randn(entries, CAPACITY, case.nheads_k, d)
    seqlens = randint(0, CAPACITY - case.new + 1, (BATCH,)).to(torch.int32)
    seqlens[0] = CAPACITY - case.new  # one entry full to the last row
    if case.int_seqlens:
        seqlens[:] = seqlens[1]
    leftpad = None
    if case.leftpad:
        leftpad = (torch.rand(BATCH, generator=gen, device="cuda") * seqlens.float()).to(torch.int32)
    batch_idx = torch.randperm(entries, generator=gen, device="cuda")[:BATCH].to(torch.int32) if case.batch_idx \
        else None
    k_new = randn(BATCH, case.new, case.nheads_k, d) if case.new else None
    v_new = randn(BATCH, case.new, case.nheads_k, d) if case.new else None
    cos = sin = None
    if case.rotary:
        angle = torch.rand(CAPACITY + case.seqlen_q, d // 4, generator=gen, device="cuda") * 6.3
        cos, sin = torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)
    alibi = torch.rand(BATCH, NHEADS, generator=gen, device="cuda") * 0.3 + 0.01 if case.feature == "alibi" else None
    return q, k_logical, v_logical, seqlens, leftpad, batch_idx, k_new, v_new, cos, sin, alibi


def _paged(case: Case, k_logical: torch.Tensor, v_logical: torch.Tensor, seed: int):
    """A paged copy of the logical cache (entries = batch here): shuffled pages plus unused ones."""
    pages_per = -(-CAPACITY // case.page)
    num_blocks = BATCH * pages_per + 5
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    table = torch.randperm(num_blocks, generator=gen, device="cuda")[: BATCH * pages_per].view(BATCH, pages_per)
    shape = (num_blocks, case.page, case.nheads_k, k_logical.shape[-1])
    k_paged, v_paged = (torch.randn(shape, device="cuda", dtype=k_logical.dtype) for _ in range(2))
    padded = pages_per * case.page
    for src, dst in ((k_logical, k_paged), (v_logical, v_paged)):
        full = torch.full((BATCH, padded, *src.shape[2:]), float("nan"), device="cuda", dtype=src.dtype)
        full[:, :CAPACITY] = src[:BATCH]
        dst[table.flatten()] = full.view(BATCH * pages_per, case.page, *src.shape[2:])
    return k_paged, v_paged, table.to(torch.int32)


def _unpage(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    b, pages = table.shape
    return cache[table.long().flatten()].view(b, pages * cache.shape[1], *cache.shape[2:])[:, :CAPACITY]


def _reference(case, q, k_cache, v_cache, seqlens, leftpad, batch_idx, cos, sin, alibi, *, upcast: bool):
    """(out, lse) entry by entry over the reference cache (batch, CAPACITY, hk, d) already appended/rotated."""
    causal, window = MASKS[case.mask]
    outs, lses = [], []
    for b in range(BATCH):
        end = int(seqlens[b]) + case.new
        start = int(leftpad[b]) if leftpad is not None else 0
        qb = q[b : b + 1]
        kb, vb = k_cache[b : b + 1, start:end], v_cache[b : b + 1, start:end]
        slopes = alibi[b] if alibi is not None else None
        out, lse = attention_ref(qb, kb, vb, scale=q.shape[-1] ** -0.5, causal=causal, window=window,
                                 softcap=SOFTCAP if case.feature == "softcap" else 0.0, alibi_slopes=slopes,
                                 upcast=upcast)
        if kb.shape[1] == 0:
            out, lse = torch.zeros_like(out), torch.full_like(lse, float("inf"))
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kvcache_matches_reference(case: Case):
    _check_case(case)


@pytest.mark.parametrize("case", [CASES[2], CASES[7], CASES[4], Case(0, seqlen_q=64, new=64, splits=0), CASES[13],
                                  Case(0, seqlen_q=64, new=64, int_seqlens=True, splits=0)], ids=str)
def test_a_repeated_layout_runs_its_kept_plan_on_new_tensors(case: Case):
    """A decoding loop repeats one layout: later calls run the first call's checks and plan (ops and runtime
    memos) with new tensors at other addresses, new lengths and, for an int length, a new value (patched into the
    plan of its length class: portable and Hopper kernels, split by the heuristic or forced)."""
    _check_case(case)
    held = torch.empty(1 << 22, device="cuda")  # the next call's tensors land elsewhere
    _check_case(case)
    del held


def _check_case(case: Case) -> None:
    """One flash_attn_with_kvcache call of `case` on fresh random inputs against the float64 reference."""
    seed = fresh_seed()
    where = f"{case} seed={seed}"
    q, k_log, v_log, seqlens, leftpad, batch_idx, k_new, v_new, cos, sin, alibi = _setup(case, seed)
    causal, window = MASKS[case.mask]

    # Reference cache after the append (rotary on the new keys), and rotated queries, in float64.
    entries = batch_idx.long() if batch_idx is not None else torch.arange(BATCH, device="cuda")
    # Rows an entry does not use are NaN: a kernel that lets one into the softmax or the P V product (0 x NaN)
    # makes the output NaN.
    for b in range(BATCH):
        end, start = int(seqlens[b]) + case.new, int(leftpad[b]) if leftpad is not None else 0
        for t in (k_log, v_log):
            t[entries[b], end:] = float("nan")
            t[entries[b], :start] = float("nan")
    k_ref, v_ref = k_log[entries].clone(), v_log[entries].clone()
    q_ref = q
    if case.new:
        pos = seqlens.long()[:, None] + torch.arange(case.new, device="cuda")
        k_rows = _rotate64(k_new, cos, sin, pos, case.rotary == "interleaved").to(q.dtype) if case.rotary else k_new
        for b in range(BATCH):
            k_ref[b, pos[b]] = k_rows[b]
            v_ref[b, pos[b]] = v_new[b]
    if case.rotary:
        offsets = torch.arange(case.seqlen_q, device="cuda") if case.mask != "none" else torch.zeros(
            case.seqlen_q, dtype=torch.long, device="cuda")
        q_pos = seqlens.long()[:, None] + offsets
        q_ref = _rotate64(q, cos, sin, q_pos, case.rotary == "interleaved").to(q.dtype)

    if case.page:
        k_cache, v_cache, table = _paged(case, k_log, v_log, seed)
    else:
        k_cache, v_cache, table = k_log.clone(), v_log.clone(), None
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
        cache_seqlens=int(seqlens[0]) if case.int_seqlens else seqlens, cache_batch_idx=batch_idx,
        cache_leftpad=leftpad, block_table=table, causal=causal, window_size=window,
        softcap=SOFTCAP if case.feature == "softcap" else 0.0, rotary_interleaved=case.rotary == "interleaved",
        alibi_slopes=alibi, num_splits=case.splits, return_softmax_lse=True)

    got_k = _unpage(k_cache, table) if case.page else k_cache[entries]
    got_v = _unpage(v_cache, table) if case.page else v_cache[entries]
    torch.testing.assert_close(got_v, v_ref, atol=0, rtol=0, equal_nan=True,
                               msg=lambda m: f"{where}: v_cache after the append differs: {m}")
    torch.testing.assert_close(got_k, k_ref, atol=2e-2, rtol=1e-2, equal_nan=True,
                               msg=lambda m: f"{where}: k_cache: {m}")

    # q rotated in float64 and rounded once, like the kernel's input; the low-precision reference shares it.
    out64, lse64 = _reference(case, q_ref, k_ref, v_ref, seqlens, leftpad, batch_idx, cos, sin, alibi, upcast=True)
    out_lo, lse_lo = _reference(case, q_ref, k_ref, v_ref, seqlens, leftpad, batch_idx, cos, sin, alibi,
                                upcast=False)
    assert not out.isnan().any(), f"{where}: out has NaN"
    for name, got, ref, lo in (("out", out, out64, out_lo), ("lse", lse, lse64, lse_lo)):
        finite = ref.isfinite()
        assert torch.equal(finite, got.isfinite()), f"{where}: {name} differs in which rows see no key"
        err = (got.double() - ref)[finite].abs().max().item()
        tol = 2 * (lo.double() - ref)[finite].abs().max().item() + 1e-4
        if case.rotary:  # q and the new keys were rounded once more than in the low-precision reference
            tol += 2e-2 if name == "out" else 2e-3
        assert err <= tol, f"{where}: {name} max|err| = {err:.3e} > {tol:.3e}"


@pytest.mark.parametrize("seqlen_q,hopper", [(1, False), (4, False), (16, True), (64, True)])
def test_chunks_over_a_cache_run_the_hopper_kernel_and_decoding_steps_the_portable_one(monkeypatch, seqlen_q, hopper):
    """GQA 8/2 over a paged cache with tensor lengths: from 64 query rows per KV head (16 positions x 4 heads) the
    Hopper kernel's cache form runs on sm90, below it the portable kernel."""
    from flash_gen.runtime import fwd_kvcache
    from flash_gen.spec_sm90 import Sm90FwdConfig

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel runs on sm90")
    # plan anew: an earlier test's plan has no variant call
    monkeypatch.setattr(fwd_kvcache, "_cache_routes", BoundedMemo(256))
    ran = []
    variant = fwd_kvcache._variant
    monkeypatch.setattr(fwd_kvcache, "_variant", lambda *a, **kw: ran.append(variant(*a, **kw)) or ran[-1])
    case = Case(256, seqlen_q=seqlen_q)
    q, k_log, v_log, seqlens, *_ = _setup(case, fresh_seed())
    k_cache, v_cache, table = _paged(case, k_log, v_log, 0)
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, causal=True)
    assert [isinstance(v.cfg, Sm90FwdConfig) for v in ran] == [hopper]



@pytest.mark.parametrize("seqlen_q,dense", [(4, False), (100, False), (650, True)])
def test_an_int_length_runs_dense_where_the_query_tiles_fill_the_sms(monkeypatch, seqlen_q, dense):
    """With one int length for every entry of a contiguous cache the dense Hopper kernel runs over views of its
    first rows once the query tiles (8 heads x 3 entries x 128-row tiles) fill an H200's 132 SMs; smaller calls
    read the cache tile by tile."""
    from flash_gen.runtime import driver, fwd_kvcache

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the dense route is the Hopper kernel's")
    monkeypatch.setattr(driver, "sm_count", lambda device: 132)
    monkeypatch.setattr(fwd_kvcache, "_cache_routes", BoundedMemo(256))
    dense_calls = []
    real = fwd_kvcache.attention_fwd
    monkeypatch.setattr(fwd_kvcache, "attention_fwd", lambda *a, **kw: dense_calls.append(1) or real(*a, **kw))
    q, k_cache, v_cache, *_ = _setup(Case(0, seqlen_q=seqlen_q, int_seqlens=True), fresh_seed())
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=600)
    assert bool(dense_calls) == dense

def test_splits_agree_with_one_split():
    """Any split count gives the unsplit result up to fp32 reassociation."""
    case = Case(16, seqlen_q=4, mask="causal")
    q, k_log, v_log, seqlens, *_ = _setup(case, fresh_seed())
    k_cache, v_cache, table = _paged(case, k_log, v_log, 0)
    kwargs = dict(cache_seqlens=seqlens, block_table=table, causal=True, return_softmax_lse=True)
    out1, lse1 = flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=1, **kwargs)
    for splits in (2, 7, 64):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=splits, **kwargs)
        torch.testing.assert_close(out, out1, atol=1e-2, rtol=0)
        torch.testing.assert_close(lse, lse1, atol=1e-4, rtol=0)


def test_merge_attention_states_is_attention_over_the_union():
    from flash_gen import ops

    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    q, k, v = (torch.randn(2, 100, 4, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    attn = (None, None, None, False, -1, -1, 0.0, None, False, 0.0, None)
    out_full, lse_full = ops.fwd(q, k, v, *attn)
    out_a, lse_a = ops.fwd(q, k[:, :37], v[:, :37], *attn)
    out_b, lse_b = ops.fwd(q, k[:, 37:], v[:, 37:], *attn)
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, out_full, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, lse_full, atol=1e-3, rtol=0)
    empty = torch.full_like(lse_b, float("inf"))  # a side that saw no key
    out, lse = merge_attention_states(out_a, lse_a, torch.zeros_like(out_b), empty)
    torch.testing.assert_close(out, out_a, atol=1e-2, rtol=0)
    torch.testing.assert_close(lse, lse_a)


def test_decoding_step_captures_in_a_cuda_graph():
    """Append + attention with tensor cache_seqlens: no host sync (capture would fail), replays recompute."""
    case = Case(16, new=1)
    q, k_log, v_log, seqlens, _, _, k_new, v_new, *_ = _setup(case, fresh_seed())
    k_cache, v_cache, table = _paged(case, k_log, v_log, 0)
    step = lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,  # noqa: E731
                                           block_table=table, causal=True, num_splits=3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    q.mul_(0.5)
    graph.replay()
    expected = step()
    torch.cuda.synchronize()
    assert torch.equal(captured, expected)
