"""GPU tests of the Hopper (TMA + wgmma) forward kernel's tilings (issue 7).

The runtime picks this kernel by default for the dense sm90 keys it supports, so tests/test_fwd_gpu.py covers
its defaults; here each tiling knob is forced (Sm90FwdConfig): ping-pong on and off, stages, 64- and 192-row tiles,
persistent CTAs. Same float64 reference, flash_attn's rule and NaN-poisoned outputs. Skipped on GPUs other than
sm_90.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from flash_gen.gen.render import entry_name, render_fwd_sm90
from flash_gen.spec import FwdKey
from flash_gen.spec_sm90 import Sm90FwdConfig, sm90_config_from_name
from flash_gen.validate import validate_fwd

from attn_reference import DTYPES, MASKS, attention_ref, fresh_seed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs an sm_90 GPU"),
]

CASES = [  # dtype, head dim, config, mask, batch, seqlen_q, seqlen_k, nheads, nheads_k, feature
    ("bf16", 128, "wgm128n128s2p", "none", 2, 300, 517, 4, 2, ""),
    ("bf16", 128, "wgm128n128s2", "causal", 2, 517, 300, 4, 4, ""),
    ("bf16", 128, "wgm128n176s2p", "causal", 1, 1000, 1000, 2, 1, ""),
    ("fp16", 128, "wgm128n128s3p", "none", 1, 1, 2000, 2, 2, ""),
    ("fp16", 64, "wgm128n128s2p", "none", 3, 129, 1, 2, 2, ""),
    ("bf16", 64, "wgm128n192s2p", "win32_0", 1, 257, 700, 4, 1, ""),
    ("bf16", 256, "wgm128n64s2p", "none", 1, 200, 333, 2, 2, ""),
    ("bf16", 256, "wgm128n80s2", "causal", 2, 333, 1200, 2, 1, ""),
    # one consumer warpgroup, two CTAs per SM
    ("bf16", 64, "wgm64n128s2", "causal", 2, 517, 300, 4, 2, ""),
    ("fp16", 128, "wgm64n64s3", "none", 1, 300, 700, 4, 1, ""),
    ("bf16", 64, "wgm64n128s2_persist", "causal", 3, 777, 555, 16, 16, "rising"),
    # persistent: more tiles than SMs (several per CTA), empty tiles (rows that see no key), GQA, local
    ("bf16", 128, "wgm128n128s2_persist", "causal", 4, 1000, 700, 8, 2, ""),
    ("fp16", 64, "wgm192n128s2p_persist", "none", 3, 777, 555, 16, 16, ""),
    ("bf16", 256, "wgm128n32s2p_persist", "win32_0", 2, 300, 900, 4, 1, ""),
    ("bf16", 64, "wgm192n112s2p_persist", "causal", 3, 777, 555, 16, 16, "rising"),
    ("bf16", 64, "wgm192n128s4_persist", "causal", 2, 1000, 1300, 16, 4, ""),  # tuned, s<=4k
    ("bf16", 128, "wgm128n128s2p_persist", "causal", 2, 1000, 1300, 8, 2, ""),
    # persistent at head dim 256, O staged in the V ring: several tiles per CTA, empty tiles, pack-GQA, local
    ("bf16", 256, "wgm128n80s2p_persist", "causal", 4, 1000, 700, 8, 2, "rising"),
    ("fp16", 256, "wgm128n64s2_persist", "none", 3, 777, 555, 16, 16, "softcap"),
    ("bf16", 256, "wgm128n80s2_persist", "win32_0", 2, 300, 900, 24, 4, "pack"),
    # causal persistent tiles over three L2 sections of 9, 9 and 6 (batch, head) pairs, the middle one shortest first
    ("bf16", 256, "wgm128n80s2_persist", "causal", 2, 2000, 4100, 12, 4, ""),
    # score modifiers (softcap; ALiBi slopes per head or per batch entry and head)
    ("bf16", 128, "wgm128n128s2", "causal", 2, 300, 517, 4, 2, "softcap"),
    ("fp16", 64, "wgm192n128s2p", "none", 1, 257, 700, 4, 1, "alibi"),
    ("bf16", 256, "wgm128n64s2p", "win32_0", 2, 333, 500, 2, 2, "alibi_batch"),
    ("bf16", 128, "wgm128n128s2_persist", "none", 2, 700, 300, 8, 8, "softcap"),
    # head dim 256 non-causal with score modifiers: the persistent default spills, its one-CTA-per-tile form runs
    ("bf16", 256, "wgm128n80s2", "none", 2, 300, 517, 4, 2, "softcap"),
    ("fp16", 256, "wgm128n80s2", "none", 1, 257, 700, 4, 1, "alibi+softcap"),
    # head dims computed exactly, in boxes of 32 columns (96, 160: 64-byte swizzle) or 16 (80, 48: 32-byte
    # swizzle); 72 as 80 and 208 as 224; others as the next multiple of 64 (40 and 8 as 64): TMA zero-fills the
    # extra columns and the O store skips them (8: a box wider than the tensor; 72 with an odd number of heads:
    # rows of 144 bytes, every other head's 16 bytes into a 32-byte sector)
    ("bf16", 96, "wgm128n128s2_persist", "causal", 2, 300, 517, 4, 2, ""),
    ("bf16", 160, "wgm128n64s2", "win32_0", 1, 257, 700, 4, 1, ""),
    ("bf16", 80, "wgm192n96s2p_persist", "causal", 3, 777, 555, 16, 16, "rising"),
    ("fp16", 80, "wgm128n128s2_c2_persist", "none", 2, 1000, 700, 8, 2, ""),
    ("bf16", 48, "wgm128n64s2p", "win32_0", 2, 300, 517, 8, 2, "pack"),
    ("bf16", 48, "wgm64n128s2", "causal", 2, 333, 250, 4, 4, "softcap"),
    # head dim 80's s<=1k tilings from the tuner: P in shared memory, persistent (none until 2026-12-02; now
    # wgm128n128s2_c2_persist, the fp16 case above); serial, four stages (causal)
    ("bf16", 80, "wgm128n128s2p_ss_persist", "none", 2, 700, 300, 8, 2, ""),
    ("bf16", 80, "wgm192n96s4_serial_ss_persist", "causal", 3, 777, 555, 16, 16, "rising"),
    ("bf16", 96, "wgm128n80s2p_ss", "none", 2, 300, 517, 4, 2, ""),
    ("fp16", 40, "wgm192n128s2p", "none", 2, 333, 250, 4, 4, ""),
    ("bf16", 8, "wgm128n128s2p", "causal", 2, 129, 300, 2, 1, ""),
    ("bf16", 72, "wgm192n112s2p", "none", 2, 300, 517, 6, 3, ""),
    ("fp16", 72, "wgm192n112s3_serial_ss_persist", "causal", 3, 777, 555, 5, 5, "rising"),  # tuned, s<=1k
    ("bf16", 208, "wgm128n64s2p", "win32_0", 2, 200, 333, 3, 1, "softcap"),
    ("bf16", 72, "wgm128n128s2p_c2_persist", "none", 2, 1000, 700, 6, 3, ""),  # K/V multicast over 144-byte rows
    # aligned rows ("_al"): an even number of KV heads of 144-byte rows (216: 432), so every odd KV head's rows start
    # 16 bytes into a sector and its Q, K and V boxes shift 8 columns into the padding (O staged rotated back): GQA,
    # MHA persistent, a cluster's multicast, pack-GQA, a window
    ("bf16", 72, "wgm192n112s2p_al", "none", 2, 300, 517, 8, 4, ""),
    ("bf16", 72, "wgm192n112s2p_al_persist", "causal", 3, 777, 555, 16, 16, "rising"),
    ("fp16", 72, "wgm192n112s2p_al_c2_persist", "none", 2, 1000, 700, 6, 2, ""),
    ("bf16", 72, "wgm192n112s2p_al", "causal", 2, 100, 333, 16, 2, "pack"),
    ("bf16", 216, "wgm128n64s2p_al", "win32_0", 2, 200, 333, 4, 2, "softcap"),
    # what the runtime now runs at other head dims 8 mod 16: the computed head dim's entries, aligned
    # (spec_sm90.aligned_if_misaligned): three consumers at 120 and 56, 32-column boxes at 200, 64 at 248
    ("bf16", 120, "wgm192n80s3_al_persist", "causal", 2, 777, 555, 8, 2, ""),
    ("fp16", 56, "wgm192n128s3_al_persist", "none", 3, 300, 517, 6, 6, ""),
    ("bf16", 200, "wgm128n96s2_al_persist", "none", 2, 700, 517, 8, 2, ""),
    ("fp16", 248, "wgm128n64s2_al_persist", "causal", 2, 333, 1000, 4, 4, "rising"),
    # the tuner's picks of 2026-12-05 for head dims 80, 160 and 224 (flash_gen/tuned/sm90.json)
    ("bf16", 160, "wgm128n128s2_persist", "causal", 2, 1000, 1300, 8, 2, ""),
    ("bf16", 224, "wgm128n96s2_persist", "none", 2, 700, 517, 8, 2, ""),
    ("bf16", 224, "wgm128n64s3p", "causal", 2, 300, 517, 4, 2, "rising"),
    ("bf16", 80, "wgm192n96s4p_persist", "causal", 2, 1000, 700, 8, 2, ""),
    # and fp16's (2026-12-05 evening): the same tilings, whose fp16 forms no other case runs
    ("fp16", 80, "wgm192n96s4p_persist", "none", 2, 700, 517, 8, 2, ""),
    ("fp16", 160, "wgm128n128s2_persist", "none", 3, 777, 555, 8, 8, ""),
    ("fp16", 224, "wgm128n96s2_persist", "causal", 2, 1000, 1300, 8, 2, "rising"),
    # and for head dim 72 with aligned rows (4 KV heads: the odd ones shifted)
    ("bf16", 72, "wgm192n96s4p_al", "none", 2, 1000, 700, 8, 4, ""),
    ("bf16", 72, "wgm192n96s3p_al_persist", "causal", 2, 1000, 1300, 16, 4, ""),
    ("fp16", 72, "wgm192n96s4p_al_persist", "none", 3, 777, 555, 12, 4, "rising"),
    # scores that grow along the keys: row maxima rise past the lazy-max slack mid-row, so O is rescaled late
    ("bf16", 128, "wgm128n128s2", "none", 2, 300, 1500, 4, 2, "rising"),
    ("fp16", 64, "wgm192n128s2p", "causal", 1, 700, 700, 2, 2, "rising"),
    # no intra-warpgroup overlap (each step's S, softmax and P V in turn; ping-pong turns per GEMM)
    ("bf16", 64, "wgm192n112s4_serial_persist", "causal", 3, 777, 555, 16, 16, "rising"),
    ("fp16", 128, "wgm128n128s2p_serial", "none", 2, 300, 517, 4, 2, ""),
    ("bf16", 256, "wgm128n32s2p_serial_persist", "win32_0", 2, 300, 900, 4, 1, "softcap"),
    # P V with P from shared memory, stored with stmatrix (32-byte swizzle atoms at 112 and 80 keys, else 128-byte)
    ("bf16", 64, "wgm192n112s4_ss_persist", "causal", 3, 777, 555, 16, 16, "rising"),
    ("fp16", 128, "wgm128n80s2p_ss", "none", 2, 300, 517, 4, 2, ""),
    ("bf16", 128, "wgm128n128s2_ss_persist", "causal", 2, 1000, 1300, 8, 2, ""),
    ("bf16", 256, "wgm128n64s2_serial_ss", "win32_0", 1, 257, 700, 4, 1, "alibi"),
    # pack-GQA: a warpgroup's 64 rows hold 64 // group positions of a KV head's query heads (groups of 3 and 7
    # leave a row unused; 64: one position per warpgroup), the ragged tile first under causal masks
    ("bf16", 128, "wgm128n128s2_persist", "causal", 2, 37, 700, 16, 2, "pack"),
    ("fp16", 64, "wgm192n128s2p", "none", 3, 1, 555, 8, 1, "pack"),
    ("bf16", 128, "wgm128n128s2p", "win32_0", 2, 100, 333, 14, 2, "pack"),
    ("bf16", 256, "wgm128n64s2", "causal", 1, 129, 129, 6, 2, "pack"),
    ("bf16", 64, "wgm64n128s2", "causal", 2, 77, 300, 4, 1, "pack"),
    ("bf16", 64, "wgm128n128s2p", "causal", 1, 5, 300, 64, 1, "pack"),
    ("bf16", 128, "wgm128n128s2p_persist", "causal", 3, 1000, 1000, 8, 2, "pack"),
    ("fp16", 128, "wgm128n80s2p_ss", "causal", 2, 50, 400, 12, 4, "pack+softcap"),
    ("bf16", 40, "wgm192n112s4_serial_persist", "win32_0", 2, 300, 517, 8, 2, "pack+rising"),
    # clusters of two CTAs sharing K/V tiles (multicast): an odd number of query tiles per head (the cluster's
    # second tile past seqlen_q), persistent CTAs, one consumer warpgroup, a single query row, pack-GQA
    ("bf16", 128, "wgm128n128s2_c2_persist", "none", 2, 1000, 700, 8, 2, ""),
    ("bf16", 128, "wgm128n128s2p_c2", "none", 3, 300, 517, 4, 2, "rising"),
    ("fp16", 64, "wgm192n128s2p_c2_persist", "none", 2, 777, 555, 16, 16, ""),
    ("bf16", 256, "wgm128n64s2_c2", "none", 1, 200, 333, 2, 2, "softcap"),
    ("bf16", 64, "wgm64n128s2_c2", "none", 2, 129, 300, 4, 1, ""),
    ("fp16", 128, "wgm128n176s2p_c2", "none", 1, 1, 2000, 2, 2, ""),
    ("bf16", 128, "wgm128n128s2_c2_persist", "none", 2, 37, 700, 16, 2, "pack"),
    # max-free steps ("_mf"): rising scores (S recomputed where P would pass 2^15), windows whose rows start without
    # a reference maximum, causal and ragged tiles, packed heads, softcap, ALiBi
    ("bf16", 128, "wgm128n128s2p_mf_persist", "none", 4, 1000, 700, 8, 2, "rising"),
    ("bf16", 128, "wgm128n128s2p_mf_persist", "causal", 2, 1000, 1300, 8, 2, ""),
    ("fp16", 64, "wgm128n128s3p_mf_persist", "causal", 3, 777, 555, 16, 16, "rising"),
    ("bf16", 128, "wgm128n128s2p_mf", "win32_0", 2, 300, 900, 4, 1, "softcap"),
    ("bf16", 96, "wgm128n128s2_mf_persist", "win32_0", 2, 300, 900, 8, 2, "pack"),
    ("fp16", 128, "wgm128n128s2p_mf", "none", 1, 257, 2000, 4, 1, "alibi"),
    ("fp16", 128, "wgm128n128s2p_mf_persist", "none", 2, 2000, 2000, 16, 4, ""),  # tuned, s<=4k
    # and with three consumer warpgroups (192 rows)
    ("bf16", 64, "wgm192n128s3_mf_persist", "causal", 3, 777, 555, 16, 16, "rising"),
    ("fp16", 128, "wgm192n80s3_mf_persist", "none", 2, 1000, 1300, 8, 2, "rising"),
    ("bf16", 128, "wgm192n80s3_mf_persist", "win32_0", 2, 300, 900, 8, 2, "pack"),
    ("bf16", 64, "wgm192n128s4p_mf", "none", 1, 257, 700, 4, 1, "rising"),
    ("bf16", 64, "wgm192n128s4_mf_persist", "none", 2, 2000, 2000, 16, 4, ""),  # tuned, s<=4k and s>4k
    ("fp16", 64, "wgm192n128s4_mf_persist", "causal", 2, 1000, 1300, 16, 4, "rising"),  # tuned, s>4k
]


SOFTCAP = 5.0  # small enough that the cap bends the scores of unit-variance inputs


def _run(q, k, v, cfg: Sm90FwdConfig, causal: bool, window, softcap: float = 0.0, alibi_slopes=None,
         pack_gqa: bool = False):
    """The runtime's forward forced to the Hopper kernel (packed or not), output poisoned with NaN."""
    from flash_gen.runtime.fwd import attention_fwd

    args = validate_fwd(q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi_slopes)
    out = torch.full_like(q, float("nan"))
    return attention_fwd(q, k, v, softmax_scale=args.softmax_scale, causal=args.causal, window_size=args.window_size,
                         softcap=args.softcap, alibi_slopes=alibi_slopes, out=out, config=cfg, pack_gqa=pack_gqa)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_sm90_forward_matches_reference(case):
    dtype, d, name, mask, b, sq, sk, h, hk, feature = case
    features = feature.split("+")
    seed = fresh_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, s, n, d, generator=gen, device="cuda", dtype=DTYPES[dtype])
               for s, n in ((sq, h), (sk, hk), (sk, hk)))
    if "rising" in features:  # key j scaled by 0.25 .. 6: score spread grows from about 1 to 20 (log2 units)
        k = k * torch.linspace(0.25, 6.0, sk, device="cuda", dtype=torch.float32)[None, :, None, None].to(k.dtype)
    causal, window = MASKS[mask]
    softcap = SOFTCAP if "softcap" in features else 0.0
    slopes = None
    if feature.startswith("alibi"):
        shape = (b, h) if feature == "alibi_batch" else (h,)
        slopes = torch.rand(shape, generator=gen, device="cuda", dtype=torch.float32) * 0.3
    out, lse = _run(q, k, v, sm90_config_from_name(name), causal, window, softcap, slopes, "pack" in features)
    where = f"{case} seed={seed}"
    assert not out.isnan().any(), f"{where}: {int(out.isnan().sum())} outputs never written (still NaN)"
    ref = dict(scale=d**-0.5, causal=causal, window=window, softcap=softcap, alibi_slopes=slopes)
    out64, lse64 = attention_ref(q, k, v, **ref, upcast=True)
    out_low, _ = attention_ref(q, k, v, **ref, upcast=False)
    err = (out.double() - out64).abs().max().item()
    tol = 2 * (out_low.double() - out64).abs().max().item() + 1e-5
    assert err <= tol, f"{where}: max|out - ref64| = {err:.3e} > {tol:.3e}"
    blind = torch.isinf(lse64)
    assert bool((lse[blind] == float("inf")).all()), f"{where}: rows that see no key must have lse = +inf"
    lse_err = ((lse.double() - lse64).abs() / (1 + lse64.abs()))[~blind]
    assert lse_err.numel() == 0 or lse_err.max().item() <= 1e-3, f"{where}: lse off by {lse_err.max().item():.3e}"


def _section_width_run(q, k, v, cfg: Sm90FwdConfig, setting: str | None, monkeypatch) -> int:
    """Runs the causal forward under the kernel's own section rule (FLASH_GEN_SECTION_PAIRS=0), then under `setting`,
    each planned anew (the setting is read when a call's shapes are planned); asserts that output and lse are the
    same bit for bit (each tile computes the same in any order) and returns the second plan's width. None: unset."""
    from flash_gen.memo import BoundedMemo
    from flash_gen.runtime import fwd

    def run(value: str | None):
        if value is None:
            monkeypatch.delenv("FLASH_GEN_SECTION_PAIRS", raising=False)
        else:
            monkeypatch.setenv("FLASH_GEN_SECTION_PAIRS", value)
        plans = BoundedMemo(8)
        monkeypatch.setattr(fwd, "_plans", plans)
        out, lse = _run(q, k, v, cfg, True, (-1, -1))
        assert not out.isnan().any(), f"{value}: {int(out.isnan().sum())} outputs never written"
        (plan,) = plans.values()
        return out, lse, plan.section_pairs

    out0, lse0, width0 = run("0")
    out, lse, width = run(setting)
    assert width0 == 0
    assert torch.equal(out, out0) and torch.equal(lse, lse0), f"{setting}: differs from the kernel's own order"
    return width


@pytest.mark.parametrize("pairs", [1, 5, 1000])
def test_sm90_causal_section_width_changes_only_the_order(pairs, monkeypatch):
    """FLASH_GEN_SECTION_PAIRS reorders a causal persistent launch's tiles (1 pair a section, a width that leaves
    a narrower last section, one wider than all pairs)."""
    cfg = sm90_config_from_name("wgm128n128s2_persist")
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    q, k, v = (torch.randn(4, s, 8, 128, generator=gen, device="cuda", dtype=torch.bfloat16) for s in (1000, 700, 700))
    assert _section_width_run(q, k, v, cfg, str(pairs), monkeypatch) == pairs


@pytest.mark.parametrize("setting", ["model", None], ids=["model", "unset"])
def test_sm90_model_section_width_changes_only_the_order(setting, monkeypatch):
    """The default, FLASH_GEN_SECTION_PAIRS unset or `model`: the width runtime/section_schedule.py picks (on 132
    SMs, one pair a section for head dim 256 causal 2k over 128 (batch, head) pairs, shared/ANCHORS.md's shape)."""
    from flash_gen.runtime import driver

    cfg = sm90_config_from_name("wgm128n64s2_persist")
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    q, k, v = (torch.randn(16, 2048, 8, 256, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    width = _section_width_run(q, k, v, cfg, setting, monkeypatch)
    assert width == 1 or driver.sm_count(q.device.index) != 132


# Stream-K (persistent tilings on unmasked keys) on shapes whose last round is partial: heads chosen so that the
# query tiles come to `rounds` whole rounds of the GPU's resident CTAs plus `left` tiles, whose key steps the CTAs
# then share.
SK_CASES = [  # dtype, head dim, config, batch, seqlen_q, seqlen_k, nheads_k, group, rounds, left, feature
    # (query heads: enough for the tiles, rounded up to whole groups of every KV head)
    # 7 key steps in chunks of 4: pieces cross tile boundaries (a CTA's second piece starts the next tile)
    ("bf16", 128, "wgm128n128s2p_persist", 1, 1000, 777, 17, 1, 1, 4, ""),
    ("fp16", 128, "wgm128n128s2_persist", 2, 517, 2100, 8, 2, 2, 9, "rising"),
    # head dim 256, O staged in the V ring (the contributors' rounds still free it)
    ("bf16", 256, "wgm128n64s2_persist", 3, 300, 1500, 4, 1, 2, 60, ""),
    ("bf16", 64, "wgm192n128s3_persist", 2, 777, 2000, 16, 1, 1, 20, ""),  # three consumer warpgroups
    ("fp16", 96, "wgm128n128s2_persist", 1, 300, 1000, 3, 1, 0, 40, ""),  # fewer tiles than CTAs
    ("bf16", 128, "wgm128n128s2_persist", 2, 37, 1300, 2, 8, 0, 50, ""),  # GQA, few query positions
    ("bf16", 128, "wgm128n128s2p_mf_persist", 1, 1000, 777, 17, 1, 1, 4, "rising"),  # max-free steps
    ("bf16", 64, "wgm192n128s4_mf_persist", 2, 777, 2000, 16, 1, 1, 20, "rising"),  # and with 192 rows
    ("fp16", 128, "wgm192n80s3_mf_persist", 1, 1000, 1300, 8, 2, 1, 10, ""),
]


@pytest.mark.parametrize("case", SK_CASES, ids=lambda c: "-".join(map(str, c)))
def test_sm90_stream_k_matches_reference(case):
    """Stream-K shares the last round's key steps: the result must match the reference (and come out the same
    on a second call, which reuses the flags the first left at multiples of 256)."""
    from flash_gen.runtime import driver
    from flash_gen.runtime.fwd import plan_fwd

    dtype, d, name, b, sq, sk, hk, group, rounds, left, feature = case
    cfg = sm90_config_from_name(name)
    slots = driver.sm_count(torch.cuda.current_device()) * cfg.ctas_per_sm
    heads = -(-(rounds * slots + left) // (b * -(-sq // cfg.block_m)))
    h = -(-heads // (hk * group)) * hk * group
    seed = fresh_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, s, n, d, generator=gen, device="cuda", dtype=DTYPES[dtype])
               for s, n in ((sq, h), (sk, h // group), (sk, h // group)))
    if feature == "rising":
        k = k * torch.linspace(0.25, 6.0, sk, device="cuda", dtype=torch.float32)[None, :, None, None].to(k.dtype)
    args = validate_fwd(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None)
    plan = plan_fwd(q, k, v, softmax_scale=args.softmax_scale, causal=False, window_size=args.window_size,
                    softcap=0.0, alibi_slopes=None, config=cfg, pack_gqa=False)
    where = f"{case} seed={seed} {plan.stream_k}"
    assert plan.stream_k is not None and plan.stream_k.chunk > 0, f"{where}: stream-K not engaged"
    out, lse = _run(q, k, v, cfg, False, (-1, -1))
    assert not out.isnan().any(), f"{where}: {int(out.isnan().sum())} outputs never written (still NaN)"
    ref = dict(scale=d**-0.5, causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None)
    out64, lse64 = attention_ref(q, k, v, **ref, upcast=True)
    out_low, _ = attention_ref(q, k, v, **ref, upcast=False)
    err = (out.double() - out64).abs().max().item()
    tol = 2 * (out_low.double() - out64).abs().max().item() + 1e-5
    assert err <= tol, f"{where}: max|out - ref64| = {err:.3e} > {tol:.3e}"
    lse_err = ((lse.double() - lse64).abs() / (1 + lse64.abs())).max().item()
    assert lse_err <= 1e-3, f"{where}: lse off by {lse_err:.3e}"
    again, lse_again = _run(q, k, v, cfg, False, (-1, -1))
    assert torch.equal(again, out) and torch.equal(lse_again, lse), f"{where}: a second call differs"


def test_sm90_stream_k_in_a_cuda_graph():
    """A captured stream-K launch gets flags of its own, zeroed at every replay: replays match the eager call."""
    cfg = sm90_config_from_name("wgm128n128s2p_persist")
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    q, k, v = (torch.randn(1, n, 17, 128, generator=gen, device="cuda", dtype=torch.bfloat16) for n in (1000, 777, 777))
    eager, _ = _run(q, k, v, cfg, False, (-1, -1))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run(q, k, v, cfg, False, (-1, -1))  # warm up (plans, kernels) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = _run(q, k, v, cfg, False, (-1, -1))
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_sm90_same_shape_new_addresses_get_their_own_tma_maps():
    """The runtime keeps encoded TMA maps per shape and addresses: calls on live tensors of one shape at other
    addresses (and strided views) must each read their own inputs and write their own output."""
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    cfg = Sm90FwdConfig()
    kept = []
    for _ in range(3):
        qkv = torch.randn(2, 200, 3, 4, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv.unbind(2)  # strided views into one packed tensor
        out, _ = _run(q, k, v, cfg, False, (-1, -1))
        kept.append((qkv, out))
    for qkv, out in kept:
        q, k, v = qkv.unbind(2)
        ref, _ = attention_ref(q, k, v, scale=128**-0.5, causal=False, window=(-1, -1), softcap=0.0,
                               alibi_slopes=None, upcast=True)
        low, _ = attention_ref(q, k, v, scale=128**-0.5, causal=False, window=(-1, -1), softcap=0.0,
                               alibi_slopes=None, upcast=False)
        assert (out.double() - ref).abs().max() <= 2 * (low.double() - ref).abs().max() + 1e-5


@pytest.mark.parametrize("name", ["wgm128n128s2p_mf_persist", "wgm192n128s3_mf_persist"])
def test_sm90_max_free_steps_end_on_nan_scores(name):
    """A NaN score fails a max-free step's check every time: the warp repairs once, then passes the NaN on (the row
    comes out NaN, as with the usual step) instead of repeating; every other row matches the reference."""
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    q, k, v = (torch.randn(1, n, 4, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for n in (300, 700, 700))
    k[0, 400, 1, 7] = float("nan")  # a key past the first key tile: every row of head 1 meets it in a max-free step
    out, _ = _run(q, k, v, sm90_config_from_name(name), False, (-1, -1))
    assert out[:, :, 1].isnan().all()
    keep = [0, 2, 3]
    ref, _ = attention_ref(q[:, :, keep], k[:, :, keep], v[:, :, keep], scale=64**-0.5, causal=False,
                           window=(-1, -1), softcap=0.0, alibi_slopes=None, upcast=True)
    low, _ = attention_ref(q[:, :, keep], k[:, :, keep], v[:, :, keep], scale=64**-0.5, causal=False,
                           window=(-1, -1), softcap=0.0, alibi_slopes=None, upcast=False)
    assert (out[:, :, keep].double() - ref).abs().max() <= 2 * (low.double() - ref).abs().max() + 1e-5


@pytest.mark.skipif(shutil.which("cuobjdump") is None, reason="needs cuobjdump")
def test_sm90_sass_uses_hgmma_and_tma(tmp_path):
    from flash_gen.build import cache

    key, cfg = FwdKey("sm90", "bf16", 128, "none"), Sm90FwdConfig()
    cubin, _ = cache.get_or_compile(render_fwd_sm90(key, cfg), entry_name(key, cfg), "sm90")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run(["cuobjdump", "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    assert "HGMMA.64x128x16.F32.BF16" in sass and ".tnspB" in sass  # SS for QK^T, RS with V^T for PV
    assert "UTMALDG.4D" in sass and "SYNCS" in sass  # TMA tile loads completing on mbarriers
