"""Attention dropout's random draws (CPU only): flash_gen.reference's Philox4x32-10 against Random123's published
known answers, its dropout bits against the kernels' own header (templates/include/flash_gen/philox.cuh) compiled
by the host compiler, the keep mask's statistics, and attention_ref's use of the mask."""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from flash_gen.reference import (
    _dropout_bits_grid,
    attention_ref,
    dropout_bits,
    dropout_keep,
    dropout_keep_dense,
    philox4x32_10,
)
from flash_gen.spec import dropout_keep_threshold

INCLUDE = Path(__file__).resolve().parents[1] / "flash_gen" / "templates" / "include"

# Known answers of Philox4x32 with 10 rounds: (counter c0..c3, key k0 k1, expected output words 0..3), the three
# "philox4x32 10" lines of Random123's tests/kat_vectors (D. E. Shaw Research, github.com/DEShawResearch/random123),
# as cut-and-pasted from that file into DEShawResearch/Random123-Boost, libs/random/test/test_philox.cpp
# (commit 916db91ae4c6fd8324ef054a518851321ab41f91, test_kat_philox4x32). Line format: CTR[4] KEY[2] EXPECTED[4].
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

# Seeds as the kernels read them (int64 rng_state[0]): one whose int64 is negative, so k1 has its top bit set.
SEEDS = (0x0123456789ABCDEF, -0x3C6EF372FE94F82B)
GRID_B, GRID_H = (0, 3), (0, 5)
# Rows/columns 0..40 cover several 16-wide tiles and a ragged edge; the large ones exercise i // 16 well past a
# 16-bit counter and 70000-long sequences.
GRID_IJ = tuple(range(41)) + (65535, 65536, 70000, 70009, 1_000_003)


def _t(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@pytest.mark.parametrize("ctr,key,expected", KAT, ids=["zeros", "ones", "pi"])
def test_philox_known_answers(ctr: tuple[int, ...], key: tuple[int, int], expected: tuple[int, ...]) -> None:
    out = philox4x32_10(*(_t(c) for c in ctr), *key)
    assert tuple(int(w) for w in out) == expected


def test_philox_vectorised_matches_scalar() -> None:
    # Broadcasting a batch of counters gives each one's scalar answer (no cross-talk between elements).
    ctr = [_t(*(row[0][w] for row in KAT)) for w in range(4)]
    outs = [philox4x32_10(*(_t(row[0][w]) for w in range(4)), 0xA4093822, 0x299F31D0) for row in KAT]
    batched = philox4x32_10(*ctr, 0xA4093822, 0x299F31D0)
    for n, out in enumerate(outs):
        assert [int(w[n]) for w in batched] == [int(w) for w in out]
    assert all(w.dtype == torch.int64 and int(w.min()) >= 0 and int(w.max()) <= 0xFFFFFFFF for w in batched)


@pytest.fixture(scope="module")
def header_output(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Lines printed by a host build of philox.cuh: dropout bits over the grid for each seed, then the KAT blocks."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found: cannot build philox.cuh on the host to compare with the Python reference")
    tmp = tmp_path_factory.mktemp("philox")
    seeds = ", ".join(f"INT64_C({s})" for s in SEEDS)
    kat = ", ".join("{" + ", ".join(f"0x{v:08X}u" for v in (*ctr, *key)) + "}" for ctr, key, _ in KAT)
    source = f"""
#include <cinttypes>
#include <cstdio>
#include "flash_gen/philox.cuh"
using namespace flash_gen;
int main() {{
  const int64_t seeds[] = {{{seeds}}};
  const int bs[] = {{{", ".join(map(str, GRID_B))}}}, hs[] = {{{", ".join(map(str, GRID_H))}}};
  const int ijs[] = {{{", ".join(map(str, GRID_IJ))}}};
  for (int64_t seed : seeds) {{
    const uint64_t s = uint64_t(seed);  // the kernels' reinterpretation of rng_state[0]
    const uint32_t k0 = uint32_t(s), k1 = uint32_t(s >> 32);
    for (int b : bs) for (int h : hs) for (int i : ijs) for (int j : ijs)
      std::printf("%" PRIu32 "\\n", dropout_bits(dropout_block(k0, k1, b, h, i, j), dropout_slot(i, j)));
  }}
  const uint32_t kat[][6] = {{{kat}}};
  for (auto const& v : kat) {{
    const PhiloxBlock o = philox4x32_10(v[0], v[1], v[2], v[3], v[4], v[5]);
    std::printf("%08" PRIx32 " %08" PRIx32 " %08" PRIx32 " %08" PRIx32 "\\n", o.w[0], o.w[1], o.w[2], o.w[3]);
  }}
}}
"""
    (tmp / "driver.cpp").write_text(source)
    exe = tmp / "driver"
    build = subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-I", str(INCLUDE), str(tmp / "driver.cpp"),
                            "-o", str(exe)], capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True)
    return run.stdout.split("\n")[:-1]


def test_header_kat_matches_reference(header_output: list[str]) -> None:
    # The header's philox4x32_10 also reproduces Random123's answers, so both sides implement the standard one.
    got = header_output[-len(KAT):]
    assert got == [" ".join(f"{w:08x}" for w in expected) for _, _, expected in KAT]


@pytest.mark.parametrize("seed_index", range(len(SEEDS)))
def test_header_dropout_bits_match_reference(header_output: list[str], seed_index: int) -> None:
    per_seed = len(GRID_B) * len(GRID_H) * len(GRID_IJ) ** 2
    chunk = header_output[seed_index * per_seed:(seed_index + 1) * per_seed]
    assert len(header_output) == len(SEEDS) * per_seed + len(KAT)
    cpp = torch.tensor([int(x) for x in chunk], dtype=torch.int64).view(len(GRID_B), len(GRID_H), len(GRID_IJ), -1)
    b, h, ij = _t(*GRID_B), _t(*GRID_H), _t(*GRID_IJ)
    seed = SEEDS[seed_index]
    py = dropout_bits(seed, b[:, None, None, None], h[:, None, None], ij[:, None], ij)
    mismatch = (py != cpp).nonzero()
    assert mismatch.numel() == 0, f"{len(mismatch)} bits differ, first at (b, h, i, j) index {mismatch[0].tolist()}"
    # The grid helpers (one Philox block per 8 scores, then scattered) agree with the header on the small grid too.
    small = len(range(41))
    for p in (0.1, 0.5, 0.9):
        thr = dropout_keep_threshold(p)
        for n, entry in enumerate(GRID_B):
            keep = dropout_keep(seed, p, entry, max(GRID_H) + 1, small, small)[list(GRID_H)]
            assert torch.equal(keep, cpp[n, :, :small, :small] < thr)


def test_grid_bits_match_pointwise() -> None:
    # Ragged sizes (not multiples of 16) and several entries and heads: the block-and-scatter path equals the rule.
    seed, entries, nheads, sq, sk = -7, _t(0, 1, 6), 3, 37, 53
    grid = _dropout_bits_grid(seed, entries, nheads, sq, sk)
    pointwise = dropout_bits(seed, entries[:, None, None, None], torch.arange(nheads)[:, None, None],
                             torch.arange(sq)[:, None], torch.arange(sk))
    assert grid.shape == (3, nheads, sq, sk)
    assert torch.equal(grid.long(), pointwise)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_fraction(p: float) -> None:
    keep = dropout_keep_dense(0x5EED, p, 2, 4, 256, 256)  # 524288 scores: std of the fraction <= 0.0007
    assert keep.dtype == torch.bool and keep.shape == (2, 4, 256, 256)
    assert abs(keep.double().mean().item() - (1 - p)) < 0.004
    # Each of a block's 8 slots (16-bit halves of its 4 words) is unbiased on its own (65536 scores each).
    i, j = torch.arange(256)[:, None], torch.arange(256)
    slot = ((j % 16) // 8) * 4 + ((i % 16) // 8) * 2 + j % 2
    for s in range(8):
        assert abs(keep[..., slot == s].double().mean().item() - (1 - p)) < 0.012, s


def test_keep_extremes_and_distinct_streams() -> None:
    shape = (2, 3, 40, 72)
    assert bool(dropout_keep_dense(123, 0.0, *shape).all())
    assert not bool(dropout_keep_dense(123, 1.0, *shape).any())
    base = dropout_keep_dense(123, 0.5, *shape)
    assert not torch.equal(base, dropout_keep_dense(124, 0.5, *shape))
    assert not torch.equal(base, dropout_keep_dense(123 + (1 << 32), 0.5, *shape))  # k1 matters too
    assert not torch.equal(base[0], base[1])  # entries draw different streams
    assert not torch.equal(base[:, 0], base[:, 1])  # and so do heads
    # A negative seed is its two's-complement uint64.
    assert torch.equal(dropout_keep_dense(-1, 0.5, *shape), dropout_keep_dense((1 << 64) - 1, 0.5, *shape))


def test_dense_is_stacked_entries() -> None:
    seed, p, batch, nheads, sq, sk = -0x1234_5678_9ABC, 0.3, 3, 2, 33, 70
    dense = dropout_keep_dense(seed, p, batch, nheads, sq, sk)
    stacked = torch.stack([dropout_keep(seed, p, b, nheads, sq, sk) for b in range(batch)])
    assert torch.equal(dense, stacked)


def _qkv(batch: int, sq: int, sk: int, nheads: int, d: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(batch, n, nheads, d, generator=gen, dtype=torch.float64) for n in (sq, sk, sk))


def test_attention_ref_all_kept_is_plain() -> None:
    q, k, v = _qkv(2, 24, 40, 2, 16)
    args = dict(scale=0.25, causal=True, window=(-1, -1), softcap=0.0, alibi_slopes=None, upcast=True)
    out, lse = attention_ref(q, k, v, **args)
    mask = torch.ones(2, 2, 24, 40, dtype=torch.bool)
    out_d, lse_d = attention_ref(q, k, v, **args, dropout_mask=mask, dropout_p=0.0)
    # Not bitwise: a CI machine's CPU once gave float64 logsumexp 2e-10 apart on the same scores from one call to
    # the next (its kernel path may depend on buffer alignment or threading). 1e-8 is still far below any kernel check.
    torch.testing.assert_close(out_d, out, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(lse_d, lse, rtol=1e-8, atol=1e-8)
    with pytest.raises(ValueError):
        attention_ref(q, k, v, **args, dropout_p=0.1)


def test_attention_ref_dropout_by_hand() -> None:
    q = torch.tensor([[0.5, -1.0], [1.5, 0.25], [-0.75, 2.0]], dtype=torch.float64)
    k = torch.tensor([[1.0, 0.0], [0.5, -0.5], [-1.0, 1.5]], dtype=torch.float64)
    v = torch.tensor([[1.0, 2.0], [-3.0, 0.5], [0.25, -1.0]], dtype=torch.float64)
    keep = [[True, False, True], [True, True, True], [False, False, True]]
    p, scale = 0.25, 0.7
    out, lse = attention_ref(q[None, :, None], k[None, :, None], v[None, :, None], scale=scale, causal=False,
                             window=(-1, -1), softcap=0.0, alibi_slopes=None, upcast=True,
                             dropout_mask=torch.tensor(keep)[None, None], dropout_p=p)
    for r in range(3):
        s = [scale * sum(q[r, d].item() * k[c, d].item() for d in range(2)) for c in range(3)]
        total = sum(math.exp(x) for x in s)
        probs = [math.exp(s[c]) / total * (keep[r][c] / (1 - p)) for c in range(3)]
        want = [sum(probs[c] * v[c, d].item() for c in range(3)) for d in range(2)]
        assert out[0, r, 0].tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)
        assert lse[0, 0, r].item() == pytest.approx(math.log(total), rel=1e-12)  # dropout leaves lse alone


def test_attention_ref_dropout_blind_rows_and_all_dropped() -> None:
    # seqlen_q > seqlen_k under causal (bottom-right aligned): the first row sees no key and stays 0 with dropout.
    q, k, v = _qkv(1, 3, 2, 1, 4)
    args = dict(scale=0.5, causal=True, window=(-1, -1), softcap=0.0, alibi_slopes=None, upcast=False)
    mask = dropout_keep_dense(9, 0.5, 1, 1, 3, 2)
    out, lse = attention_ref(q.float(), k.float(), v.float(), **args, dropout_mask=mask, dropout_p=0.5)
    assert torch.equal(out[0, 0], torch.zeros(1, 4)) and lse[0, 0, 0].item() == math.inf
    none = torch.zeros(1, 1, 3, 2, dtype=torch.bool)
    out, _ = attention_ref(q, k, v, **args, dropout_mask=none, dropout_p=1.0)
    assert torch.equal(out, torch.zeros_like(out))  # p = 1 drops everything to 0, not nan
