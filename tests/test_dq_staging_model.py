"""CPU model of the Hopper backward's dQ staging stores (bwd_sm90.cuh, stage_dq, not transposed): each thread's wgmma
accumulators go into 32-column fp32 boxes swizzled by 128 bytes, two floats per 8-byte store, odd rows in a crossed
order. Transcribed here: CuTe's layout (Swizzle<3,2,3> o (8,32):(32,1) tiled column-major to the staging tile), the
wgmma m64nNk16 accumulator layout, the kernel's store order, and shared memory's service of 8-byte accesses by
half-warps (a half-warp takes as many wavefronts as the most requests on one bank)."""

from __future__ import annotations

import collections

import pytest

BOX = 32  # fp32 columns of a box


def staged_offset(r: int, c: int, rows: int) -> int:
    """Float offset of (row, column) in tile_to_shape(Swizzle<3,2,3> o (8,32):(32,1), (rows, cols))."""
    o = (r // 8 + rows // 8 * (c // BOX)) * 8 * BOX + r % 8 * BOX + c % BOX
    return o ^ ((o >> 3) & (0b111 << 2))


def fragment(lane: int, warp: int, i: int, n: int) -> tuple[int, int]:
    """(row, column) of accumulator element i of a warp's lane in an m64nN wgmma tiled down the rows: i = v0 + 2 v1 +
    4 k + 4 (N / 8) m, row 16 warp + lane / 4 + 8 v1 + 64 m, column 8 k + 2 (lane % 4) + v0."""
    v0, v1, k, m = i % 2, i // 2 % 2, i // 4 % (n // 8), i // (n // 2)
    return 16 * warp + lane // 4 + 8 * v1 + 64 * m, 8 * k + 2 * (lane % 4) + v0


def store_order(lane: int, size: int, crossed: bool) -> list[int]:
    """The first element of each 8-byte store, in issue order: pairs i and i ^ 8, odd rows' swapped when crossed."""
    order = []
    for i in range(0, size, 2):
        if i & 8:
            continue
        first, second = (i ^ 8, i) if crossed and lane // 4 % 2 else (i, i ^ 8)
        order += [first, second]
    return order


def wavefronts(rows: int, n: int, m_tiles: int, origin: tuple[int, int],
               crossed: bool) -> tuple[list[int], collections.Counter]:
    """Per store instruction of one warpgroup (its m_tiles x 64 rows and n columns from `origin` in a tile of `rows`
    rows), the worst warp's wavefronts, and how often each staged float was written."""
    size = m_tiles * n // 2  # floats per thread: N / 2 per 64-row m-tile
    written, per_store = collections.Counter(), []
    for s in range(size // 2):
        worst = 0
        for warp in range(4):
            banks_by_half = [collections.defaultdict(set), collections.defaultdict(set)]
            for lane in range(32):
                i = store_order(lane, size, crossed)[s]
                for j in (i, i + 1):
                    r, c = fragment(lane, warp, j, n)
                    off = staged_offset(origin[0] + r, origin[1] + c, rows)
                    written[off] += 1
                    banks_by_half[lane // 16][off % 32].add(off)
            worst = max(worst, sum(max(len(a) for a in half.values()) for half in banks_by_half))
        per_store.append(worst)
    return per_store, written


# (tile rows, wgmma N, 64-row m-tiles per warpgroup, the warpgroups' (row, column) origins): head dim 256's halves
# (128 columns each, the tile a half), 128 with 64-query steps, 64 with 128-query steps (the warpgroups splitting
# the rows, N = 64 each; before 2026-12-04 the columns, N = 32, two m-tiles each).
SHAPES = [(64, 128, 1, ((0, 0),)), (64, 64, 1, ((0, 0), (0, 64))), (128, 64, 1, ((0, 0), (64, 0))),
          (128, 32, 2, ((0, 0), (0, 32)))]


@pytest.mark.parametrize("rows,n,m_tiles,origins", SHAPES)
def test_crossed_order_stores_every_float_once_at_two_wavefronts(rows, n, m_tiles, origins):
    written = collections.Counter()
    for origin in origins:
        per_store, w = wavefronts(rows, n, m_tiles, origin, crossed=True)
        assert set(per_store) == {2}  # 256 bytes a store: the minimum
        written += w
    tile_floats = len(origins) * m_tiles * 64 * n  # the warpgroups' parts cover the tile
    assert sorted(written) == list(range(tile_floats)) and set(written.values()) == {1}


@pytest.mark.parametrize("rows,n,m_tiles,origins", SHAPES)
def test_plain_order_conflicts(rows, n, m_tiles, origins):
    """What ncu measured before (2026-12-04): rows 2s and 2s + 1 of a half-warp on the same 8 banks."""
    per_store, _ = wavefronts(rows, n, m_tiles, origins[0], crossed=False)
    assert set(per_store) == {4}


@pytest.mark.parametrize("rows,n,m_tiles,origins", SHAPES)
def test_partner_address_is_xor_64_bytes(rows, n, m_tiles, origins):
    """The kernel addresses element i ^ 8 as element i's address XOR 64 bytes."""
    for r0, c0 in origins:
        for warp in range(4):
            for lane in range(32):
                for i in range(0, m_tiles * n // 2, 2):
                    (ra, ca), (rb, cb) = fragment(lane, warp, i, n), fragment(lane, warp, i ^ 8, n)
                    a, b = staged_offset(r0 + ra, c0 + ca, rows), staged_offset(r0 + rb, c0 + cb, rows)
                    assert b * 4 == (a * 4) ^ 64
