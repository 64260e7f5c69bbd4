"""`flash-gen build`: compile the variants the tuning database names, plus the defaults of a common key set (with
the fallback tiling the runtime runs where a default spills) and the head-dim-generic helper kernels, into a
library folder (flash_gen.build.library) on a machine with or without a GPU. Incremental: a variant whose
manifest record has the current source key and an intact cubin is kept. Must not import torch.
"""

from __future__ import annotations

import hashlib
import itertools
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

from flash_gen import bwd_tilings, fwd_tilings, spec, spec_bwd, tuned
from flash_gen.build import cache, nvrtc, spill_free
from flash_gen.build.batches import compile_batch, plan_batches
from flash_gen.build.library import Library, Record
from flash_gen.gen import render

# Keys every library holds (defaults, plus whatever the tuning database names for them): the head dims of the
# ANCHORS shapes and common models, both dtypes, every mask, forward and backward, and some with dropout or packed
# ragged batches; decoding kernels for GQA, and for dense calls with few query tiles pack-GQA and split-KV forms
# (decoding or short chunks via flash_attn_func); over caches read tile by tile, both the decoding steps' tiling and
# the chunks' (fwd_tilings.cache_chunk_runs_hopper).
HEAD_DIMS = (64, 96, 128, 192, 256)
# On sm90 the Hopper kernels serve the vision models' 72 and 80 with 80's forward kernels and 96's backward ones
# (narrow, ALiBi and deterministic dQ too; render.kernel_key), which costs a few forward kernels there; the
# portable kernels specialise every head dim.
HOPPER_HEAD_DIMS = HEAD_DIMS + (72, 80)
DECODE_HEAD_DIMS = (64, 128)
# Training with dropout: the head dims most models train at, unmasked and causal, so a first call does not spend
# minutes compiling a forward and a backward (a key's chain can walk several tilings that spill).
DROPOUT_HEAD_DIMS = (64, 128)
# Packed ragged batches (flash_attn_varlen_func), the way most language models train: the common head dims, every
# mask (sliding windows included), both dtypes, forward and backward. Their kernels are not the dense ones (rows are
# found through cu_seqlens), so without these a first packed call compiles a forward and a backward.
VARLEN_HEAD_DIMS = (64, 128)


def plan(arch: str) -> list[tuple]:
    """(key, config) pairs of the library for `arch`, one per kernel (keys can share one: render.kernel_key), sorted
    by entry name."""
    out: set[tuple] = set()
    head_dims = HOPPER_HEAD_DIMS if arch == "sm90" else HEAD_DIMS
    training = [(dtype, hd, mask, {}) for dtype, hd, mask in itertools.product(spec.DTYPES, head_dims, spec.MASKS)]
    training += [(dtype, hd, mask, {"dropout": True})
                 for dtype, hd, mask in itertools.product(spec.DTYPES, DROPOUT_HEAD_DIMS, ("none", "causal"))]
    training += [(dtype, hd, mask, {"varlen": True})
                 for dtype, hd, mask in itertools.product(spec.DTYPES, VARLEN_HEAD_DIMS, spec.MASKS)]
    for dtype, hd, mask, features in training:
        fwd = spec.FwdKey(arch, dtype, hd, mask, **features)
        bwd = spec_bwd.BwdKey(arch, dtype, hd, mask, **features)
        out |= {(fwd, fwd_tilings.default_config(fwd)), (bwd, bwd_tilings.default_config(bwd))}
    for dtype, hd, mask in itertools.product(spec.DTYPES, DECODE_HEAD_DIMS, ("none", "causal")):
        keys = [spec.FwdKey(arch, dtype, hd, mask, kv=kv, split=split, pack_gqa=True)
                for kv, split in itertools.product(("cache", "paged"), (False, True))]
        keys += [spec.FwdKey(arch, dtype, hd, mask, split=split, pack_gqa=pack)
                 for split, pack in ((False, True), (True, False), (True, True))]
        out.update((key, fwd_tilings.default_config(key)) for key in keys)
        # decoding steps over a cache read tile by tile run the portable kernel where chunks run the Hopper one
        out.update((key, fwd_tilings.portable_config(key)) for key in keys if key.kv == "cache")
    out.update(tuned.live_configs(arch))
    return render.one_per_kernel(sorted(out, key=lambda v: (render.entry_name(*v), v[0].name)))


def helpers(arch: str) -> Iterator[tuple[Callable[[], str], list[str]]]:
    """(source, entry points) of the head-dim-generic kernels: backward pre/post-processing, split-KV combine,
    KV-cache append."""
    for dtype in spec.DTYPES:
        prefix = render.bwd_aux_prefix(arch, dtype)
        yield (lambda d=dtype: render.render_bwd_aux(arch, d)), [f"{prefix}_preprocess", f"{prefix}_convert_dq"]
        yield (lambda d=dtype: render.render_combine(arch, d)), [render.combine_entry(arch, dtype)]
        yield (lambda d=dtype: render.render_append(arch, d)), [render.append_entry(arch, dtype)]


def _launch_shape(key, cfg) -> tuple[int, int]:
    if isinstance(key, spec_bwd.BwdKey):
        return bwd_tilings.smem_bytes(key, cfg), cfg.num_threads
    return fwd_tilings.smem_bytes(key, cfg), cfg.num_threads


def _current(lib: Library, arch: str, entry: str, source_key: str) -> bool:
    rec = lib.records.get((arch, entry))
    if rec is None or rec.source_key != source_key:
        return False
    path = lib.root / rec.cubin
    return path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == rec.sha256


def build(archs: tuple[str, ...], out: Path, jobs: int, progress: Callable[[str], None] = print) -> tuple[int, int]:
    """Build or update the library in `out`; returns (kernels compiled, kernels kept)."""
    lib = Library.open(out) if (out / "manifest.json").exists() else Library(out)
    compiled = kept = 0
    for arch in archs:
        pending = plan(arch)
        progress(f"{arch}: {len(pending)} variants")
        while pending:  # then, in rounds, the fallback tiling of each default that spilled (build.spill_free)
            keys = {render.entry_name(k, c): cache.cache_key(render.render_many([(k, c)]), render.entry_name(k, c),
                                                             arch) for k, c in pending}
            todo = [v for v in pending if not _current(lib, arch, render.entry_name(*v), keys[render.entry_name(*v)])]
            kept += len(pending) - len(todo)
            progress(f"  {len(todo)} to compile, {len(pending) - len(todo)} up to date")
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                for batch in pool.map(compile_batch, plan_batches(todo, jobs)):
                    for c in batch:
                        if c.result is None:
                            raise RuntimeError(f"{c.entry}: {c.error}")
                        smem, threads = _launch_shape(c.key, c.cfg)
                        _add(lib, arch, c.entry, render.kernel_key(c.key, c.cfg).name, c.cfg.name, keys[c.entry],
                             c.result, smem, threads)
                        compiled += 1
                    progress(f"  {batch[0].key.name} ... ({len(batch)} kernels)")
            pending = spill_free.fallbacks(v for v in pending if lib.records[(arch, render.entry_name(*v))].spills)
        for source_fn, entries in helpers(arch):
            source = source_fn()
            skeys = {e: cache.cache_key(source, e, arch) for e in entries}
            if all(_current(lib, arch, e, skeys[e]) for e in entries):
                kept += len(entries)
                continue
            for result in nvrtc.compile_many(source, entries, arch):
                _add(lib, arch, result.entry, "", "", skeys[result.entry], result, 0, 0)
                compiled += 1
        lib.save()  # after each arch: an interrupted build keeps what it finished
    return compiled, kept


def _add(lib: Library, arch: str, entry: str, key: str, config: str, source_key: str, result, smem: int,
         threads: int) -> None:
    sha = hashlib.sha256(result.cubin).hexdigest()
    rec = Record(entry=entry, arch=arch, key=key, config=config, source_key=source_key, cubin=f"{arch}/{sha}.cubin",
                 sha256=sha, registers=result.registers, spills=result.spill_stores + result.spill_loads, smem=smem,
                 threads=threads)
    lib.add(rec, result.cubin)


def pack_wheel(lib_dir: Path, arch: str, out: Path) -> Path:
    """Pack `arch`'s part of the library in `lib_dir` into an installable wheel `flash_gen_kernels_<arch>` (the
    loader finds it once installed). Returns the wheel's path."""
    import shutil
    import subprocess
    import sys

    from flash_gen.version import FLASH_GEN_VERSION

    lib = Library.open(lib_dir)
    package = f"flash_gen_kernels_{arch}"
    stage = out / f".stage_{package}"
    shutil.rmtree(stage, ignore_errors=True)
    pkg_lib = Library(stage / package)
    for (a, _), rec in lib.records.items():
        if a == arch:
            pkg_lib.add(rec, (lib.root / rec.cubin).read_bytes())
    if not pkg_lib.records:
        raise ValueError(f"{lib_dir} holds no {arch} kernels")
    pkg_lib.save()
    (stage / package / "__init__.py").write_text(
        f'"""flash_gen kernel library for {arch}, built by `flash-gen build --wheel`: found by flash_gen\'s '
        'loader when installed."""\n')
    (stage / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "{package.replace("_", "-")}"\nversion = "{FLASH_GEN_VERSION}"\n'
        f'description = "Prebuilt flash_gen attention kernels for {arch}"\nrequires-python = ">=3.10"\n\n'
        f'[tool.setuptools]\npackages = ["{package}"]\n\n'
        f'[tool.setuptools.package-data]\n{package} = ["manifest.json", "{arch}/*.cubin"]\n')
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(stage)], check=True)
    shutil.rmtree(stage, ignore_errors=True)
    return next(out.glob(f"{package}-{FLASH_GEN_VERSION}-*.whl"))
