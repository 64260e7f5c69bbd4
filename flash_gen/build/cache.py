"""The content-addressed on-disk cubin cache: compile a kernel once per (source, compiler, flags) and reuse
it across processes.

An entry is `<cache_dir>/<arch>/<key[:2]>/<key>.json` (metadata) naming its cubin, stored once by content as
`<cache_dir>/<arch>/<sha[:2]>/<sha>.cubin` (sha: the cubin's sha256), so the kernels compiled together share one
file and writing a cubin never replaces bytes another entry reads. (Until 2026-12-04 a batch's cubin lay at its
first entry's `<key>.cubin`, which a later compile of that entry in another batch overwrote, leaving the rest of
the first batch corrupt; entries without a `cubin_file` still read `<key>.cubin`.) Files are written to a temp
file and renamed, the cubin before the json, so a reader sees either no entry or a whole one; writers of one key
serialise on `<key>.lock` (flock) and look again once they hold it, so N processes asking for the same kernel
compile it once. A cubin whose hash does not match its json is reported once and rebuilt.

Must not import torch or anything under flash_gen.runtime.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Iterator, Sequence

from flash_gen import errors, settings
from flash_gen.build import nvrtc
from flash_gen.version import FLASH_GEN_VERSION

_reported: set[Path] = set()  # corrupt entries already warned about in this process


def cache_key(source: str, entry: str, arch: str, options: tuple[str, ...] = ()) -> str:
    """sha256 over everything that decides the cubin: flash_gen and NVRTC versions, arch, flags, entry, the
    source and the flash_gen headers it #includes (directly or through each other)."""
    h = hashlib.sha256()
    parts = (
        FLASH_GEN_VERSION,
        "%d.%d" % nvrtc.nvrtc_version(),
        arch,
        nvrtc.compile_options_fingerprint(arch, tuple(options)),
        entry,
        _headers_digest(source),
        source,
    )
    for part in parts:
        data = part.encode()
        h.update(len(data).to_bytes(8, "little") + data)  # length-prefixed: no two part lists collide
    return h.hexdigest()


_INCLUDE = re.compile(r'^\s*#\s*include\s+"(flash_gen/[^"]+)"', re.MULTILINE)


def _headers_digest(source: str) -> str:
    """Digest of flash_gen's own headers that `source` includes, followed transitively, so editing the backward
    kernel's header does not invalidate forward cubins. Not memoised: headers edited during a session must change
    the key. (Headers from the CUTLASS/CUDA wheels are covered by their versions in the options fingerprint.)"""
    root = nvrtc.TEMPLATE_INCLUDE_DIR
    seen: set[str] = set()
    todo = _INCLUDE.findall(source)
    h = hashlib.sha256()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        text = (root / name).read_bytes()
        todo += _INCLUDE.findall(text.decode())
    for name in sorted(seen):
        h.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    return h.hexdigest()


class _Entry:
    def __init__(self, arch: str, key: str) -> None:
        folder = settings.cache_dir() / arch / key[:2]
        self.folder = folder
        self.cubin = folder / f"{key}.cubin"
        self.meta = folder / f"{key}.json"
        self.lock = folder / f"{key}.lock"

    def read(self) -> tuple[tuple[bytes, dict] | None, str | None]:
        """(hit, None), or (None, None) on a plain miss, or (None, why) when the entry is corrupt."""
        try:
            meta = json.loads(self.meta.read_text())
        except FileNotFoundError:
            return None, None  # also the case between a writer's cubin rename and json rename
        except (OSError, ValueError) as e:
            return None, f"unreadable metadata ({e})"
        if not isinstance(meta, dict):
            return None, "metadata is not an object"
        # Kernels compiled together share one cubin file, named relative to the cache root.
        path = settings.cache_dir() / meta["cubin_file"] if "cubin_file" in meta else self.cubin
        try:
            cubin = path.read_bytes()
        except OSError as e:
            return None, f"unreadable cubin ({e})"
        if hashlib.sha256(cubin).hexdigest() != meta.get("cubin_sha256"):
            return None, "cubin does not match the sha256 in its metadata"
        return (cubin, meta), None


def lookup(source: str, entry: str, arch: str, options: tuple[str, ...] = ()) -> tuple[bytes, dict] | None:
    """The cached (cubin, metadata) for this kernel, or None. Never compiles."""
    ent = _Entry(arch, cache_key(source, entry, arch, options))
    hit, problem = ent.read()
    if problem:
        _report(ent.meta, problem)
    return hit


def get_or_compile(source: str, entry: str, arch: str, options: tuple[str, ...] = ()) -> tuple[bytes, dict]:
    """(cubin, metadata) for this kernel, compiling and storing it on a miss. Raises
    errors.KernelNotAvailable on a miss under FLASH_GEN_NO_JIT and errors.CompileError if NVRTC fails."""
    options = tuple(options)
    key = cache_key(source, entry, arch, options)
    ent = _Entry(arch, key)
    hit, problem = ent.read()
    if hit:
        return hit
    if problem:
        _report(ent.meta, problem)
    if settings.no_jit():
        raise errors.KernelNotAvailable(f"{entry} for {arch} (cache key {key[:16]})", str(settings.cache_dir()))
    ent.folder.mkdir(parents=True, exist_ok=True)
    with _locked(ent.lock):
        hit, _ = ent.read()  # another process may have built it while we waited for the lock
        if hit:
            return hit
        why = f"corrupt entry: {problem}" if problem else "cache miss"
        settings.logger().info("compiling %s for %s (%s, key %s)", entry, arch, why, key[:16])
        start = time.perf_counter()
        result = nvrtc.compile_source(source, entry, arch, options)
        meta = _write(ent, result, options, time.perf_counter() - start)
    return result.cubin, meta


def store(source: str, arch: str, options: tuple[str, ...], result: nvrtc.CompileResult, seconds: float) -> dict:
    """Put a kernel compiled elsewhere (e.g. by `flash-gen compile`) into the cache; returns its metadata."""
    return store_many([(source, result)], arch, options, seconds)[0]


def store_many(
    compiled: Sequence[tuple[str, nvrtc.CompileResult]], arch: str, options: tuple[str, ...], seconds: float
) -> list[dict]:
    """Store kernels compiled together (nvrtc.compile_many: one cubin holding every entry), each under the key
    of its own single-variant `source`, so the runtime's lookups find them. The shared cubin is written once,
    under its sha256, and every entry names that file in its metadata (no copies, no links: the cache folder
    can be copied or packed as it is)."""
    options = tuple(options)
    metas: list[dict] = []
    for source, result in compiled:
        ent = _Entry(arch, cache_key(source, result.entry, arch, options))
        ent.folder.mkdir(parents=True, exist_ok=True)
        with _locked(ent.lock):
            metas.append(_write(ent, result, options, seconds))
    return metas


def _write(ent: "_Entry", result: nvrtc.CompileResult, options: tuple[str, ...], seconds: float) -> dict:
    """Write the cubin (under its sha256, unless a kernel compiled with it already did) then the metadata (the
    json last: readers treat its absence as a miss). Caller holds the entry's lock."""
    sha = hashlib.sha256(result.cubin).hexdigest()
    cubin = ent.folder.parent / sha[:2] / f"{sha}.cubin"
    if not _holds(cubin, result.cubin):  # same name, same bytes: a concurrent writer's rename is as good as ours
        cubin.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(cubin, result.cubin)
    meta = {
        "entry": result.entry,
        "arch": result.arch,
        "key": ent.cubin.stem,
        "registers": result.registers,
        "spills": result.spills,
        "spill_stores": result.spill_stores,
        "spill_loads": result.spill_loads,
        "stack_frame": result.stack_frame,
        "static_smem": result.static_smem,
        "wgmma_serialized": result.wgmma_serialized,
        "nvrtc_version": "%d.%d" % nvrtc.nvrtc_version(),
        "options": nvrtc.compile_options_fingerprint(result.arch, options),
        "cubin_sha256": sha,
        "cubin_file": cubin.relative_to(settings.cache_dir()).as_posix(),
        "compile_seconds": round(seconds, 3),
        "created": time.time(),
    }
    _atomic_write(ent.meta, json.dumps(meta, indent=1).encode())
    return meta


def clear() -> None:
    """Delete every cached cubin and the saved sources of failed compiles. Not safe to run while another
    process is writing to the same cache."""
    root = settings.cache_dir()
    for sub in (*nvrtc.ARCH_TARGETS, "failed"):
        shutil.rmtree(root / sub, ignore_errors=True)


def info() -> dict:
    """{"dir": cache dir, "entries": {arch: count}, "bytes": {arch: bytes on disk}}."""
    root = settings.cache_dir()
    entries, sizes = {}, {}
    for arch in nvrtc.ARCH_TARGETS:
        files = [p for p in (root / arch).glob("*/*") if p.is_file()]
        entries[arch] = sum(p.suffix == ".json" for p in files)
        sizes[arch] = sum(p.stat().st_size for p in files)
    return {"dir": str(root), "entries": entries, "bytes": sizes}


def _report(path: Path, problem: str) -> None:
    if path not in _reported:
        _reported.add(path)
        warnings.warn(f"flash_gen: corrupt cache entry {path}: {problem}; recompiling", RuntimeWarning, stacklevel=3)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _holds(path: Path, data: bytes) -> bool:
    """Whether `path` exists with exactly `data` (a damaged content-named cubin is rewritten, not trusted)."""
    try:
        return path.read_bytes() == data
    except OSError:
        return False


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
