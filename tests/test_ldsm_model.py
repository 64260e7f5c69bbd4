"""CPU model of the hand-addressed ldmatrix of the forward and backward kernels (sm80_ldsm.cuh).

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

    def offset(self, row: int, col: int) -> int:
        chunk = col % self.ac // 8
        swz = (row >> (3 - self.bits)) & ((1 << self.bits) - 1)
        return row * self.row_bytes + ((chunk ^ swz) << 4) + col // self.ac * self.rows * self.row_bytes

    def thread_offset(self, tidx: int, dr=8, dc=8, col_first=False, row0=0, col0=0) -> int:
        q = tidx % 32 // 8
        qr, qc = (q // 2, q % 2) if col_first else (q % 2, q // 2)
        return self.offset(row0 + tidx % 8 + dr * qr, col0 + dc * qc)

    def lane_offset(self, tidx: int) -> int:
        return self.thread_offset(tidx)

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
        # K (B operand from [n][k] rows, tSrK): load_b<8, true> from the column-first thread offset, matrices to
        # registers (n, k), (n, k+8), (n+1, k), (n+1, k+8): fragment order.
        k_addr = k_base + stage * stage_bytes
        k_lanes = [kv_tile.thread_offset(32 * warp + lane, col_first=True) for lane in range(32)]
        for n in range(0, bn // 8, 2):
            got = ldmatrix([k_addr + kv_tile.block(lane, 8 * n, 16 * i) for lane in k_lanes], trans=False)
            for lane, q, e in itertools.product(range(32), range(4), range(2)):
                nn, kk = mma_b(lane, (e, q % 2))
                assert got[lane][q][e] == expect(bn, 8 * (n + q // 2) + nn, 16 * i + kk, stage, k_base)
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


def test_lane_offset_is_the_forwards():
    """lane_offset, now thread_offset's 16x16 case, is the forward's original formula."""
    for cols, rows in itertools.product((16, 32, 48, 64, 128, 256), (32, 64, 128)):
        tile = LdsmTile(cols, rows)
        for tidx in range(256):
            row, chunk = tidx % 16, tidx % 32 // 16
            old = row * tile.row_bytes + ((chunk ^ ((row >> (3 - tile.bits)) & ((1 << tile.bits) - 1))) << 4)
            assert tile.lane_offset(tidx) == old


# ---- Backward (bwd_sm80.cuh): five GEMMs over three TiledMMAs whose warps split both M and N. Warp w of a
# TiledMMA with wm warps along M is (w % wm, w // wm) and owns the m16 tiles w_m + wm*j and the n8 tiles
# w_n + wn*j (checked against CuTe's partition_A/B on the host once; the forward's wn = 1 case is the same).


def frag_a(lane: int, w_m: int, wm: int, m: int, i: int, h: int, e: int) -> tuple[int, int]:
    """(m, k) of element e of 32-bit register h of A fragment tile (m, i) of warp row w_m."""
    r, c = mma_a(lane, (e, h % 2, h // 2))
    return 16 * (w_m + wm * m) + r, 16 * i + c


def frag_b(lane: int, w_n: int, wn: int, n: int, i: int, kh: int, e: int) -> tuple[int, int]:
    """(n, k) of element e of register kh of B fragment tile (n, i) of warp column w_n."""
    nn, kk = mma_b(lane, (e, kh))
    return 8 * (w_n + wn * n) + nn, 16 * i + kk


def ld_a(tile, base, offs, row_step, m, i):
    """load_a<row_step>: ({register h: element addresses} per lane, the row address each lane supplies)."""
    addrs = [base + tile.block(o, m * row_step, 16 * i) for o in offs]
    got = ldmatrix(addrs, trans=False)
    return [{h: got[lane][h] for h in range(4)} for lane in range(32)], addrs


def ld_at(tile, base, offs, col_step, m, i):
    addrs = [base + tile.block(o, 16 * i, m * col_step) for o in offs]
    got = ldmatrix(addrs, trans=True)
    return [{h: got[lane][h] for h in range(4)} for lane in range(32)], addrs


def ld_b(tile, base, offs, n_step, n, i):
    """load_b<n_step, true>: ({(n8 tile, register kh): element addresses} per lane, row addresses), tiles n, n + 1."""
    addrs = [base + tile.block(o, n_step * n, 16 * i) for o in offs]
    got = ldmatrix(addrs, trans=False)
    return [{(n + q // 2, q % 2): got[lane][q] for q in range(4)} for lane in range(32)], addrs


def ld_bt(tile, base, offs, n_step, n, i):
    addrs = [base + tile.block(o, 16 * i, n_step * n) for o in offs]
    got = ldmatrix(addrs, trans=True)
    return [{(n + q // 2, q % 2): got[lane][q] for q in range(4)} for lane in range(32)], addrs


def conflict_free(addrs: list[int]) -> bool:
    """Each 8x8 matrix's 8 rows of 16 bytes hit 8 distinct 16-byte bank groups (one wavefront per matrix)."""
    return all(len({a // 16 % 8 for a in addrs[8 * q : 8 * q + 8]}) == 8 for q in range(4))


def bwd_mismatches(d, bm, bn, warps, wm_sdp, wm_dkv, wm_dq, stages, broken=None):
    """Count fragment elements whose ldmatrix address differs from CuTe's, over all warps and operands of
    the backward kernel (bwd_sm80.cuh's thread offsets and bases, transcribed). Asserts bank-conflict freedom."""
    q_t, kv_t, p_t = LdsmTile(d, bm), LdsmTile(d, bn), LdsmTile(bn, bm)
    stage_bytes = bm * d * ELEM
    q_addr = 0
    do_addr = q_addr + stages * stage_bytes
    k_addr = do_addr + stages * stage_bytes
    v_addr = k_addr + bn * d * ELEM
    p_addr = v_addr + bn * d * ELEM
    ds_addr = p_addr + bm * bn * ELEM
    stage = stages - 1
    q_stage, do_stage = q_addr + stage * stage_bytes, do_addr + stage * stage_bytes
    wn_sdp, wn_dkv, wn_dq = warps // wm_sdp, warps // wm_dkv, warps // wm_dq

    def q_el(base):  # element (r, c) of a Q/dO stage
        return lambda r, c: base + ELEM * cute_offset(r, c, 0, bm, d)

    def kv_el(base):
        return lambda r, c: base + ELEM * cute_offset(r, c, 0, bn, d)

    def p_el(base):
        return lambda r, c: base + ELEM * cute_offset(r, c, 0, bm, bn)

    def t(el):  # the transposed operand: (m or n, k) is smem (k, m or n)
        return lambda r, c: el(c, r)

    bad = 0
    for warp in range(warps):
        tids = [32 * warp + lane for lane in range(32)]
        lane_q = [q_t.lane_offset(x) for x in tids]
        off_kv = [kv_t.thread_offset(x, 8 * wn_sdp, 8, True) for x in tids]
        q_row = 16 * (warp % wm_sdp) * q_t.row_bytes
        kv_row = 8 * (warp // wm_sdp) * kv_t.row_bytes
        lane_p = [p_t.lane_offset(x) for x in tids]
        ds_row = 16 * (warp % wm_dq) * p_t.row_bytes
        kt_dc, kt_col = (8, 0) if broken == "kt_16x16" else (8 * wn_dq, 8 * (warp // wm_dq))
        off_kt = [kv_t.thread_offset(x, 8, kt_dc, False, 0, kt_col) for x in tids]
        pt_col = 0 if broken == "pt_no_warp_col" else 16 * (warp % wm_dkv)
        off_pt = [p_t.thread_offset(x, 8, 8, True, 0, pt_col) for x in tids]
        off_qt = [q_t.thread_offset(x, 8, 8 * wn_dkv, False, 0, 8 * (warp // wm_dkv)) for x in tids]
        # (wm, M, N, K, load A(m, i), A element, load B(n, i), B element) per GEMM, as the kernel calls them.
        gemms = [
            (wm_sdp, bm, bn, d,  # S = Q K^T
             lambda m, i: ld_a(q_t, q_stage + q_row, lane_q, 16 * wm_sdp, m, i), q_el(q_stage),
             lambda n, i: ld_b(kv_t, k_addr + kv_row, off_kv, 8 * wn_sdp, n, i), kv_el(k_addr)),
            (wm_sdp, bm, bn, d,  # dP = dO V^T
             lambda m, i: ld_a(q_t, do_stage + q_row, lane_q, 16 * wm_sdp, m, i), q_el(do_stage),
             lambda n, i: ld_b(kv_t, v_addr + kv_row, off_kv, 8 * wn_sdp, n, i), kv_el(v_addr)),
            (wm_dq, bm, d, bn,  # dQ = dS K
             lambda m, i: ld_a(p_t, ds_addr + ds_row, lane_p, 16 * wm_dq, m, i), p_el(ds_addr),
             lambda n, i: ld_bt(kv_t, k_addr, off_kt, 8 * wn_dq, n, i), t(kv_el(k_addr))),
            (wm_dkv, bn, d, bm,  # dV = P^T dO
             lambda m, i: ld_at(p_t, p_addr, off_pt, 16 * wm_dkv, m, i), t(p_el(p_addr)),
             lambda n, i: ld_bt(q_t, do_stage, off_qt, 8 * wn_dkv, n, i), t(q_el(do_stage))),
            (wm_dkv, bn, d, bm,  # dK = dS^T Q
             lambda m, i: ld_at(p_t, ds_addr, off_pt, 16 * wm_dkv, m, i), t(p_el(ds_addr)),
             lambda n, i: ld_bt(q_t, q_stage, off_qt, 8 * wn_dkv, n, i), t(q_el(q_stage))),
        ]
        for wm, M, N, K, load_a, a_el, load_b, b_el in gemms:
            wn = warps // wm
            w_m, w_n = warp % wm, warp // wm
            for i in range(K // 16):
                for m in range(M // (16 * wm)):
                    regs, addrs = load_a(m, i)
                    assert conflict_free(addrs)
                    for lane, h, e in itertools.product(range(32), range(4), range(2)):
                        bad += regs[lane][h][e] != a_el(*frag_a(lane, w_m, wm, m, i, h, e))
                for n in range(0, N // (8 * wn), 2):
                    regs, addrs = load_b(n, i)
                    assert conflict_free(addrs)
                    tiles = [(n, 0), (n, 1), (n + 1, 0), (n + 1, 1)]
                    for lane, (nt, kh), e in itertools.product(range(32), tiles, range(2)):
                        bad += regs[lane][(nt, kh)][e] != b_el(*frag_b(lane, w_n, wn, nt, i, kh, e))
    return bad


# Backward default tilings (sm90, no mask), named by the padded head dim, as (d_mma, block_m, block_n, warps,
# a_sdp, a_dkv, a_dq, stages), plus a padded head dim on the 4-warp tiling and FA2's hdim-128 tiling (the default
# until 2026-11-30; the GPU tests still force it); one per distinct padded tiling.
def _bwd_configs():
    from flash_gen.spec import HEAD_DIMS
    from flash_gen.spec_bwd import BwdConfig, BwdKey, bwd_head_dim_mma, default_bwd_config

    keys = [(BwdKey("sm90", "bf16", hd), default_bwd_config(BwdKey("sm90", "bf16", hd))) for hd in HEAD_DIMS]
    keys.append((BwdKey("sm90", "bf16", 80), BwdConfig(64, 64, 4, 2, 4, 4, 1)))
    keys.append((BwdKey("sm90", "bf16", 128), BwdConfig(64, 128, 8, 2, 4, 2, 2)))
    out = {}
    for key, c in keys:  # one per distinct padded tiling
        cfg = (bwd_head_dim_mma(key, c), c.block_m, c.block_n, c.num_warps, c.warps_m_sdp, c.warps_n_dkv,
               c.warps_m_dq, c.stages)
        if cfg not in out.values():
            out[f"d{cfg[0]}_{c.name}"] = cfg
    return out


BWD_CONFIGS = _bwd_configs()


@pytest.mark.parametrize("cfg", BWD_CONFIGS.values(), ids=BWD_CONFIGS.keys())
def test_bwd_ldsm_addresses_match_cute_fragments(cfg):
    assert bwd_mismatches(*cfg) == 0


@pytest.mark.parametrize("broken", ["kt_16x16", "pt_no_warp_col"])
def test_bwd_model_catches_broken_addressing(broken):
    """The check is not vacuous: the forward's 16x16 offset for K^T (ignoring the warps' interleaved n8 tiles)
    or P^T without the warp's column offset must fail."""
    assert bwd_mismatches(*BWD_CONFIGS["d128_m64n128w8a242s2"], broken=broken) > 0
