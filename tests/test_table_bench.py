"""CPU check of benchmarks/table_bench.py: a bench JSON record as a docs table."""

from __future__ import annotations

from script_module import load_script


def _module():
    return load_script("benchmarks/table_bench.py")


def _row(causal: bool, fg: float, cudnn: float | None, mhz: list, watts: list) -> dict:
    return {"hdim": 128, "causal": causal, "seqlen": 2048, "tflops": {"flash_gen": fg, "cudnn": cudnn},
            "samples_sm_mhz": {"flash_gen": mhz, "cudnn": [1700.0]}, "samples_power_w": {"flash_gen": watts,
                                                                                      "cudnn": [690.0]}}


def test_a_row_per_cell_with_ratios_clocks_and_another_runs_ratios():
    run = {"date": "2026-12-02T06:06:29+00:00",
           "results": [_row(False, 620.0, 578.0, [1600.0, None, 1650.0], [689.0, 691.0, 690.0]),
                       _row(True, 486.0, None, [], [])]}  # a peer that failed: n/a, not a crash
    earlier = {"date": "2026-12-02T05:36:07+00:00", "results": [_row(False, 630.0, 595.0, [], [])]}
    lines = _module().table(run, clocks=True, against=earlier).splitlines()
    assert lines[0] == "| hdim | causal | S | flash_gen | cuDNN | fg/cuDNN | SM MHz | W | fg/cuDNN, 05:36 |"
    assert lines[2] == "| 128 | no | 2048 | 620 | 578 | 1.07 | 1625, 1700 | 690, 690 | 1.06 |"
    assert lines[3] == "| 128 | yes | 2048 | 486 | n/a | n/a | n/a, 1700 | n/a, 690 | n/a |"
