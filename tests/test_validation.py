"""CPU tests of the forward API's input contract (flash_gen.validate) and of `import flash_gen` staying light."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch

from flash_gen.ops import empty_outputs
from flash_gen.validate import check_device, check_fwd, derive_mask, validate_fwd

B, SQ, SK, H, HK, D = 2, 16, 32, 6, 2, 64


def make(b=B, sq=SQ, sk=SK, h=H, hk=HK, d=D, dtype=torch.float16, device="cpu"):
    q = torch.randn(b, sq, h, d, dtype=dtype, device=device)
    k = torch.randn(b, sk, hk, d, dtype=dtype, device=device)
    v = torch.randn(b, sk, hk, d, dtype=dtype, device=device)
    return q, k, v


def replaced(**tensors):
    """Base q, k, v with some of them replaced."""
    q, k, v = make()
    base = {"q": q, "k": k, "v": v, **tensors}
    return base["q"], base["k"], base["v"]


def strided_last_dim():
    return torch.randn(B, SQ, H, 2 * D, dtype=torch.float16)[..., ::2]


# (name of the argument the error must name, exception, q/k/v overrides, keyword overrides)
BAD_INPUTS = {
    "q not a tensor": ("q", TypeError, {"q": [[1.0]]}, {}),
    "q float32": ("q", TypeError, {"q": torch.randn(B, SQ, H, D)}, {}),
    "k bf16 vs q fp16": ("k", TypeError, {"k": torch.randn(B, SK, HK, D, dtype=torch.bfloat16)}, {}),
    "v bf16 vs q fp16": ("v", TypeError, {"v": torch.randn(B, SK, HK, D, dtype=torch.bfloat16)}, {}),
    "q 3 dims": ("q", ValueError, {"q": torch.randn(SQ, H, D, dtype=torch.float16)}, {}),
    "v 5 dims": ("v", ValueError, {"v": torch.randn(1, B, SK, HK, D, dtype=torch.float16)}, {}),
    "batch 0": ("q", ValueError, dict(zip("qkv", make(b=0))), {}),
    "k batch mismatch": ("k", ValueError, {"k": torch.randn(B + 1, SK, HK, D, dtype=torch.float16)}, {}),
    "k head_dim mismatch": ("k", ValueError, {"k": torch.randn(B, SK, HK, D + 8, dtype=torch.float16)}, {}),
    "v batch mismatch": ("v", ValueError, {"v": torch.randn(B + 1, SK, HK, D, dtype=torch.float16)}, {}),
    "v seqlen_k mismatch": ("v", ValueError, {"v": torch.randn(B, SK + 1, HK, D, dtype=torch.float16)}, {}),
    "v nheads_k mismatch": ("v", ValueError, {"v": torch.randn(B, SK, HK + 1, D, dtype=torch.float16)}, {}),
    "v head_dim mismatch": ("v", ValueError, {"v": torch.randn(B, SK, HK, D + 8, dtype=torch.float16)}, {}),
    "nheads % nheads_k": ("k", ValueError, dict(zip("qkv", make(h=6, hk=4))), {}),
    "nheads_k 0": ("k", ValueError, dict(zip("qkv", make(hk=0))), {}),
    "head_dim 264": ("q", ValueError, dict(zip("qkv", make(d=264))), {}),
    "head_dim 60": ("q", ValueError, dict(zip("qkv", make(d=60))), {}),
    "q last dim strided": ("q", ValueError, {"q": strided_last_dim()}, {}),
    "k last dim strided": ("k", ValueError, {"k": torch.randn(B, SK, HK, D, dtype=torch.float16).mT}, {}),
    "q misaligned base": ("q", ValueError, {"q": torch.randn(B, SQ, H, D + 8, dtype=torch.float16)[..., 1 : D + 1]}, {}),
    "v misaligned stride": ("v", ValueError, {"v": torch.randn(B, SK, HK, D + 4, dtype=torch.float16)[..., :D]}, {}),
    "window not a pair": ("window_size", TypeError, {}, {"window_size": 3}),
    "window 3 values": ("window_size", ValueError, {}, {"window_size": (1, 2, 3)}),
    "window float": ("window_size", TypeError, {}, {"window_size": (1.5, 0)}),
    "window bool": ("window_size", TypeError, {}, {"window_size": (True, 0)}),
    "window < -1": ("window_size", ValueError, {}, {"window_size": (-2, 0)}),
    "alibi not a tensor": ("alibi_slopes", TypeError, {}, {"alibi_slopes": [0.1] * H}),
    "alibi float16": ("alibi_slopes", TypeError, {}, {"alibi_slopes": torch.rand(H, dtype=torch.float16)}),
    "alibi wrong heads": ("alibi_slopes", ValueError, {}, {"alibi_slopes": torch.rand(H + 1)}),
    "alibi wrong batch": ("alibi_slopes", ValueError, {}, {"alibi_slopes": torch.rand(B + 1, H)}),
    "alibi 3 dims": ("alibi_slopes", ValueError, {}, {"alibi_slopes": torch.rand(B, H, 1)}),
    "alibi non-contiguous": ("alibi_slopes", ValueError, {}, {"alibi_slopes": torch.rand(H, B).t()}),
    "softcap negative": ("softcap", ValueError, {}, {"softcap": -1.0}),
    "softcap inf": ("softcap", ValueError, {}, {"softcap": float("inf")}),
    "softcap nan": ("softcap", ValueError, {}, {"softcap": float("nan")}),
    "softcap str": ("softcap", TypeError, {}, {"softcap": "30"}),
    "softmax_scale 0": ("softmax_scale", ValueError, {}, {"softmax_scale": 0.0}),
    "softmax_scale negative": ("softmax_scale", ValueError, {}, {"softmax_scale": -0.125}),
    "softmax_scale inf": ("softmax_scale", ValueError, {}, {"softmax_scale": float("inf")}),
    "softmax_scale nan": ("softmax_scale", ValueError, {}, {"softmax_scale": float("nan")}),
    "softmax_scale tensor": ("softmax_scale", TypeError, {}, {"softmax_scale": torch.tensor(0.125)}),
    "causal int": ("causal", TypeError, {}, {"causal": 1}),
    "dropout_p 1": ("dropout_p", ValueError, {}, {"dropout_p": 1.0}),
    "dropout_p > 1": ("dropout_p", ValueError, {}, {"dropout_p": 1.5}),
    "dropout_p < 0": ("dropout_p", ValueError, {}, {"dropout_p": -0.1}),
    "dropout_p str": ("dropout_p", TypeError, {}, {"dropout_p": "0"}),
    "return_attn_probs int": ("return_attn_probs", TypeError, {}, {"return_attn_probs": 1}),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_names_the_argument(case):
    arg, exc, tensors, kwargs = BAD_INPUTS[case]
    q, k, v = replaced(**tensors)
    with pytest.raises(exc, match=rf"^{arg}:"):
        check_fwd(q, k, v, **kwargs)


def test_dropout_and_probabilities_are_accepted():
    q, k, v = make()
    check_fwd(q, k, v, dropout_p=0.5)
    check_fwd(q, k, v, return_attn_probs=True)  # (out, softmax_lse, None), no probabilities


def test_valid_input_is_normalized():
    q, k, v = make()
    args = check_fwd(q, k, v)
    assert (args.batch, args.seqlen_q, args.seqlen_k, args.nheads, args.nheads_k, args.head_dim) == (
        B, SQ, SK, H, HK, D,
    )
    assert args.dtype == "fp16" and args.mask == "none" and args.window_size == (-1, -1)
    assert args.softmax_scale == pytest.approx(D**-0.5)
    assert args.softcap == 0.0 and not args.alibi and not args.empty
    assert check_fwd(q, k, v, softmax_scale=1).softmax_scale == 1.0
    assert check_fwd(q.bfloat16(), k.bfloat16(), v.bfloat16()).dtype == "bf16"
    full = check_fwd(q, k, v, causal=True, softcap=30, alibi_slopes=torch.rand(B, H))
    assert full.causal and full.softcap == 30.0 and full.alibi
    assert check_fwd(q, k, v, alibi_slopes=torch.rand(H)).alibi


def test_strided_views_are_accepted():
    """Only the head dim must be dense: views of a packed qkv tensor and broadcast K/V heads need no copy."""
    qkv = torch.randn(B, SQ, 3, H, D, dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    check_fwd(q, k, v)
    k1 = torch.randn(B, SK, 1, D, dtype=torch.bfloat16).expand(B, SK, 3, D)
    assert check_fwd(q, k1, k1).nheads_k == 3


def test_meta_tensors_are_checked():
    q, k, v = make(device="meta")
    assert check_fwd(q, k, v, causal=True).mask == "causal"
    with pytest.raises(ValueError, match="^k:"):
        check_fwd(q, k[:1], v)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_device_check_rejects_non_cuda(device):
    q, k, v = make(device=device)
    with pytest.raises(ValueError, match="^q: flash_gen needs CUDA tensors"):
        check_device(q, k=k, v=v)
    # validate_fwd is check_fwd followed by the device check: valid CPU input still fails, naming q.
    with pytest.raises(ValueError, match="^q: flash_gen needs CUDA tensors"):
        validate_fwd(q, k, v)


@pytest.mark.gpu
def test_device_check_rejects_mixed_devices():
    q, k, v = make(device="cuda")
    check_device(q, k=k, v=v, alibi_slopes=torch.rand(H, device="cuda"))
    with pytest.raises(ValueError, match="^k: flash_gen needs CUDA tensors"):
        check_device(q, k=k.cpu(), v=v)
    with pytest.raises(ValueError, match="^alibi_slopes: flash_gen needs CUDA tensors"):
        check_device(q, k=k, v=v, alibi_slopes=torch.rand(H))
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="^cu_seqlens_q: flash_gen needs CUDA tensors"):
        validate_fwd(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu.cuda())


# (causal, window_size, seqlen_q, seqlen_k) -> (mask, normalized window)
MASK_TABLE = [
    (False, (-1, -1), 128, 128, "none", (-1, -1)),
    (True, (-1, -1), 128, 128, "causal", (-1, 0)),
    (False, (-1, 0), 128, 128, "causal", (-1, 0)),  # flash_attn: window (-1, 0) is causal
    (True, (-1, 17), 128, 128, "causal", (-1, 0)),  # causal forces right = 0
    (True, (32, 5), 128, 128, "local", (32, 0)),
    (False, (32, 0), 128, 128, "local", (32, 0)),
    (False, (-1, 17), 128, 128, "local", (-1, 17)),
    (False, (64, 64), 128, 128, "local", (64, 64)),
    (False, (0, 0), 128, 128, "local", (0, 0)),
    (False, (5, -1), 128, 128, "local", (5, -1)),
    # Bounds that cannot hide a key are dropped: left >= seqlen_k - 1, right >= seqlen_q - 1.
    (False, (127, -1), 128, 128, "none", (-1, -1)),
    (False, (126, -1), 128, 128, "local", (126, -1)),
    (False, (-1, 127), 128, 128, "none", (-1, -1)),
    (False, (-1, 126), 128, 128, "local", (-1, 126)),
    (False, (500, 0), 128, 128, "causal", (-1, 0)),
    (True, (-1, -1), 1, 128, "none", (-1, -1)),  # one query row is the last row: it sees every key
    (True, (-1, -1), 799, 3, "causal", (-1, 0)),
    (False, (-1, 17), 799, 3, "local", (-1, 17)),  # early rows see no key: not the same as no mask
    (True, (-1, -1), 0, 0, "none", (-1, -1)),
]


@pytest.mark.parametrize("causal,window,sq,sk,mask,normalized", MASK_TABLE)
def test_mask_kind_table(causal, window, sq, sk, mask, normalized):
    assert derive_mask(causal, window, sq, sk) == (mask, normalized)


def visible(window: tuple[int, int], causal: bool, sq: int, sk: int) -> torch.Tensor:
    left, right = window[0], 0 if causal else window[1]
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    return keep


def test_mask_normalization_is_exact():
    """Dropping bounds never changes which keys a query sees."""
    sides = range(-1, 8)
    for sq, sk, left, right, causal in itertools.product(range(1, 7), range(1, 7), sides, sides, (False, True)):
        mask, window = derive_mask(causal, (left, right), sq, sk)
        assert torch.equal(visible((left, right), causal, sq, sk), visible(window, False, sq, sk))
        assert {"none": (-1, -1), "causal": (-1, 0)}.get(mask, window) == window


@pytest.mark.parametrize("sq,sk", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences_need_no_launch(sq, sk):
    q, k, v = make(sq=sq, sk=sk)
    args = check_fwd(q, k, v, causal=True)
    assert args.empty
    out, lse = empty_outputs(q, args)
    assert out.shape == q.shape and out.dtype == q.dtype and not out.any()
    assert lse.shape == (B, H, sq) and lse.dtype == torch.float32 and bool((lse == float("inf")).all())


def test_import_is_light():
    """The API (`from flash_gen import flash_attn_func`) adds torch only: no optuna (blocked here), no NVRTC, no
    compiler or runtime modules. (torch itself imports cuda.bindings.driver/runtime, so only what flash_gen adds
    on top is checked.)"""
    code = (
        "import sys, torch\n"
        "sys.modules['optuna'] = None\n"  # any attempt to import optuna raises ImportError
        "before = set(sys.modules)\n"
        "from flash_gen import flash_attn_func\n"
        "added = set(sys.modules) - before\n"
        "heavy = ('optuna', 'cuda.bindings', 'jinja2', 'flash_gen.build', 'flash_gen.runtime', 'flash_gen.search')\n"
        "print(sorted(m for m in added if m.startswith(heavy)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_compiler_side_imports_without_torch():
    """spec, gen, build and the `flash-gen compile` command (what a CPU-only build machine runs) never import
    torch."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"  # any attempt to import torch raises ImportError
        "import flash_gen, flash_gen.spec, flash_gen.gen.render, flash_gen.build.nvrtc, flash_gen.build.cache\n"
        "from flash_gen import cli\n"
        "args = cli._parser().parse_args(['compile', '--arch', 'sm90', '--hdim', '64'])\n"
        "print(flash_gen.__version__, cli._variants(args)[0][0].name)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


TQ, TK = 300, 170  # packed totals


def varlen(dtype=torch.bfloat16, hd=D, batch=3):
    q = torch.randn(TQ, H, hd, dtype=dtype)
    k = torch.randn(TK, HK, hd, dtype=dtype)
    cu = torch.tensor([0] + [TQ * (i + 1) // batch for i in range(batch)], dtype=torch.int32)
    cu_k = torch.tensor([0] + [TK * (i + 1) // batch for i in range(batch)], dtype=torch.int32)
    return q, k, k.clone(), cu, cu_k


def test_varlen_accepts_packed_batch():
    q, k, v, cu, cu_k = varlen()
    args = check_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu_k, causal=True)
    assert (args.batch, args.seqlen_q, args.seqlen_k, args.varlen, args.mask) == (3, TQ, TK, True, "causal")
    assert check_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu_k, alibi_slopes=torch.rand(3, H)).alibi


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (lambda a: {**a, "cu_seqlens_k": None}, ValueError, "^cu_seqlens_k: a packed batch needs both"),
        (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].long()}, TypeError, "^cu_seqlens_q: dtype"),
        (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"][:1]}, ValueError, "^cu_seqlens_q: expected a contiguous"),
        (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].view(2, 2)}, ValueError, "^cu_seqlens_q"),
        (lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"][:3]}, ValueError, "^cu_seqlens_k: 3 offsets"),
        (lambda a: {**a, "q": a["q"][None]}, ValueError, "^q: expected 3 dims"),
        (lambda a: {**a, "v": a["v"][:10]}, ValueError, "^v: seqlen_k"),
        (lambda a: {**a, "alibi_slopes": torch.rand(2, H)}, ValueError, "^alibi_slopes"),
    ],
)
def test_varlen_rejects_bad_input_by_name(change, exc, match):
    q, k, v, cu, cu_k = varlen()
    a = change(dict(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu_k))
    with pytest.raises(exc, match=match):
        check_fwd(a.pop("q"), a.pop("k"), a.pop("v"), **a)


def test_varlen_offsets_values_are_checked_on_request():
    from flash_gen.validate import check_cu_seqlens_values

    check_cu_seqlens_values("cu_seqlens_q", torch.tensor([0, 5, 5, 9], dtype=torch.int32), 9)
    for bad in ([1, 5], [0, 5, 4], [0, 10]):
        with pytest.raises(ValueError, match="^cu_seqlens_q: must start at 0"):
            check_cu_seqlens_values("cu_seqlens_q", torch.tensor(bad, dtype=torch.int32), 9)


def kvcache_args(**change):
    from flash_gen.validate import check_kvcache

    q = torch.randn(2, 1, H, D, dtype=torch.bfloat16)
    cache = torch.randn(3, 64, HK, D, dtype=torch.bfloat16)
    args = dict(q=q, k_cache=cache, v_cache=cache.clone(), k=None, v=None, rotary_cos=None, rotary_sin=None,
                cache_seqlens=torch.tensor([5, 9], dtype=torch.int32), cache_batch_idx=None, cache_leftpad=None,
                block_table=None)
    interleaved = change.pop("rotary_interleaved", True)
    args.update(change)
    attn = dict(softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, num_splits=0)
    return check_kvcache(*args.values(), **attn, rotary_interleaved=interleaved)


def test_kvcache_accepts_contiguous_and_paged_caches():
    assert kvcache_args().attn.seqlen_k == 64
    table = torch.zeros(2, 4, dtype=torch.int32)
    paged = torch.randn(10, 16, HK, D, dtype=torch.bfloat16)
    checked = kvcache_args(k_cache=paged, v_cache=paged.clone(), block_table=table)
    assert checked.attn.seqlen_k == 64 and checked.new_rows == 0
    new = torch.randn(2, 3, HK, D, dtype=torch.bfloat16)
    cos = torch.rand(80, D // 4)
    assert kvcache_args(k=new, v=new, rotary_cos=cos, rotary_sin=cos).rotary


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (dict(block_table=torch.zeros(2, 4, dtype=torch.int64)), TypeError, "^block_table: dtype"),
        (dict(block_table=torch.zeros(3, 4, dtype=torch.int32)), ValueError, "^block_table: batch"),
        (dict(block_table=torch.zeros(2, 4, dtype=torch.int32), cache_batch_idx=torch.zeros(2, dtype=torch.int32)),
         ValueError, "^cache_batch_idx"),
        (dict(cache_seqlens=62, k=torch.randn(2, 3, HK, D, dtype=torch.bfloat16),
              v=torch.randn(2, 3, HK, D, dtype=torch.bfloat16)), ValueError, "^cache_seqlens: 62 \\+ 3"),
        (dict(k=torch.randn(2, 3, HK, D, dtype=torch.bfloat16)), ValueError, "^v: k and v"),
        (dict(cache_seqlens=torch.tensor([1, 2])), TypeError, "^cache_seqlens: dtype"),
        (dict(cache_leftpad=torch.zeros(3, dtype=torch.int32)), ValueError, "^cache_leftpad: batch"),
        (dict(rotary_cos=torch.rand(80, D)), ValueError, "^rotary_cos"),
        (dict(rotary_cos=torch.rand(80, 4), rotary_sin=torch.rand(80, 4), rotary_interleaved=False), ValueError,
         "^rotary_cos: non-interleaved"),
        (dict(k_cache=torch.randn(3, 64, HK, D, dtype=torch.float16)), TypeError, "^k_cache: dtype"),
        (dict(v_cache=torch.randn(3, 32, HK, D, dtype=torch.bfloat16)), ValueError, "^v_cache: seqlen"),
    ],
)
def test_kvcache_rejects_bad_input_by_name(change, exc, match):
    with pytest.raises(exc, match=match):
        kvcache_args(**change)


def test_varlen_paged_cache_is_checked():
    q, k, v, cu, cu_k = varlen()
    cache = torch.randn(20, 16, HK, D, dtype=torch.bfloat16)
    table = torch.zeros(3, 5, dtype=torch.int32)
    args = check_fwd(q, cache, cache, cu_seqlens_q=cu, cu_seqlens_k=cu_k, block_table=table)
    assert args.seqlen_k == 80 and args.varlen
    with pytest.raises(ValueError, match="^k: expected 4 dims"):
        check_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu_k, block_table=table)
    with pytest.raises(ValueError, match="^block_table: batch"):
        check_fwd(q, cache, cache, cu_seqlens_q=cu, cu_seqlens_k=cu_k, block_table=table[:2])
    with pytest.raises(ValueError, match="^block_table: a paged"):
        check_fwd(q[None], cache, cache, block_table=table)
    with pytest.raises(ValueError, match="^k: a paged cache needs at least one block"):
        check_fwd(q, cache[:0], cache[:0], cu_seqlens_q=cu, cu_seqlens_k=cu_k, block_table=table)


def test_paged_cache_offsets_must_fit_32_bits():
    """The kernels compute a page's element offset in 32 bits (kv_cache.cuh): wider strides are refused by name."""
    q, _, _, cu, cu_k = varlen()
    table = torch.zeros(3, 5, dtype=torch.int32)
    wide = torch.empty(4, 16, HK, D, dtype=torch.bfloat16, device="meta").as_strided(
        (4, 16, HK, D), (2**32, 16 * HK * D, D, 1))
    ok = torch.empty(4, 16, HK, D, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="^v: page and row strides"):
        check_fwd(q.to("meta"), ok, wide, cu_seqlens_q=cu.to("meta"), cu_seqlens_k=cu_k.to("meta"),
                  block_table=table.to("meta"))
    with pytest.raises(ValueError, match="^k_cache: page and row strides"):
        kvcache_args(q=torch.empty(2, 1, H, D, dtype=torch.bfloat16, device="meta"), k_cache=wide, v_cache=ok,
                     cache_seqlens=None, block_table=torch.zeros(2, 4, dtype=torch.int32, device="meta"))
