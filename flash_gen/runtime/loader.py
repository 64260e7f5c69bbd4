"""Kernel loading with an in-process memo: (entry, arch, device, options) -> loaded driver.Kernel.

The first request for a kernel renders its source, takes the cubin from a prebuilt library (flash_gen.build.library)
or else the on-disk cache (compiling on a miss) and loads it on the device; every later request is one dict
lookup, with no rendering or hashing.

Must not import optuna (nor anything under flash_gen.search): this is on the launch path.
"""

from __future__ import annotations

from typing import Callable

from flash_gen import tuned
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
        cfg = _spill_free[key, start] = spill_free.choose(key, lambda c: _spill_bytes(key, c), start)
    return cfg


def tuned_config(key: spill_free.Key, bucket: str) -> spill_free.Tiling | None:
    """The tuning database's tiling for `key` in `bucket`: the key's own entry (the tuner rejected spilling
    candidates), else the first tiling derived from another head dim's entry (flash_gen.tuned.derived_configs)
    that compiles for `key` without spills; None where there is none."""
    own = tuned.shipped(key.arch).live_config(key, bucket)
    if own is not None:
        return own
    return next((cfg for cfg in tuned.derived_configs(key, bucket) if _spill_bytes(key, cfg) == 0), None)


def _spill_bytes(key: spill_free.Key, cfg: spill_free.Tiling) -> int:
    """Spill bytes of `cfg`'s kernel for `key`, compiling it (library, cache, NVRTC) where need be."""
    return library.obtain(render_many([(key, cfg)]), entry_name(key, cfg), key.arch)[1]
