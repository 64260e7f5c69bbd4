"""CPU tests of the split-KV heuristic and the residency model it relies on, and of the aligned-rows shift
bits the Hopper forward's parameters carry."""

from __future__ import annotations

import torch

from flash_gen.runtime.fwd import _row_shift_bits, choose_num_splits
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



def test_row_shift_bits_follow_the_heads_sector_offsets():
    """Bit 0: head 0's rows start 16 bytes into a 32-byte sector; bit 1: each head moves that by 16 more; 0 where
    the sequence stride is not whole sectors (rows would then differ)."""
    flat = torch.empty(2 * 5 * 4 * 72 + 8, dtype=torch.bfloat16)
    base = -flat.data_ptr() % 32 // 2  # elements to a sector boundary
    t = flat[base:base + 2 * 5 * 4 * 72].view(2, 5, 4, 72)  # 144-byte head rows, 576-byte positions
    assert _row_shift_bits(t) == 2
    assert _row_shift_bits(flat[base + 8:base + 8 + 2 * 5 * 4 * 72].view(2, 5, 4, 72)) == 3
    assert _row_shift_bits(flat[base:base + 2 * 5 * 4 * 64].view(2, 5, 4, 64)) == 0  # 128-byte rows
    assert _row_shift_bits(flat[base:base + 2 * 5 * 3 * 72].view(2, 5, 3, 72)) == 0  # 432-byte positions
    assert _row_shift_bits(flat[base:base + 5 * 3 * 72].view(1, 5, 3, 72)[:, :1]) == 2  # one position
