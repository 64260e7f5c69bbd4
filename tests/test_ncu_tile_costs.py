"""CPU check of benchmarks/ncu_tile_costs.py: two ncu source-page exports split into per-step and per-tile costs."""

from __future__ import annotations

import pytest
from script_module import load_script

HEADER = ['"Kernel Name","k",', '"Address","Source","Warp Stall Sampling (All Samples)",'
          '"Warp Stall Sampling (Not-issued Samples)","Instructions Executed","stall_long_sb","stall_wait",'
          '"stall_wait (Not Issued)"']


def _export(tmp_path, name: str, rows: list[tuple[str, int, int, int, int]]) -> str:
    """An export whose rows are (SASS, samples, executed, long_sb samples, wait samples)."""
    lines = HEADER + [f'"0x{16 * i:x}","{sass}","{n}","{n}","{ex}","{lsb}","{w}","0"'
                      for i, (sass, n, ex, lsb, w) in enumerate(rows)]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_per_tile_instructions_carry_the_short_runs_extra(tmp_path):
    m = load_script("benchmarks/ncu_tile_costs.py")
    short = _export(tmp_path, "s.csv", [("HGMMA.64x64x16", 800, 100, 0, 800),       # key step: 8x as often at 16k
                                        ("@!P0 BRA 0x40", 300, 10, 300, 0),          # tile start: as often
                                        ("EXIT", 0, 0, 0, 0)])                       # never executed
    long = _export(tmp_path, "l.csv", [("HGMMA.64x64x16", 6400, 800, 0, 6400),
                                       ("@!P0 BRA 0x80", 80, 10, 80, 0),
                                       ("EXIT", 0, 0, 0, 0)])
    lines = m.report(m.read(short), m.read(long), ratio=8, top=1).splitlines()
    assert lines[2] == "| step (1) | 800 | 800 | +0 |"
    assert lines[3] == "| tile (1) | 300 | 10 | +290 |"
    assert lines[5] == "| all | 1,100 | 810 | +290 (26.4% of the short run's) |"
    assert lines[-1] == "| 1 | tile | 300 | 10.0 | long_sb | `@!P0 BRA 0x40` |"


def test_exports_of_different_kernels_are_refused(tmp_path):
    m = load_script("benchmarks/ncu_tile_costs.py")
    a = _export(tmp_path, "a.csv", [("HGMMA.64x64x16", 1, 1, 0, 0)])
    b = _export(tmp_path, "b.csv", [("FADD R1, R2, R3", 1, 1, 0, 0)])
    with pytest.raises(ValueError, match="not of the same kernel"):
        m.report(m.read(a), m.read(b), ratio=8)
