"""CPU tests of how KV-cache calls are planned (flash_gen.runtime.fwd_kvcache.attention_fwd_kvcache): an int length shares
the plan of its length class and reaches the kernel as a patched seqlen_k. No GPU: the driver is replaced by a
kernel that records what each launch would pass (CUDA itself is never touched)."""

from __future__ import annotations

import pytest
import torch

from flash_gen.fwd_tilings import config_from_name
from flash_gen.memo import BoundedMemo
from flash_gen.runtime import driver
from flash_gen.runtime import fwd, fwd_kvcache

CAPACITY, HEADS, HEADS_K, HEAD_DIM = 700, 8, 2, 128
TILING = config_from_name("m64n64w4s2")  # the portable kernel's cache tiling, forced: no spill check compiles it


class _Recorder:
    """Stands in for loader.get_kernel: each attention kernel's launch recorded as (grid, FwdParams as passed)."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple[int, int, int], fwd.FwdParams]] = []

    def __call__(self, source_fn, entry: str, *args, **kwargs) -> _Kernel:
        return _Kernel(None if "combine" in entry else self.launches)


class _Kernel:
    def __init__(self, launches: list | None) -> None:
        self.record = launches

    def launch(self, grid, block, smem, stream, params, patches=(), patch_base=0) -> None:
        if self.record is not None:
            packed = driver.pack_params(params, patches, patch_base)
            self.record.append((grid, fwd.FwdParams.from_buffer_copy(packed, patch_base)))


@pytest.fixture
def kernel(monkeypatch) -> _Recorder:
    recorder = _Recorder()
    monkeypatch.setattr(fwd.loader, "get_kernel", recorder)
    monkeypatch.setattr(driver, "device_arch", lambda device: "sm90")
    monkeypatch.setattr(driver, "sm_count", lambda device: 132)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    monkeypatch.setattr(fwd_kvcache, "_cache_routes", BoundedMemo(256))
    monkeypatch.setattr(fwd, "_variants", {})
    return recorder


def _call(length: int, num_splits: int, window_size: tuple[int, int] = (-1, -1), causal: bool = True) -> None:
    q = torch.randn(1, 1, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    k_cache = torch.randn(1, CAPACITY, HEADS_K, HEAD_DIM, dtype=torch.bfloat16)
    cache = fwd_kvcache.KvCache(seqused_k=None, used=length, leftpad_k=None, batch_idx=None, block_table=None,
                                num_splits=num_splits)
    fwd_kvcache.attention_fwd_kvcache(q, k_cache, k_cache, cache, softmax_scale=HEAD_DIM**-0.5, causal=causal,
                                      window_size=window_size, softcap=0.0, alibi_slopes=None, config=TILING)


def _plans() -> list[fwd.FwdPlan]:
    return [plan for route in fwd_kvcache._cache_routes.values() for plan in route.plans.values()]


def test_int_lengths_of_one_class_share_a_plan_with_their_own_seqlen_k(kernel):
    for length in (300, 301, 555, 2 * CAPACITY):
        _call(length, num_splits=3)
    assert len(_plans()) == 1  # one bucket, one split count: planned once
    assert [p.seqlen_k for _, p in kernel.launches] == [300, 301, 555, CAPACITY]  # clamped to the capacity
    assert {p.num_splits for _, p in kernel.launches} == {3}
    # The template holds the capacity: the unbounded left side lies past every key of any length.
    assert {p.window_left for _, p in kernel.launches} == {1 + CAPACITY}


def test_a_bounded_window_side_survives_the_length_patch(kernel):
    for length in (200, 450):
        _call(length, num_splits=1, window_size=(32, 0), causal=False)
    assert [(p.seqlen_k, p.window_left, p.window_right) for _, p in kernel.launches] == [(200, 32, 0), (450, 32, 0)]


def test_the_split_heuristic_plans_each_split_count_once(kernel):
    lengths = (64, 65, 200, 640, 700)  # 1, 1, 2, 5 and 5 splits
    for length in lengths:
        _call(length, num_splits=0)
    # choose_num_splits over 2 KV heads' CTAs (packed GQA) and 64-key tiles: half the key tiles, at least 1.
    expected = [max(1, -(-n // TILING.block_n) // 2) for n in lengths]
    assert [grid[2] for grid, _ in kernel.launches] == expected  # batch x splits along z
    assert len(_plans()) == len(set(expected))
    assert [p.seqlen_k for _, p in kernel.launches] == list(lengths)
