"""GPU correctness of the forward kernels against a float64 PyTorch reference with flash_attn 2.8's semantics.

Tolerance (flash_attn's rule): max|out - ref64| <= 2 * max|ref_lowprec - ref64| + 1e-5, where ref_lowprec is
the same reference run on the fp16/bf16 inputs with the matmuls in that dtype and the softmax in fp32.
The case list is drawn once with a fixed seed (stable test ids, bounded size); the inputs are fresh random
numbers on every run, and the seed is in every failure message so a failure can be replayed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from flash_gen import flash_attn_func
from flash_gen.validate import validate_fwd

from attn_reference import DTYPES, MASKS, SOFTCAP, attention_ref, fresh_seed

pytestmark = pytest.mark.gpu

HEAD_DIMS = (8, 32, 64, 72, 80, 96, 128, 160, 192, 256)
SEQLENS = ((1, 1), (113, 203), (128, 217), (256, 512), (512, 256), (1024, 1024), (108, 256), (799, 3))
BATCHES = (1, 7)
HEADS = ((6, 6), (6, 2), (6, 1))
FEATURES = ("plain", "softcap", "alibi_h", "alibi_bh")  # alibi_h: slopes (nheads,); alibi_bh: (batch, nheads)


@dataclass(frozen=True)
class Case:
    dtype: str
    head_dim: int
    seqlen_q: int
    seqlen_k: int
    batch: int
    nheads: int
    nheads_k: int
    mask: str
    feature: str = "plain"

    def __str__(self) -> str:
        return (
            f"{self.dtype}-d{self.head_dim}-{self.seqlen_q}x{self.seqlen_k}-b{self.batch}"
            f"-h{self.nheads}_{self.nheads_k}-{self.mask}-{self.feature}"
        )


def _cases() -> list[Case]:
    # Each (dtype, head dim, mask kind, feature) is a kernel to compile (about a minute of NVRTC each), so the
    # matrix covers every mask and feature densely at a few shapes and every head dim and length sparsely.
    rng = random.Random(20261129)
    # Every mask x feature x dtype at one shape with GQA and ragged lengths; every mask x feature at the
    # largest head dim with seqlen_q > seqlen_k and at a padded head dim with rows that see no key.
    cases = [Case(dt, 64, 113, 203, 7, 6, 2, m, f) for dt in DTYPES for m in MASKS for f in FEATURES]
    cases += [Case("bf16", 256, 512, 256, 1, 6, 6, m, f) for m in MASKS for f in FEATURES]
    cases += [Case("fp16", 80, 799, 3, 1, 6, 1, m, f) for m in MASKS for f in FEATURES]

    def draw(d: int, sq: int, sk: int) -> Case:
        dtype = rng.choice(list(DTYPES)) if d == 64 else "bf16"
        return Case(dtype, d, sq, sk, rng.choice(BATCHES), *rng.choice(HEADS), rng.choice(list(MASKS)))

    cases += [draw(d, sq, sk) for d in HEAD_DIMS for sq, sk in SEQLENS]  # every head dim meets every length
    cases += [draw(rng.choice(HEAD_DIMS), *rng.choice(SEQLENS)) for _ in range(40)]
    return list(dict.fromkeys(cases))


CASES = _cases()


def _inputs(case: Case, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device="cuda", dtype=DTYPES[case.dtype])  # noqa: E731
    q = randn(case.batch, case.seqlen_q, case.nheads, case.head_dim)
    k = randn(case.batch, case.seqlen_k, case.nheads_k, case.head_dim)
    v = randn(case.batch, case.seqlen_k, case.nheads_k, case.head_dim)
    slope_shape = {"alibi_h": (case.nheads,), "alibi_bh": (case.batch, case.nheads)}.get(case.feature)
    alibi = None
    if slope_shape:
        alibi = torch.rand(slope_shape, generator=gen, device="cuda") * 0.3 + 0.01
    return q, k, v, alibi


def _run(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, out=None, num_splits=0):
    """The runtime's forward on validated, normalized arguments, as flash_attn_func calls it, plus `out` and
    `num_splits`."""
    from flash_gen.runtime.fwd import attention_fwd

    args = validate_fwd(q, k, v, causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    return attention_fwd(
        q,
        k,
        v,
        softmax_scale=args.softmax_scale,
        causal=args.causal,
        window_size=args.window_size,
        softcap=args.softcap,
        alibi_slopes=alibi_slopes,
        out=out,
        num_splits=num_splits,
    )


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_matches_reference(case: Case):
    _check_case(case)


def _check_case(case: Case, num_splits: int = 0) -> None:
    """out and softmax_lse of the runtime's forward (num_splits as attention_fwd takes it) against the float64
    reference, out poisoned beforehand."""
    seed = fresh_seed()
    q, k, v, alibi = _inputs(case, seed)
    causal, window = MASKS[case.mask]
    softcap = SOFTCAP if case.feature == "softcap" else 0.0
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written by the kernel
    result, lse = _run(q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi, out=out,
                       num_splits=num_splits)
    where = f"{case} splits={num_splits} seed={seed}"
    assert result.data_ptr() == out.data_ptr(), f"{where}: out= was not written in place"
    assert not result.isnan().any(), f"{where}: {int(result.isnan().sum())} outputs never written (still NaN)"

    ref = dict(scale=case.head_dim**-0.5, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi)
    out64, lse64 = attention_ref(q, k, v, **ref, upcast=True)
    out_low, _ = attention_ref(q, k, v, **ref, upcast=False)
    err = (result.double() - out64).abs().max().item()
    tol = 2 * (out_low.double() - out64).abs().max().item() + 1e-5
    assert err <= tol, f"{where}: max|out - ref64| = {err:.3e} > {tol:.3e}"

    assert lse.shape == (case.batch, case.nheads, case.seqlen_q) and lse.dtype == torch.float32, where
    blind = torch.isinf(lse64)
    assert bool((lse[blind] == float("inf")).all()), f"{where}: rows that see no key must have lse = +inf"
    lse_err = ((lse.double() - lse64).abs() / (1 + lse64.abs()))[~blind]
    assert lse_err.numel() == 0 or lse_err.max().item() <= 1e-3, f"{where}: lse off by {lse_err.max().item():.3e}"


@pytest.mark.parametrize("case", [c for c in CASES if c.batch == 7 and c.seqlen_q > 1][:4], ids=str)
def test_api_matches_runtime(case: Case):
    q, k, v, alibi = _inputs(case, fresh_seed())
    causal, window = MASKS[case.mask]
    softcap = SOFTCAP if case.feature == "softcap" else 0.0
    kwargs = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi)
    out, lse = _run(q, k, v, **kwargs)
    assert torch.equal(flash_attn_func(q, k, v, **kwargs), out)
    # flash_attn without dropout: (out, softmax_lse, None)
    got = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert len(got) == 3 and got[2] is None and torch.equal(got[0], out) and torch.equal(got[1], lse)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("nheads_k", [6, 2])
def test_views_of_packed_qkv(dtype: str, nheads_k: int):
    """q, k, v sliced out of one packed tensor (strided, last dim dense) read in place give the same result."""
    b, s, h, d = 3, 257, 6, 64
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    packed = torch.randn(b, s, h + 2 * nheads_k, d, generator=gen, device="cuda", dtype=DTYPES[dtype])
    q, k, v = packed.split([h, nheads_k, nheads_k], dim=2)
    assert not q.is_contiguous()
    for causal in (False, True):
        expected = flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal)
        assert torch.equal(flash_attn_func(q, k, v, causal=causal), expected)


def test_requires_grad_inputs_run_forward():
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    q, k, v = (torch.randn(2, 64, 4, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    expected = flash_attn_func(q, k, v)
    assert torch.equal(flash_attn_func(q.requires_grad_(), k.requires_grad_(), v.requires_grad_()), expected)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)  # softmax_lse is not differentiable
    assert out.requires_grad and not lse.requires_grad
    out.sum().backward()
    assert all(t.grad is not None for t in (q, k, v))


def test_eager_calls_skip_the_dispatcher_and_traced_calls_keep_the_op(monkeypatch):
    """ops.call: an eager call that records no gradient runs the implementation directly, one that does goes
    through the eager autograd.Function; under a dispatch mode the custom op runs (the mode sees it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flash_gen import ops

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    q, k, v = (torch.randn(2, 77, 4, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    direct = []
    impl = ops._IMPLS[ops.fwd]
    monkeypatch.setitem(ops._IMPLS, ops.fwd, lambda *args: direct.append(1) or impl(*args))
    out = flash_attn_func(q, k, v)
    assert direct == [1]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out_grad = flash_attn_func(*leaves)
    assert type(out_grad.grad_fn).__name__.startswith("Eager_fwd") and torch.equal(out_grad, out)
    with Recorder() as mode:
        assert torch.equal(flash_attn_func(q, k, v), out)
    assert any("flash_gen.fwd" in name for name in mode.ops), mode.ops


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(seqlen_q: int, seqlen_k: int):
    q = torch.randn(2, seqlen_q, 4, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(2, seqlen_k, 4, 64, device="cuda", dtype=torch.float16)
    out = flash_attn_func(q, k, k, causal=True)
    assert out.shape == q.shape and out.dtype == q.dtype and not out.any()


# Tilings beyond the defaults, so every value of every config axis (block_m, block_n, warps, K/V stages,
# Q in registers, late V wait) runs through the reference check; benchmarks/sweep_fwd_configs.sh times the
# same set.
CONFIGS = {
    64: ("m128n64w4s1", "m128n64w4s2", "m128n128w8s1", "m64n64w4s1", "m128n64w8s1", "m128n64w4s1_qreg",
         "m128n64w4s1_vlate", "m128n64w4s2_qreg"),  # the last: the tuned tiling at hdim 64 (flash_gen/tuned)
    128: ("m128n32w4s1", "m128n32w4s2", "m64n64w4s1", "m64n64w4s2", "m128n64w4s1_vlate", "m128n64w8s1",
          "m128n64w8s2"),
    256: ("m64n64w4s1", "m64n32w4s1", "m128n32w8s1", "m128n64w8s2", "m64n64w4s2"),
}


def _check_forced(case: Case, config: str, pack_gqa: bool = False, num_splits: int = 1) -> None:
    """The runtime's forward forced to tiling `config` (pack-GQA or not, `num_splits`) against the float64
    reference."""
    from flash_gen.fwd_tilings import config_from_name
    from flash_gen.runtime.fwd import attention_fwd

    seed = fresh_seed()
    q, k, v, _ = _inputs(case, seed)
    causal, window = MASKS[case.mask]
    args = validate_fwd(q, k, v, causal=causal, window_size=window)
    out = torch.full_like(q, float("nan"))
    attention_fwd(q, k, v, softmax_scale=args.softmax_scale, causal=args.causal, window_size=args.window_size,
                  softcap=0.0, alibi_slopes=None, out=out, config=config_from_name(config), pack_gqa=pack_gqa,
                  num_splits=num_splits)
    ref = dict(scale=case.head_dim**-0.5, causal=causal, window=window, softcap=0.0, alibi_slopes=None)
    out64, _ = attention_ref(q, k, v, **ref, upcast=True)
    out_low, _ = attention_ref(q, k, v, **ref, upcast=False)
    err = (out.double() - out64).abs().max().item()
    tol = 2 * (out_low.double() - out64).abs().max().item() + 1e-5
    assert err <= tol, f"{case} {config} seed={seed}: max|out - ref64| = {err:.3e} > {tol:.3e}"


@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("head_dim,config", [(d, c) for d, cs in CONFIGS.items() for c in cs])
def test_configs_match_reference(head_dim: int, config: str, causal: bool):
    _check_forced(Case("bf16", head_dim, 333, 461, 3, 4, 2, "causal" if causal else "none"), config)


PACKED_CONFIGS = ("m128n64w4s1", "m64n64w4s2")


@pytest.mark.parametrize("mask", ["none", "causal", "win32_0"])
@pytest.mark.parametrize("config", PACKED_CONFIGS)
def test_portable_pack_gqa_matches_reference(config: str, mask: str):
    """Pack-GQA over dense K/V on the portable kernel: each tile stacks a KV head's 7 query heads (few positions)."""
    _check_forced(Case("bf16", 64, 37, 300, 2, 14, 2, mask), config, pack_gqa=True)


# Split-KV over dense K/V (the default kernel's split form, then the combine): every mask and feature with GQA
# and a query tile's keys shared by 3 CTAs, some of which see no key under the narrow windows; MHA with one query
# row; a group of 8 at head dim 256.
SPLIT_CASES = [Case("bf16", 128, 37, 1000, 2, 8, 2, m, f) for m in MASKS for f in FEATURES]
SPLIT_CASES += [Case("fp16", 64, 1, 777, 3, 4, 4, m) for m in ("none", "causal")]
SPLIT_CASES += [Case("bf16", 256, 3, 1500, 1, 8, 1, "causal")]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
def test_split_kv_matches_reference(case: Case):
    _check_case(case, num_splits=3)


def test_more_splits_than_key_tiles():
    """Splits past the last key tile see no key: their partials must weigh nothing in the combine."""
    _check_case(Case("fp16", 64, 5, 300, 2, 4, 4, "causal"), num_splits=16)


@pytest.mark.parametrize("pack_gqa", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("mask", ["none", "causal", "win32_0"])
def test_portable_split_kv_matches_reference(mask: str, pack_gqa: bool):
    """The portable kernel's split form over dense K/V (other archs, and the Hopper kernel's fallback)."""
    _check_forced(Case("bf16", 128, 21, 1500, 2, 8, 2, mask), "m64n64w4s2", pack_gqa=pack_gqa, num_splits=3)


def test_few_query_tiles_split_their_keys():
    """A decoding-like dense call (one query position, a long key sequence) splits its keys; a full GPU's worth
    of query tiles and a short key sequence do not; the split call against the reference."""
    from flash_gen.runtime.fwd import plan_fwd

    score = dict(softmax_scale=0.1, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None)
    kv = torch.randn(2, 8192, 2, 128, device="cuda", dtype=torch.bfloat16)
    assert plan_fwd(torch.empty(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16), kv, kv, **score).splits > 1
    assert plan_fwd(torch.empty(2, 4096, 8, 128, device="cuda", dtype=torch.bfloat16), kv, kv, **score).splits == 1
    short = kv[:, :256]
    assert plan_fwd(torch.empty(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16), short, short, **score).splits == 1
    _check_case(Case("bf16", 128, 1, 8192, 2, 8, 2, "causal"))


def test_split_calls_replay_in_cuda_graphs_and_compile():
    """A split call (its kernel, the combine, fp32 partials from PyTorch's allocator) replays from a CUDA graph
    and traces under torch.compile(fullgraph=True), bitwise as the eager call."""
    case = Case("bf16", 128, 1, 8192, 2, 8, 2, "causal")
    q, k, v, _ = _inputs(case, fresh_seed())
    call = lambda: flash_attn_func(q, k, v, causal=True)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # kernels loaded before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = call()
    q.copy_(_inputs(case, fresh_seed())[0])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, call())
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True)
    assert torch.equal(compiled(q, k, v), call())
