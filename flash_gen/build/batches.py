"""Compiling many variants at once: group them into translation units (variants of one direction, arch and head
dim share most of CuTe's template instantiations), compile each unit once in a worker process and store every
kernel in the cache under its own single-variant key. Used by `flash-gen compile`, `flash-gen build`, the tuner's
callers and scripts/prebuild_gpu_test_kernels.py. Must not import torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

from flash_gen import spec, spec_bwd, spec_sm90
from flash_gen.gen.render import entry_name, kernel_key, one_per_kernel, render_many


@dataclass
class Compiled:
    """One variant's compile outcome, sent back from a worker process."""

    key: spec.FwdKey | spec_bwd.BwdKey
    cfg: spec.FwdConfig | spec_sm90.Sm90FwdConfig | spec_bwd.BwdConfig
    entry: str
    source: str | None  # None when rendering failed
    result: Any | None  # flash_gen.build.nvrtc.CompileResult; None on failure
    seconds: float
    error: str | None

    @property
    def ok(self) -> bool:
        return self.result is not None and not self.result.spills and not self.result.wgmma_serialized


def compile_batch(variants: Sequence[tuple]) -> list[Compiled]:
    """Render `variants` ((key, config) pairs of one kernel family) into one translation unit, compile it once, and
    store each kernel in the kernel cache under its own key (so the runtime finds it). Failures are returned, not
    raised, so one broken batch never hides the report of the others."""
    from flash_gen.build import cache
    from flash_gen.build.nvrtc import compile_many

    entries = [entry_name(key, cfg) for key, cfg in variants]
    arch = variants[0][0].arch
    start = time.perf_counter()
    try:
        sources = [render_many([(key, cfg)]) for key, cfg in variants]
        start = time.perf_counter()
        results = compile_many(render_many(variants), entries, arch)
        seconds = time.perf_counter() - start
        cache.store_many(list(zip(sources, results)), arch, (), seconds)
    except Exception as e:  # reported in the table and below it
        error = f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - start
        return [Compiled(k, c, name, None, None, seconds, error) for (k, c), name in zip(variants, entries)]
    return [
        Compiled(key, cfg, name, source, result, seconds, None)
        for (key, cfg), name, source, result in zip(variants, entries, sources, results)
    ]


def plan_batches(variants: list[tuple], jobs: int) -> list[list]:
    """Group variants of one kernel family, arch and head dim into translation units (they share most of CuTe's template
    instantiations: 24 kernels compile in about 2.5x the time of one), splitting groups until every worker has
    one, and capping a group at 24 kernels."""
    groups: dict[tuple, list] = {}
    for key, cfg in one_per_kernel(variants):  # keys sharing a kernel (render.kernel_key) compile it once
        groups.setdefault((type(key), type(cfg), key.arch, kernel_key(key, cfg).head_dim), []).append((key, cfg))
    batches = [g[i : i + 24] for g in groups.values() for i in range(0, len(g), 24)]
    while len(batches) < jobs and any(len(b) > 1 for b in batches):
        largest = max(batches, key=len)
        batches.remove(largest)
        batches += [largest[: len(largest) // 2], largest[len(largest) // 2 :]]
    return batches
