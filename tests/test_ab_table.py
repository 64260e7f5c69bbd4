"""CPU check of benchmarks/ab_table.py: two trees' bench records, timed alternately, as an A/B table."""

from __future__ import annotations

import pytest

from script_module import load_script


def _module():
    return load_script("benchmarks/ab_table.py")


def _record(fg: float, forced: float | None, mhz: float | None, extra_cell: bool = False) -> dict:
    tflops = {"flash_gen": fg, "fg:wgbm80n128b": forced, "cudnn": 500.0}
    rows = [{"hdim": 128, "causal": False, "seqlen": 2048, "tflops": tflops,
             "samples_sm_mhz": {"flash_gen": [mhz, mhz] if mhz else [None], "fg:wgbm80n128b": [mhz or 0.0]}}]
    if extra_cell:  # a cell only one record has: left out
        rows.append({**rows[0], "seqlen": 8192})
    return {"results": rows}


def test_each_flash_gen_column_gets_its_runs_and_the_change_of_their_means():
    ab = _module()
    base = [_record(500.0, 490.0, 1700.0), _record(510.0, 500.0, 1700.0, extra_cell=True)]
    new = [_record(515.0, 495.0, 1650.0), _record(515.0, None, 1650.0)]  # a forced tiling that failed once
    rows = ab.ab_rows(base, new)
    assert [(r["cell"], r["impl"]) for r in rows] == [((128, False, 2048), "flash_gen")]  # peers are not A/B'd
    (row,) = rows
    assert row["base"] == [500.0, 510.0] and row["new"] == [515.0, 515.0]
    assert row["change"] == pytest.approx(515.0 / 505.0 - 1)
    assert row["per_clock"] == pytest.approx((515.0 / 1650.0) / (505.0 / 1700.0) - 1)
    lines = ab.table(rows).splitlines()
    assert lines[0] == "| hdim | causal | S | column | base | new | change | per SM MHz |"
    assert lines[2] == "| 128 | no | 2048 | flash_gen | 500 / 510 | 515 / 515 | +2.0% | +5.1% |"


def test_records_without_clocks_give_no_per_clock_change():
    ab = _module()
    (row, _) = ab.ab_rows([_record(500.0, 490.0, None)], [_record(510.0, 480.0, None)])
    assert row["per_clock"] is None
    assert ab.table([row]).splitlines()[2].endswith("| +2.0% | n/a |")
