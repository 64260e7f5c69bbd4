"""The prebuilt kernel library: the variants the tuning database names (and the defaults of a common key set)
compiled ahead of time into a folder with a manifest, so calls on common shapes never wait for NVRTC.

Layout: `<dir>/manifest.json` (per arch: entry point -> key, config, launch shape, the cache key of the source
that built it, registers and spill bytes, cubin file and its sha256) and `<dir>/<arch>/<sha256>.cubin` (kernels compiled
together share one cubin file). A manifest entry is used only when its cache key equals the one the runtime
computes for the kernel it wants (same source, headers, options, NVRTC and flash_gen version), so a library built
by another version is ignored (with a warning) and the kernel comes from the cache or JIT instead. Writes are
atomic (temporary file + rename); reads check the sha256. Must not import torch.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from flash_gen import settings
from flash_gen.build import cache, nvrtc
from flash_gen.version import FLASH_GEN_VERSION

FORMAT = 2  # 2: records carry their spill bytes
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Record:
    """One kernel of the library."""

    entry: str
    arch: str
    key: str  # kernel key name
    config: str  # tiling name ("" for the head-dim-generic helper kernels)
    source_key: str  # build.cache.cache_key of the kernel's source
    cubin: str  # path relative to the library folder
    sha256: str
    registers: int
    spills: int  # spill stores + loads, bytes (the runtime skips a spilling default: flash_gen.build.spill_free)
    smem: int  # dynamic shared memory the launch asks for
    threads: int


class Library:
    """A library folder's manifest, read once."""

    def __init__(self, root: Path, records: dict[tuple[str, str], Record] | None = None) -> None:
        self.root = root
        self.records = records or {}  # (arch, entry) -> Record
        self._warned = False

    @classmethod
    def open(cls, root: Path) -> "Library":
        path = root / MANIFEST
        if not path.exists():
            return cls(root)
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT:
            raise ValueError(f"{path}: not a format-{FORMAT} flash_gen kernel library")
        recs = {(r["arch"], r["entry"]): Record(**r) for r in raw["kernels"]}
        return cls(root, recs)

    def save(self) -> Path:
        body = {"format": FORMAT, "flash_gen": FLASH_GEN_VERSION, "nvrtc": "%d.%d" % nvrtc.nvrtc_version(),
                "kernels": [vars(r) for _, r in sorted(self.records.items())]}
        path = self.root / MANIFEST
        self.root.mkdir(parents=True, exist_ok=True)
        cache._atomic_write(path, (json.dumps(body, indent=1, sort_keys=True) + "\n").encode())
        return path

    def cubin(self, arch: str, entry: str, source_key: str) -> tuple[bytes, int] | None:
        """(cubin, spill bytes) of this kernel if the library holds the same build of it, else None."""
        rec = self.records.get((arch, entry))
        if rec is None:
            return None
        if rec.source_key != source_key:
            if not self._warned:  # a library of another flash_gen, NVRTC or header version: fall back, once loud
                self._warned = True
                warnings.warn(f"flash_gen: the kernel library {self.root} was built from other sources than this "
                              f"flash_gen uses (first seen for {entry}); using the cache / JIT instead",
                              RuntimeWarning, stacklevel=3)
            return None
        try:
            data = (self.root / rec.cubin).read_bytes()
        except OSError:
            return None
        if hashlib.sha256(data).hexdigest() != rec.sha256:
            warnings.warn(f"flash_gen: corrupt library cubin {self.root / rec.cubin}; using the cache / JIT instead",
                          RuntimeWarning, stacklevel=3)
            return None
        return data, rec.spills

    def add(self, record: Record, cubin: bytes) -> None:
        path = self.root / record.cubin  # named by its sha256: shared by the kernels compiled together
        if not path.exists() or hashlib.sha256(path.read_bytes()).hexdigest() != record.sha256:
            path.parent.mkdir(parents=True, exist_ok=True)
            cache._atomic_write(path, cubin)
        self.records[(record.arch, record.entry)] = record


@functools.lru_cache(maxsize=None)
def installed(arch: str) -> tuple[Library, ...]:
    """The libraries the loader consults for `arch`, in order: FLASH_GEN_LIBRARY, then an installed
    `flash_gen_kernels_<arch>` wheel (`flash-gen build --wheel`)."""
    roots = []
    env = settings.library_dir()
    if env is not None:
        roots.append(env)
    spec = importlib.util.find_spec(f"flash_gen_kernels_{arch}")
    if spec is not None and spec.submodule_search_locations:
        roots.append(Path(next(iter(spec.submodule_search_locations))))
    libs = []
    for root in roots:
        if (root / MANIFEST).exists():
            try:
                libs.append(Library.open(root))
            except ValueError as e:  # another flash_gen's library: the cache / JIT serve instead
                warnings.warn(f"flash_gen: {e}; ignoring it", RuntimeWarning, stacklevel=2)
    return tuple(libs)


def find(source: str, entry: str, arch: str, options: tuple[str, ...] = ()) -> tuple[bytes, int] | None:
    """(cubin, spill bytes) of this kernel from an installed library, or None (the caller goes to the cache /
    JIT)."""
    libs = installed(arch)
    if not libs:
        return None
    key = cache.cache_key(source, entry, arch, options)
    for lib in libs:
        hit = lib.cubin(arch, entry, key)
        if hit is not None:
            return hit
    return None


def obtain(source: str, entry: str, arch: str, options: tuple[str, ...] = ()) -> tuple[bytes, int]:
    """(cubin, spill bytes) of this kernel: from an installed library, else the cache, else compiled by NVRTC."""
    hit = find(source, entry, arch, options)
    if hit is None:
        cubin, meta = cache.get_or_compile(source, entry, arch, options)
        hit = cubin, meta["spill_stores"] + meta["spill_loads"]
    return hit
