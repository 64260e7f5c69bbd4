"""flash_gen.runtime.section_schedule: the persistent causal forward's tile order and its model (CPU)."""

from __future__ import annotations

import collections

import pytest
import torch

from flash_gen.runtime.section_schedule import (
    BALANCE_SLACK, IMBALANCE_COST, KV_COST_PER_MIB, KV_FREE_MIB, MIN_KV_CUT, CausalLaunch, Schedule, balance,
    choose_section_pairs, modelled_time, running_kv_bytes, schedule,
)


def test_snaking_rounds_reverse_every_other_round():
    # 7 one-step tiles (one key block each) over 3 CTAs: rounds 0 and 2 run left to right, round 1 right to left.
    launch = CausalLaunch(seqlen=7 * 64, pairs=1, block_m=64, block_n=1 << 20, ctas=3, kv_row_bytes=4)
    plan = schedule(launch)
    assert plan.cost.shape == (3, 3)
    assert (plan.cost > 0).sum() == 7 and plan.cost[2].tolist() == [2, 0, 0]  # the last round's tile on CTA 0
    # Longest first (query blocks 6, 5, ..., 0); round 1 hands its tiles to CTAs 2, 1, 0.
    assert plan.keys.tolist() == [[448, 384, 320], [128, 192, 256], [64, 0, 0]]


@pytest.mark.parametrize("width", [0, 1, 3, 5, 64])
def test_every_tile_once(width):
    launch = CausalLaunch(seqlen=1000, pairs=13, block_m=192, block_n=128, ctas=10, kv_row_bytes=512)
    plan = schedule(launch, width)
    real = plan.cost > 0
    tiles = collections.Counter(zip(plan.pair[real].tolist(), plan.keys[real].tolist()))
    # Per pair, query blocks of 192 rows with the ragged one first, shifted by whole 64-row warpgroups (128 of the
    # 152 rows over 1000): its rows end at 64, the next ones' at 256, 448, ...
    assert tiles == collections.Counter((p, k) for p in range(13) for k in (64, 256, 448, 640, 832, 1000))
    assert plan.cost[real].tolist() == [(k - 1) // 128 + 2 for k in plan.keys[real].tolist()]


def test_kernel_width_fits_l2_but_holds_a_round():
    # 2k keys of head dim 256, 16-bit: 2 MiB a pair, 12 fit 24 MiB; a round of 132 CTAs holds 8.25 pairs' tiles.
    assert CausalLaunch(2048, 128, 128, 64, 132, 1024).kernel_width() == 12
    # 16k: one pair holds 16 MiB, but a round needs two pairs' 128 tiles.
    assert CausalLaunch(16384, 16, 128, 64, 132, 1024).kernel_width() == 2
    assert CausalLaunch(16384, 1, 128, 64, 132, 1024).kernel_width() == 1


def test_balance_is_the_busiest_cta_over_the_mean():
    plan = Schedule(torch.tensor([[5, 1, 1], [1, 1, 5]]), torch.zeros(2, 3, dtype=torch.int64),
                    torch.ones(2, 3, dtype=torch.int64))
    assert balance(plan) == pytest.approx(6 * 3 / 14)


def test_running_kv_counts_each_pair_once_at_its_longest_range():
    # Two CTAs at once, both on pair 0: its longest key range counts, once.
    plan = Schedule(torch.tensor([[4, 4]]), torch.tensor([[0, 0]]), torch.tensor([[128, 256]]))
    assert running_kv_bytes(plan, kv_row_bytes=256, samples=4).tolist() == [256 * 256] * 4


def test_running_kv_follows_the_ctas_drift():
    # CTA 0: a long tile of pair 0, then pair 3's; CTA 1: a short tile of pair 1, then pair 2's. Over time units
    # [0, 1) pairs 0 and 1 run, [1, 4) pairs 0 and 2, [4, 5) pair 3 alone, where the rounds put pairs 0 and 1,
    # then 2 and 3, together.
    plan = Schedule(torch.tensor([[4, 1], [1, 3]]), torch.tensor([[0, 1], [3, 2]]), torch.tensor([[64, 64], [64, 32]]))
    assert running_kv_bytes(plan, kv_row_bytes=1, samples=5).tolist() == [128, 96, 96, 96, 64]


def test_persistent_balance_script_prints_a_line_per_length_and_width(capsys, monkeypatch):
    from script_module import load_script

    script = load_script("benchmarks/persistent_balance.py")
    monkeypatch.setattr("sys.argv", ["persistent_balance.py", "--hdim", "128", "--block-m", "192", "--block-n", "80",
                                     "--seqlen", "2000,4096", "--section-pairs", "0,3", "--greedy"])
    script.main()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"hdim 128 m192 n80 S {s} width {w}" for s in (2000, 4096)
                                                     for w in ("kernel", 3)]
    assert all("greedy max/mean" in line and "running at once" in line for line in lines)


def _anchor(hdim: int, seqlen: int, block_m: int, block_n: int) -> CausalLaunch:
    """shared/ANCHORS.md's causal shapes: 32k tokens a batch, model dim 2048, on 132 SMs."""
    return CausalLaunch(seqlen, (2048 // hdim) * (32768 // seqlen), block_m, block_n, 132, 2 * hdim * 2)


@pytest.mark.parametrize("hdim, seqlen, block_m, block_n, width", [
    (256, 2048, 128, 64, 1),  # measured +4.7% over the kernel's 12 pairs (H100, 2026-12-06)
    (128, 2048, 192, 80, 0),  # narrower sections unbalance 192-row tiles (one pair: -36%, measured)
    (256, 8192, 128, 64, 0),  # one pair spreads the running tiles over more pairs (-7.6%, measured)
])
def test_choose_section_pairs_on_measured_cells(hdim, seqlen, block_m, block_n, width):
    assert choose_section_pairs(_anchor(hdim, seqlen, block_m, block_n)) == width


def test_a_chosen_width_keeps_the_balance_and_cuts_the_running_kv():
    launch = _anchor(64, 4096, 192, 128)
    width = choose_section_pairs(launch)
    assert 0 < width < launch.kernel_width()
    kernel, chosen = schedule(launch), schedule(launch, width)
    assert balance(chosen) <= balance(kernel) + BALANCE_SLACK
    kv = [running_kv_bytes(p, launch.kv_row_bytes).double().mean().item() for p in (kernel, chosen)]
    assert kv[1] <= (1 - MIN_KV_CUT) * kv[0]


def test_one_round_keeps_the_kernel_rule():
    assert choose_section_pairs(CausalLaunch(2048, 8, 128, 64, 132, 1024)) == 0  # 128 tiles on 132 CTAs


def test_the_forward_plans_describe_their_launch_to_the_model(monkeypatch):
    from types import SimpleNamespace

    from flash_gen.runtime import fwd
    from flash_gen.spec_sm90 import Sm90FwdConfig

    seen = []
    monkeypatch.setattr(fwd, "choose_section_pairs", lambda launch: seen.append(launch) or 7)
    cfg = Sm90FwdConfig(block_m=192, block_n=128, persistent=True)
    # GQA, 4 query heads a KV head: unpacked, 4 consecutive pairs read one K/V; packed, a tile of 3 warpgroups
    # holds 3 x 16 positions of the group's heads.
    assert fwd._model_section_pairs(SimpleNamespace(cfg=cfg, pack_gqa=False, head_dim=64), 2048, 512, 4, 132, 2) == 7
    assert fwd._model_section_pairs(SimpleNamespace(cfg=cfg, pack_gqa=True, head_dim=64), 2048, 128, 4, 132, 2) == 7
    assert seen == [CausalLaunch(2048, 512, 192, 128, 132, 256, group=4, wg_rows=64),
                    CausalLaunch(2048, 128, 48, 128, 132, 256, group=1, wg_rows=16)]
    clustered = Sm90FwdConfig(block_m=192, block_n=128, persistent=True, cluster=2)
    assert fwd._model_section_pairs(SimpleNamespace(cfg=clustered, pack_gqa=False, head_dim=64), 2048, 512, 1,
                                    132, 2) == 0


def test_short_keys_narrow_nothing():
    # 132 CTAs x 512 keys x 256 bytes: 16.5 MiB, within L2 whatever the order: no narrowing, and the kernel's rule
    # is as even as any width (1.005).
    assert choose_section_pairs(_anchor(64, 512, 192, 128)) == 0


@pytest.mark.parametrize("hdim, seqlen, pairs, width", [
    (256, 8192, 16, 4),  # the kernel's 3-pair sections leave the busiest CTA 1.156x the mean: 4 pairs +9.9% (H100)
    (256, 4096, 32, 3),  # 1.153x: 3 pairs +6.5% (H100)
    (128, 2048, 128, 22),  # 1.106x: 22 pairs +6.0% (H100)
])
def test_balancing_repairs_the_uneven_16k_token_cells(hdim, seqlen, pairs, width):
    block_m, block_n = (128, 64) if hdim == 256 else (192, 80)
    assert choose_section_pairs(CausalLaunch(seqlen, pairs, block_m, block_n, 132, 4 * hdim)) == width


def test_modelled_time_weighs_balance_and_the_running_kv_past_its_free_share():
    assert modelled_time(1.0, 10 << 20) == 1.0
    assert modelled_time(1.1, 0) == pytest.approx(1 + 0.1 * IMBALANCE_COST)
    assert modelled_time(1.0, (KV_FREE_MIB + 10) << 20) == pytest.approx(1 + 10 * KV_COST_PER_MIB)


def test_width_sweep_times_the_widths_no_other_beats_in_both_figures(monkeypatch):
    from script_module import ROOT, load_script

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its bench_common, as when run from there
    pareto = load_script("benchmarks/bench_section_width.py")._pareto
    # Width 2 is beaten by 1 in both figures, 4 ties 3 in balance with more K/V; 1 and 3 trade one for the other.
    assert pareto({1: (1.03, 30.0), 2: (1.05, 31.0), 3: (1.00, 40.0), 4: (1.00, 41.0)}) == [1, 3]
