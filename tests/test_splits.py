"""CPU tests of the split-KV heuristic and the residency model it relies on."""

from __future__ import annotations

from flash_gen.runtime.fwd import choose_num_splits
from flash_gen.spec import FwdConfig, FwdKey, ctas_per_sm, smem_bytes


def test_residency_follows_shared_memory():
    key = FwdKey("sm90", "bf16", 128, kv="cache")
    assert ctas_per_sm(key, FwdConfig(64, 128, 4, 2)) == 1  # 144 KiB
    assert ctas_per_sm(key, FwdConfig(64, 64, 4, 3)) == 2  # 112 KiB
    small = FwdConfig(64, 32, 4, 1)
    assert ctas_per_sm(key, small) == 228 * 1024 // (smem_bytes(key, small) + 1024)


def test_splits_fill_one_wave_and_keep_two_tiles_each():
    assert choose_num_splits(ctas=264, key_tiles=64, slots=264) == 1  # already a full wave
    assert choose_num_splits(ctas=8, key_tiles=64, slots=132) == 16  # 128 CTAs: one wave, not 136
    assert choose_num_splits(ctas=8, key_tiles=6, slots=132) == 3  # short caches keep two tiles per split
    assert choose_num_splits(ctas=1, key_tiles=10**6, slots=10**4) == 128  # capped
    assert choose_num_splits(ctas=100, key_tiles=1, slots=132) == 1

