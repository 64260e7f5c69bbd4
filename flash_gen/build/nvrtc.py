"""NVRTC + nvJitLink: CUDA C++ source -> cubin (and PTX on demand) for one arch, and ptxas's resource report for the
entry kernels.

NVRTC compiles the source to LTO IR (-dlto) and nvJitLink links it for the real arch, keeping only the entry kernels
and the device variables they use. With -default-device (which CUTLASS's host-less headers need under NVRTC) every
constexpr variable CuTe instantiates is a device variable, and a whole-program NVRTC compile keeps all of them: a
one-kernel cubin was 993 KB, over 90% of it the symbol and string tables and relocations of 4,333 unused variables,
where the link gives 49 KB with the same SASS (2026-12-05, docs/benchmarks.md "Compile time").

Owns the compiler flags, the include path (CuTe/CUTLASS, CUDA and CCCL headers from their pip wheels, plus
flash_gen's own templates/include) and the fingerprint of both that the cubin cache keys on. Caching is
not done here (see build/cache.py).

NVRTC serialises compiles inside one process (four threads took as long as four compiles in a row), so
compile in parallel with processes, not threads.

Must not import torch or anything under flash_gen.runtime.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from cuda.bindings import nvjitlink, nvrtc

from flash_gen import errors, settings
from flash_gen.build import sass

ARCH_TARGETS = {"sm80": "sm_80", "sm90": "sm_90a", "sm100": "sm_100a"}
# What NVRTC compiles to for each: the virtual arch of the LTO IR that nvJitLink then links for ARCH_TARGETS.
_VIRTUAL_TARGETS = {arch: target.replace("sm_", "compute_") for arch, target in ARCH_TARGETS.items()}

TEMPLATE_INCLUDE_DIR = Path(__file__).resolve().parent.parent / "templates" / "include"

# Wheels whose headers the kernels include; their versions stand in for hashing thousands of header files.
_HEADER_DISTRIBUTIONS = ("nvidia-cutlass", "nvidia-cuda-cccl", "nvidia-cuda-runtime")

# Precompiled headers (-pch --pch-dir=...) are deliberately off. Measured with NVRTC 13.0 (3 compiles in one
# process, sm_90a, idle 16-core H200 host): a trivial <cute/tensor.hpp> kernel took 2.7/2.1/2.1 s without
# and 3.8/0.5/0.4 s with PCH, but a GEMM-sized CuTe kernel (TiledMMA + cp.async; template instantiation, not
# header parsing, dominates its front end) took 10.7/10.8/10.0 s without and 13.1/11.0/10.2 s with: no win
# for real kernels, and the first compile of every process pays for creating the PCH. It is also fragile:
# the default PCH heap (256 MiB) is too small for CuTe, so without nvrtcSetPCHHeapSize every compile
# silently pays the creation cost; a PCH is only valid in the process that made it (NVRTC deletes its
# ~270 MB files at exit, so a dir under the cache dir would not persist, and a crashed process leaks them);
# and processes sharing one --pch-dir overwrite each other's files.


@functools.lru_cache(maxsize=None)
def _include_dirs() -> tuple[str, ...]:
    cccl = _wheel_dir("nvidia.cu13", "include/cccl", "cuda/std/type_traits", "nvidia-cuda-cccl")
    dirs = (
        _wheel_dir("cutlass_library", "source/include", "cute/tensor.hpp", "nvidia-cutlass"),
        _wheel_dir("nvidia.cu13", "include", "cuda_runtime.h", "nvidia-cuda-runtime"),
        # CUTLASS for CUDA 13 includes <cccl/cuda/std/...> while CCCL itself includes <cuda/std/...>, so both
        # the cccl dir and its parent are needed; the parent is the CUDA header dir unless the two wheels
        # were installed to different site-packages.
        str(Path(cccl).parent),
        cccl,
        str(TEMPLATE_INCLUDE_DIR),
    )
    return tuple(dict.fromkeys(dirs))  # drop the duplicate parent, keep the order


def include_dirs() -> list[str]:
    """The -I directories: CuTe/CUTLASS, CUDA headers, CCCL (and its parent), then flash_gen/templates/include."""
    return list(_include_dirs())


def _wheel_dir(package: str, subdir: str, marker: str, distribution: str) -> str:
    """`subdir` of an installed (possibly namespace) package, the first location holding `marker`."""
    spec = importlib.util.find_spec(package)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / subdir
        if (candidate / marker).is_file():
            return str(candidate)
    raise FileNotFoundError(f"cannot find {subdir}/{marker} in package {package}; pip install {distribution}")


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    major, minor = _call(nvrtc.nvrtcVersion(), "nvrtcVersion", "", "")
    return major, minor


@functools.lru_cache(maxsize=None)
def _header_versions() -> tuple[str, ...]:
    versions = []
    for dist in _HEADER_DISTRIBUTIONS:
        try:
            versions.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{dist}==unknown")
    return tuple(versions)


def _base_options(arch: str) -> list[str]:
    """NVRTC's flags (to LTO IR; nvJitLink's are _link_options)."""
    if arch not in ARCH_TARGETS:
        raise ValueError(f"arch must be one of {tuple(ARCH_TARGETS)}, got {arch!r}")
    # --no-cache: when a driver is installed, NVRTC >= 12.9 serves repeat compiles from the driver's compute
    # cache (~/.nv/ComputeCache); build/cache.py already keeps every cubin.
    opts = [f"-arch={_VIRTUAL_TARGETS[arch]}", "-dlto", "-std=c++17", "-default-device", "--no-cache"]
    if settings.lineinfo():
        opts.append("-lineinfo")
    if not settings.debug():
        opts.append("-DNDEBUG")
    return opts


def _link_options(arch: str, entries: Sequence[str], ptx: bool) -> list[str]:
    """nvJitLink's flags: link-time optimisation for the real arch, keeping `entries` and the device variables they
    use; the ptxas report (-v) for the cubin, or PTX instead of a cubin."""
    opts = [f"-arch={ARCH_TARGETS[arch]}", "-lto", "-optimize-unused-variables",
            *(f"-kernels-used={e}" for e in entries)]
    opts += ["-ptx"] if ptx else ["-Xptxas=-v"]
    if settings.lineinfo():
        opts.append("-lineinfo")
    return opts


@functools.lru_cache(maxsize=None)
def nvjitlink_version() -> tuple[int, int]:
    return nvjitlink.version()


def compile_options_fingerprint(arch: str, options: tuple[str, ...] = ()) -> str:
    """Everything besides the source and NVRTC's version that decides the compiler's output: flags (FLASH_GEN_DEBUG
    included), extra options, nvJitLink's version (its ptxas makes the SASS) and the versions of the header wheels.
    Include-dir locations are left out on purpose so the cache is valid wherever the wheels are installed."""
    return " ".join([*_base_options(arch), *_link_options(arch, (), False), *options,
                     "nvJitLink %d.%d" % nvjitlink_version(), *_header_versions()])


@dataclass(frozen=True, eq=False)
class LinkUnit:
    """A translation unit's LTO IR and entry kernels, shared by their CompileResults; its PTX is linked on first
    use (a second link: the build needs only the cubin)."""

    arch: str
    entries: tuple[str, ...]
    ltoir: bytes = field(repr=False)

    @functools.cached_property
    def ptx(self) -> str:
        return _link(self.ltoir, self.entries, self.arch, ptx=True)[0].decode()


@dataclass(frozen=True)
class CompileResult:
    entry: str
    arch: str
    cubin: bytes = field(repr=False)
    unit: LinkUnit | None = field(repr=False)  # None for results not compiled here (tests)
    log: str = field(repr=False)
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    static_smem: int
    # ptxas C7515: wgmmas serialised (each waits for the previous), which costs a Hopper kernel ~20% (2026-11-30:
    # accumulator registers written by ordinary instructions while a wgmma was in flight). Also set from the SASS
    # where cuobjdump is installed (build/sass.py): ptxas does not always say so.
    wgmma_serialized: bool = False

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    @property
    def ptx(self) -> str:
        """The PTX of the unit's entries after link-time optimisation."""
        return self.unit.ptx if self.unit is not None else ""


def compile_source(source: str, entry: str, arch: str, options: tuple[str, ...] = ()) -> CompileResult:
    """Compile `source` for `arch` ("sm80" | "sm90" | "sm100"). `entry` is the kernel's symbol name, so the
    kernel must be extern "C". Raises errors.CompileError (with the log and the saved source) on failure."""
    return compile_many(source, (entry,), arch, options)[0]


def compile_many(source: str, entries: Sequence[str], arch: str, options: tuple[str, ...] = ()) -> list[CompileResult]:
    """Compile a translation unit holding several extern "C" kernels once; one CompileResult per entry, all
    sharing the cubin, PTX and log, each with its own ptxas resources.

    NVRTC compiles the unit to LTO IR once; one nvJitLink link of it gives the cubin of all entries and ptxas's
    report (`ptx` links it again, once per unit, only when read)."""
    name = entries[0]
    opts = [*_base_options(arch), *(f"-I{d}" for d in _include_dirs()), *options]
    prog = _call(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []),
                 "nvrtcCreateProgram", name, arch)
    try:
        (compiled,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        log = _program_log(prog, name, arch)
        if compiled:
            path = _save_failed_source(source, name, arch, opts, log)
            raise errors.CompileError(name, arch, log, path)
        ltoir = _get_bytes(prog, nvrtc.nvrtcGetLTOIRSize, nvrtc.nvrtcGetLTOIR, name, arch)
    finally:
        _call(nvrtc.nvrtcDestroyProgram(prog), "nvrtcDestroyProgram", name, arch)
    try:
        cubin, link_log = _link(ltoir, entries, arch, ptx=False)
    except errors.CompileError as e:  # ptxas's errors (shared memory, registers) come from the link
        raise errors.CompileError(name, arch, e.log, _save_failed_source(source, name, arch, opts, e.log)) from e
    log = "\n".join(part for part in (log, link_log) if part)
    reports = [_parse_ptxas_report(log, e, arch) for e in entries]
    listings = sass.functions(cubin) if arch == "sm90" else None  # HGMMA is sm_90a's
    for e, report in zip(entries, reports):
        if listings is not None and e in listings:  # what ptxas serialised without its notice
            report["wgmma_serialized"] |= sass.serialised(*sass.hgmma_batches(listings[e]))
    unit = LinkUnit(arch, tuple(entries), ltoir)
    return [CompileResult(e, arch, cubin, unit, log, **r) for e, r in zip(entries, reports)]


@functools.lru_cache(maxsize=None)
def _linker_mismatch() -> str | None:
    """Why this nvJitLink cannot link NVRTC's IR (an older one), or None; a newer minor version is warned about once:
    its ptxas schedules otherwise (13.5's serialised the wgmmas of a Hopper backward tiling that 13.0's does not)."""
    link, rtc = nvjitlink_version(), nvrtc_version()
    pin = f"pip install 'nvidia-nvjitlink=={rtc[0]}.{rtc[1]}.*'"
    if link[0] != rtc[0] or link < rtc:
        return f"nvJitLink {link[0]}.{link[1]} cannot link the IR of NVRTC {rtc[0]}.{rtc[1]}: {pin}"
    if link != rtc:
        settings.logger().warning("nvJitLink %d.%d links NVRTC %d.%d's kernels: their SASS may differ from the "
                                  "measured ones (%s)", *link, *rtc, pin)
    return None


def _link(ltoir: bytes, entries: Sequence[str], arch: str, ptx: bool) -> tuple[bytes, str]:
    """nvJitLink: the LTO IR of a unit -> (cubin or PTX holding `entries`, the info log with ptxas's report)."""
    name = entries[0]
    mismatch = _linker_mismatch()
    if mismatch:
        raise errors.CompileError(name, arch, mismatch, None)
    # -no-cache: with a driver installed nvJitLink serves repeat links from its compute cache, skipping ptxas and so
    # its report. It does not change the output, so the cache key (compile_options_fingerprint) leaves it out.
    opts = [*_link_options(arch, entries, ptx), "-no-cache"]
    try:
        handle = nvjitlink.create(len(opts), opts)
    except nvjitlink.nvJitLinkError as e:
        raise errors.CompileError(name, arch, f"nvJitLinkCreate failed: {e} (options: {' '.join(opts)})", None) from e
    try:
        try:
            nvjitlink.add_data(handle, nvjitlink.InputType.LTOIR, ltoir, len(ltoir), f"{name}.ltoir")
            nvjitlink.complete(handle)
        except nvjitlink.nvJitLinkError as e:
            raise errors.CompileError(name, arch, f"nvJitLink failed: {e}\n{_link_log(handle, error=True)}",
                                      None) from e
        size, get = ((nvjitlink.get_linked_ptx_size, nvjitlink.get_linked_ptx) if ptx else
                     (nvjitlink.get_linked_cubin_size, nvjitlink.get_linked_cubin))
        out = bytearray(size(handle))
        get(handle, out)
        return bytes(out).rstrip(b"\0") if ptx else bytes(out), _link_log(handle, error=False)
    finally:
        nvjitlink.destroy(handle)


def _link_log(handle, error: bool) -> str:
    size, get = ((nvjitlink.get_error_log_size, nvjitlink.get_error_log) if error else
                 (nvjitlink.get_info_log_size, nvjitlink.get_info_log))
    buf = bytearray(size(handle))
    get(handle, buf)
    return bytes(buf).rstrip(b"\0").decode(errors="replace")


def _call(result: tuple, name: str, entry: str, arch: str):
    """Unpack an nvrtc binding's (status, *values) tuple; a failed status becomes a CompileError."""
    status, *values = result
    if status:
        message = nvrtc.nvrtcGetErrorString(status)[1].decode()
        raise errors.CompileError(entry, arch, f"{name} failed: {message}", None)
    return values[0] if len(values) == 1 else tuple(values)


def _program_log(prog, entry: str, arch: str) -> str:
    return _get_bytes(prog, nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog, entry, arch).rstrip(
        b"\0").decode(errors="replace")


def _get_bytes(prog, size_fn, get_fn, entry: str, arch: str) -> bytes:
    size = _call(size_fn(prog), size_fn.__name__, entry, arch)
    buf = bytearray(size)  # the binding fills it in place
    _call(get_fn(prog, buf), get_fn.__name__, entry, arch)
    return bytes(buf)


def _save_failed_source(source: str, entry: str, arch: str, opts: list[str], log: str) -> str | None:
    """Write the source (and options + log beside it) to <cache>/failed/ so the failure can be reproduced."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    path = settings.cache_dir() / "failed" / f"{entry}_{arch}_{digest}.cu"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
        path.with_suffix(".log").write_text("options: " + " ".join(opts) + "\n\n" + log)
    except OSError:
        return None  # an unwritable cache dir must not hide the compile error itself
    return str(path)


_STACK = r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"


def _parse_ptxas_report(log: str, entry: str, arch: str) -> dict[str, int | bool]:
    """Resources of `entry` from the --ptxas-options=-v report, e.g.
        ptxas info    : Compiling entry function 'k' for 'sm_80'
        ptxas info    : Function properties for k
        ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 6 registers, used 0 barriers, 1024 bytes smem, 360 bytes cmem[0]
    Only the section of `entry` is read: other kernels and non-inlined device functions have their own."""
    head = f"Compiling entry function '{entry}'"
    section = log.split(head, 1)[1].split("Compiling entry function", 1)[0] if head in log else ""
    stack = re.search(rf"Function properties for {re.escape(entry)}\s*\n[^\n]*?{_STACK}", section)
    used = re.search(r"Used (\d+) registers([^\n]*)", section)
    if not (stack and used):
        raise errors.CompileError(
            entry, arch, log + f"\n[flash_gen] no ptxas report for entry {entry!r}: is the kernel extern \"C\"?", None
        )
    smem = re.search(r"(\d+) bytes smem", used.group(2))
    # C7514/C7515/C7520 and kin: ptxas gave up overlapping the kernel's wgmmas (each waits for the one before). The
    # notice names the function: the entry, or a mangled device function (a lambda ptxas did not inline), which
    # counts against every entry of the program.
    serialized = any("wgmma.mma_async instructions are serialized" in line
                     and re.search(rf"function '({re.escape(entry)}|_Z[^']*)'", line) for line in log.splitlines())
    return {
        "registers": int(used.group(1)),
        "stack_frame": int(stack.group(1)),
        "spill_stores": int(stack.group(2)),
        "spill_loads": int(stack.group(3)),
        "static_smem": int(smem.group(1)) if smem else 0,
        "wgmma_serialized": serialized,
    }
