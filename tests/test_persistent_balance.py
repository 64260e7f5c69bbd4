"""benchmarks/persistent_balance.py's model of the persistent causal schedule (CPU)."""

from __future__ import annotations

from script_module import load_script

balance = load_script("benchmarks/persistent_balance.py")
Tile = balance.Tile
MIB_PER_KEY = 2 * 2 * 64 / 2**20  # K and V, 16-bit, head dim 64


def test_snaking_rounds_reverse_every_other_round():
    assert [balance.snaking_cta(t, 3) for t in range(7)] == [0, 1, 2, 2, 1, 0, 0]
    assert balance.snaking_rounds([5, 1, 1, 1, 1, 5], 3) == [10, 2, 2]


def test_running_kv_counts_each_pair_once_at_its_longest_range():
    # Two CTAs at once, both on pair 0: its longest key range counts, once.
    tiles = [Tile(cost=4, pair=0, keys=128), Tile(cost=4, pair=0, keys=256)]
    assert balance.running_kv_mib(tiles, ctas=2, hdim=64, samples=4) == [256 * MIB_PER_KEY] * 4


def test_running_kv_follows_the_ctas_drift():
    # CTA 0: a long tile of pair 0, then pair 3's; CTA 1 (snaking): a short tile of pair 1, then pair 2's. Over
    # time units [0, 1) pairs 0 and 1 run, [1, 4) pairs 0 and 2, [4, 5) pair 3 alone, where the rounds put pairs 0
    # and 1, then 2 and 3, together.
    tiles = [Tile(4, 0, 64), Tile(1, 1, 64), Tile(3, 2, 32), Tile(1, 3, 64)]
    assert [balance.snaking_cta(t, 2) for t in range(4)] == [0, 1, 1, 0]
    running = balance.running_kv_mib(tiles, ctas=2, hdim=64, samples=5)
    assert running == [k * MIB_PER_KEY for k in (128, 96, 96, 96, 64)]
    assert balance.round_kv_mib(tiles, ctas=2, hdim=64) == [128 * MIB_PER_KEY, 96 * MIB_PER_KEY]
