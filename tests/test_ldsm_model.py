"""CPU model of the forward kernel's hand-addressed ldmatrix (templates/include/flash_gen/sm80_ldsm.cuh).

For every thread and fragment register, the bytes that the LdsmTile addresses make ldmatrix deliver must be
the smem elements that CuTe's mma.sync m16n8k16 fragment layouts (mma_traits_sm80.hpp) expect, with the smem
offsets of CuTe's swizzled layout (SmemTile atoms through tile_to_shape, the swizzle applied to the full
offset). Both sides are transcribed here: the CuTe side from its layout definitions, the other from the
header's formulas and the PTX ISA's description of ldmatrix."""

from __future__ import annotations

import itertools

import pytest

ELEM = 2  # bytes of fp16/bf16


def atom_cols(cols: int) -> tuple[int, int]:
    """SmemTile<cols>: (atom columns, swizzle bits)."""
    ac = 64 if cols % 64 == 0 else 32 if cols % 32 == 0 else 16
    return ac, {64: 3, 32: 2, 16: 1}[ac]


def cute_offset(r: int, c: int, s: int, rows: int, cols: int) -> int:
    """Element offset of (r, c, stage s) in tile_to_shape(Swizzle<B,3,3> o (8,AC):(AC,1), (rows, cols, stages))."""
    ac, bits = atom_cols(cols)
    atom = r // 8 + rows // 8 * (c // ac) + rows // 8 * (cols // ac) * s  # atoms tiled column-major
    o = atom * 8 * ac + r % 8 * ac + c % ac
    return o ^ ((o >> 3) & (((1 << bits) - 1) << 3))


# CuTe's SM80 16x8x16 TV layouts: (thread (4, 8), value) -> index m + 16k (A) or n + 8k (B).
def mma_a(lane: int, v: tuple[int, int, int]) -> tuple[int, int]:
    idx = 32 * (lane % 4) + lane // 4 + 16 * v[0] + 8 * v[1] + 128 * v[2]
    return idx % 16, idx // 16


def mma_b(lane: int, v: tuple[int, int]) -> tuple[int, int]:
    idx = 16 * (lane % 4) + lane // 4 + 8 * v[0] + 64 * v[1]
    return idx % 8, idx // 8


class LdsmTile:
    """Python transcription of LdsmTile<kCols, kRows> (byte offsets)."""

    def __init__(self, cols: int, rows: int):
        self.ac, self.bits = atom_cols(cols)
        self.rows = rows
        self.row_bytes = 2 * self.ac

    def lane_offset(self, tidx: int) -> int:
        row, chunk = tidx % 16, tidx % 32 // 16
        return row * self.row_bytes + ((chunk ^ ((row >> (3 - self.bits)) & ((1 << self.bits) - 1))) << 4)

    def block(self, lane: int, row: int, col: int) -> int:
        return (lane ^ (2 * (col % self.ac))) + row * self.row_bytes + col // self.ac * self.rows * self.row_bytes


def ldmatrix(addrs: list[int], trans: bool) -> list[list[tuple[int, int]]]:
    """Byte addresses of the two 16-bit elements each lane receives in each of the 4 registers of an .x4
    ldmatrix, given the row address each lane supplies (lane 8q+p: row p of matrix q)."""
    out = []
    for lane in range(32):
        regs = []
        for q in range(4):
            if trans:  # element (row 2*(lane%4) + e, col lane/4)
                regs.append(tuple(addrs[8 * q + 2 * (lane % 4) + e] + ELEM * (lane // 4) for e in range(2)))
            else:  # elements (row lane/4, cols 2*(lane%4) + e)
                regs.append(tuple(addrs[8 * q + lane // 4] + ELEM * (2 * (lane % 4) + e) for e in range(2)))
        out.append(regs)
    return out


# (kD, block_m, block_n, warps, stages): every swizzle width, several row tiles, two stages.
CONFIGS = [
    (128, 128, 64, 4, 2),
    (128, 64, 64, 4, 1),
    (256, 128, 64, 8, 2),
    (64, 128, 128, 4, 2),
    (96, 128, 32, 4, 2),
    (160, 64, 32, 4, 1),
    (80, 128, 64, 4, 2),
    (16, 64, 32, 2, 2),
    (48, 32, 16, 2, 1),
]


@pytest.mark.parametrize("d, bm, bn, warps, stages", CONFIGS, ids=[f"d{c[0]}m{c[1]}n{c[2]}w{c[3]}s{c[4]}" for c in CONFIGS])
def test_ldsm_addresses_match_cute_fragments(d, bm, bn, warps, stages):
    q_tile, kv_tile = LdsmTile(d, bm), LdsmTile(d, bn)
    # Byte bases as in the kernel's smem buffer: Q, then the K stages, then the V stages.
    k_base = bm * d * ELEM
    v_base = k_base + stages * bn * d * ELEM
    stage_bytes = bn * d * ELEM
    stage = stages - 1

    def expect(rows, r, c, s, base):
        return base + ELEM * cute_offset(r, c, s, rows, d)

    for warp, i in itertools.product(range(warps), range(d // 16)):
        lanes = [q_tile.lane_offset(32 * warp + lane) for lane in range(32)]
        # Q (A operand, tSrQ): load_a<16 * warps> from the warp's base, registers in matrix order.
        q_base = 16 * warp * q_tile.row_bytes
        for m in range(bm // (16 * warps)):
            got = ldmatrix([q_base + q_tile.block(lane, m * 16 * warps, 16 * i) for lane in lanes], trans=False)
            for lane, h, e in itertools.product(range(32), range(4), range(2)):
                r, c = mma_a(lane, (e, h % 2, h // 2))
                assert got[lane][h][e] == expect(bm, 16 * warp + 16 * warps * m + r, 16 * i + c, 0, 0)
        # K (B operand from [n][k] rows, tSrK): load_b, matrices to registers (n, k), (n+1, k), (n, k+8), (n+1, k+8).
        k_addr = k_base + stage * stage_bytes
        for n in range(0, bn // 8, 2):
            got = ldmatrix([k_addr + kv_tile.block(lane, 8 * n, 16 * i) for lane in lanes], trans=False)
            for lane, q, e in itertools.product(range(32), range(4), range(2)):
                nn, kk = mma_b(lane, (e, q // 2))
                assert got[lane][q][e] == expect(bn, 8 * (n + q % 2) + nn, 16 * i + kk, stage, k_base)
    # V (B operand from [k][n] rows, tOrVt): k-slices over keys, n-tiles over the head dim; load_bt, matrices to
    # registers (n, k), (n, k+8), (n+1, k), (n+1, k+8).
    v_addr = v_base + stage * stage_bytes
    for warp, i in itertools.product(range(warps), range(bn // 16)):
        lanes = [kv_tile.lane_offset(32 * warp + lane) for lane in range(32)]
        for n in range(0, d // 8, 2):
            got = ldmatrix([v_addr + kv_tile.block(lane, 16 * i, 8 * n) for lane in lanes], trans=True)
            for lane, q, e in itertools.product(range(32), range(4), range(2)):
                nn, kk = mma_b(lane, (e, q % 2))
                assert got[lane][q][e] == expect(bn, 16 * i + kk, 8 * (n + q // 2) + nn, stage, v_base)
