"""CPU check of scripts/sass_report.py's parsing: opcode census and spans between synchronisation points."""

from __future__ import annotations

from script_module import load_script


LISTING = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                     /* 0x00000a00ff017b82 */
        /*0010*/                   WARPGROUP.ARRIVE ;                          /* 0x00000000000079c5 */
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;  /* 0x00e0000008187 */
        /*0030*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;            /* 0x00008000000079c5 */
        /*0040*/                   FFMA R2, R24, R3, -R4 ;                    /* 0x0000000318027223 */
        /*0050*/              @!P0 MUFU.EX2 R2, R2 ;                          /* 0x0000000200028308 */
        /*0060*/                   ST.E desc[UR58][R12.64], R2 ;              /* 0x0000000c02007985 */
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;              /* 0x0000000000007b1d */
        /*0080*/                   EXIT ;                                     /* 0x000000000000794d */
"""


def _module():
    return load_script("scripts/sass_report.py")


def test_census_counts_opcodes_and_wgmma_shapes():
    ops, shapes = _module().census(LISTING)
    assert ops["HGMMA"] == 1 and ops["MUFU"] == 1 and ops["WARPGROUP"] == 2 and sum(ops.values()) == 9
    assert shapes == {"64x64x16": 1}


def test_spans_cut_before_each_synchronisation_point():
    got = [(address, opener, count, dict(ops)) for address, opener, count, ops in _module().spans(LISTING)]
    assert got == [
        (0x00, "LDC", 1, {"LDC": 1}),
        (0x10, "WARPGROUP.ARRIVE", 2, {"WARPGROUP": 1, "HGMMA": 1}),
        (0x30, "WARPGROUP.DEPBAR.LE", 4, {"WARPGROUP": 1, "FFMA": 1, "MUFU": 1, "ST": 1}),
        (0x70, "BAR.SYNC.DEFER_BLOCKING", 2, {"BAR": 1, "EXIT": 1}),
    ]
    assert [span[0] for span in _module().spans(LISTING, min_len=3)] == [0x30]
