"""CPU checks of benchmarks/tile_boundary_trace.py: its stamps still fit the Hopper forward's header, and stamps read
back turn into per-round segments."""

from __future__ import annotations

import pytest
from script_module import ROOT, load_script

HEADER = ROOT / "flash_gen/templates/include/flash_gen/fwd_sm90.cuh"


def test_stamps_fit_the_current_header():
    m = load_script("benchmarks/tile_boundary_trace.py")
    src = HEADER.read_text()
    patched = m.patch_header(src)
    for i in range(len(m.CONSUMER)):
        assert patched.count(f"FG_STAMP({i})") == 1
    for i in range(len(m.PRODUCER)):
        assert patched.count(f"FG_PSTAMP({i})") == 1
    with pytest.raises(ValueError, match="expected one"):
        m.patch_header(patched)  # each edit's text occurs once in the original only


@pytest.mark.parametrize("consumers", [2, 3])
def test_segments_from_stamps(consumers):
    m = load_script("benchmarks/tile_boundary_trace.py")
    n, rounds, tile = len(m.CONSUMER), 4, 10_000
    stamps = [0] * (m.PRODUCER_AT + len(m.PRODUCER) * m.ROUNDS)
    # Warpgroup w's round r: Q landed at r tile + 100 w, the other stamps at fixed offsets after it; the clock wraps
    # past 2^32 in round 2 (the segments are differences modulo 2^32).
    base = 2**32 - 15_000
    offsets = (0, 800, 7_000, 8_000, 8_500, 9_500, 2_000)  # CONSUMER's order
    for w in range(consumers):
        for r in range(rounds):
            for i, off in enumerate(offsets):
                stamps[w * m.ROUNDS * n + r * n + i] = (base + r * tile + 100 * w + off) & 0xFFFFFFFF
    for r in range(rounds):
        for i, off in enumerate((-2_700, -2_500, -1_000)):  # Q issued, first K, first V: before Q lands
            stamps[m.PRODUCER_AT + len(m.PRODUCER) * r + i] = (base + r * tile + off) & 0xFFFFFFFF
    seg = m.segments(stamps, consumers)
    assert seg["whole tile"] == [tile] * 2 * consumers  # rounds 1 and 2, every warpgroup
    assert seg["previous epilogue done -> Q landed"] == [tile - 9_500] * 2 * consumers
    assert seg["first S done -> first V landed"] == [1_200] * 2 * consumers
    # the last warpgroup released Q last
    assert seg["producer: last Q release -> Q issued"] == [tile - 7_000 - 100 * (consumers - 1) - 2_700] * 2
    assert seg["producer: Q issued -> warpgroup 0 past Q"] == [2_700] * 2
    for w in range(1, consumers):
        assert seg[f"warpgroup {w}'s Q landed after warpgroup 0's"] == [100 * w] * 2
    assert "first V issued -> warpgroup 0 past it" in m.report(stamps, consumers)


def test_a_warpgroup_ahead_of_warpgroup_0_shows_a_negative_lag():
    m = load_script("benchmarks/tile_boundary_trace.py")
    n = len(m.CONSUMER)
    stamps = [0] * (m.PRODUCER_AT + len(m.PRODUCER) * m.ROUNDS)
    for r in range(3):
        stamps[m.PRODUCER_AT + len(m.PRODUCER) * r] = 1  # three rounds ran
        stamps[r * n] = 5_000 + 10_000 * r  # warpgroup 0's Q landed
        stamps[m.ROUNDS * n + r * n] = (5_000 + 10_000 * r - 300) & 0xFFFFFFFF  # warpgroup 1's, 300 cycles earlier
    assert m.segments(stamps)["warpgroup 1's Q landed after warpgroup 0's"] == [-300]
