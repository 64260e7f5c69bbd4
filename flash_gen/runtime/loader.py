"""Kernel loading with an in-process memo: (entry, arch, device, options) -> loaded driver.Kernel.

The first request for a kernel renders its source, takes the cubin from a prebuilt library (flash_gen.build.library)
or else the on-disk cache (compiling on a miss) and loads it on the device; every later request is one dict
lookup, with no rendering or hashing.

Must not import optuna (nor anything under flash_gen.search): this is on the launch path.
"""

from __future__ import annotations

from typing import Callable

from flash_gen.build import library, spill_free
from flash_gen.gen.render import entry_name, render_many
from flash_gen.runtime import driver

_kernels: dict[tuple, driver.Kernel] = {}


def get_kernel(
    source_fn: Callable[[], str],
    entry: str,
    arch: str,
    smem_bytes: int,
    device: int,
    options: tuple[str, ...] = (),
) -> driver.Kernel:
    """The kernel `entry` loaded on `device`. `source_fn` renders its source and is only called on the first
    request. `entry` must name the variant completely (its dynamic shared memory included): it is the memo
    key together with arch, device and options."""
    memo_key = (entry, arch, device, options)
    kernel = _kernels.get(memo_key)
    if kernel is None:
        source = source_fn()
        cubin, _ = library.obtain(source, entry, arch, options)  # prebuilt first, then the cache, then NVRTC
        kernel = _kernels[memo_key] = driver.load_kernel(cubin, entry, smem_bytes, device)
    return kernel


_spill_free: dict[tuple, spill_free.Tiling] = {}  # (kernel key, start) -> its chosen tiling


def spill_free_config(key: spill_free.Key, start: spill_free.Tiling | None = None) -> spill_free.Tiling:
    """The first tiling of `key`'s default chain (from `start` on, default its head) that compiles without spills
    (flash_gen.build.spill_free), found through the library, the cache or NVRTC once per key and process."""
    cfg = _spill_free.get((key, start))
    if cfg is None:
        cfg = _spill_free[key, start] = spill_free.choose(
            key, lambda c: library.obtain(render_many([(key, c)]), entry_name(key, c), key.arch)[1], start)
    return cfg
