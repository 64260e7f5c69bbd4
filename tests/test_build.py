"""NVRTC compile + ptxas report, the on-disk cubin cache, settings, errors; one GPU launch test.

CPU-only except the `gpu`-marked test. Real CuTe compiles take a few seconds each, so the cache tests use a
stand-in compiler (or a header-free kernel) wherever the compiler itself is not what is tested.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import multiprocessing
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flash_gen import errors, settings
from flash_gen.build import cache, nvrtc

ENTRY = "fg_test_fill"
# One CuTe kernel for the compile and launch tests: a by-value __grid_constant__ struct, static shared
# memory (1024 B in the ptxas report) and dynamic shared memory (the launch test asks for > 48 KiB).
CUTE_SOURCE = r"""
#include <cute/tensor.hpp>
struct Params { float* out; int n; float value; };
extern "C" __global__ void fg_test_fill(const __grid_constant__ Params p) {
  using namespace cute;
  __shared__ float staged[256];
  extern __shared__ float dynamic[];
  Tensor out = make_tensor(make_gmem_ptr(p.out), make_shape(p.n));
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  staged[threadIdx.x] = p.value + i;
  dynamic[threadIdx.x] = staged[threadIdx.x];
  __syncthreads();
  if (i < p.n) out(i) = dynamic[threadIdx.x];
}
"""
PLAIN_SOURCE = 'extern "C" __global__ void fg_plain(int* out) { out[threadIdx.x] = threadIdx.x; }\n'


class Params(ctypes.Structure):
    _fields_ = [("out", ctypes.c_void_p), ("n", ctypes.c_int), ("value", ctypes.c_float)]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("FLASH_GEN_CACHE_DIR", str(path))
    for name in ("FLASH_GEN_NO_JIT", "FLASH_GEN_DEBUG", "FLASH_GEN_VERBOSE", "FLASH_GEN_LINEINFO"):
        monkeypatch.delenv(name, raising=False)
    return path


def fake_result(entry: str, arch: str) -> nvrtc.CompileResult:
    return nvrtc.CompileResult(entry, arch, b"\x7fELF fake cubin " + entry.encode(), None, "", 8, 0, 0, 0, 0)


# --- compiler -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["sm80", "sm90", "sm100"])
def test_compile_cute_kernel(arch):
    r = nvrtc.compile_source(CUTE_SOURCE, ENTRY, arch)
    assert r.cubin[:4] == b"\x7fELF"
    assert f".target {nvrtc.ARCH_TARGETS[arch]}" in r.ptx and f".entry {ENTRY}" in r.ptx
    assert r.registers > 0 and r.static_smem == 1024
    assert (r.spill_stores, r.spill_loads, r.stack_frame, r.spills) == (0, 0, 0, False)
    assert "Compiling entry function" in r.log


def test_ptxas_report_reads_only_the_entry():
    log = (
        "ptxas info    : Compiling entry function 'other' for 'sm_80'\n"
        "ptxas info    : Function properties for other\n"
        "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 0 barriers, 360 bytes cmem[0]\n"
        "ptxas info    : Compiling entry function 'k' for 'sm_80'\n"
        "ptxas info    : Function properties for helper\n"
        "ptxas         .     16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Function properties for k\n"
        "ptxas         .     24 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem, 360 bytes cmem[0]\n"
    )
    assert nvrtc._parse_ptxas_report(log, "k", "sm80") == {
        "registers": 255, "stack_frame": 24, "spill_stores": 12, "spill_loads": 8, "static_smem": 1024,
        "wgmma_serialized": False,
    }
    with pytest.raises(errors.CompileError, match="extern"):
        nvrtc._parse_ptxas_report(log, "missing", "sm80")
    # ptxas's wgmma serialisation notice names the function; only that entry gets the flag
    notice = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to"
              " non wgmma instructions defining accumulator registers of a wgmma between start and end of the"
              " pipeline stage in the function 'k'\n")
    assert nvrtc._parse_ptxas_report(log + notice, "k", "sm80")["wgmma_serialized"]
    assert not nvrtc._parse_ptxas_report(log + notice, "other", "sm80")["wgmma_serialized"]
    # C7514 (accumulators read, not defined, inside a pipeline stage) serialises them just as well
    reading = notice.replace("C7515", "C7514").replace("defining", "reading")
    assert nvrtc._parse_ptxas_report(log + reading, "k", "sm80")["wgmma_serialized"]
    # in a device function ptxas did not inline (mangled name): charged to the program's entries
    assert nvrtc._parse_ptxas_report(log + notice.replace("'k'", "'_ZZN9flash_gen1fEv'"), "k", "sm80")["wgmma_serialized"]


def test_compile_error_carries_log_and_source(cache_dir):
    source = 'extern "C" __global__ void broken(int* p) { *p = no_such_symbol; }\n'
    with pytest.raises(errors.CompileError) as info:
        nvrtc.compile_source(source, "broken", "sm80")
    e = info.value
    assert e.entry == "broken" and e.arch == "sm80"
    assert "no_such_symbol" in e.log and "no_such_symbol" in str(e)
    assert e.source_path and e.source_path.startswith(str(cache_dir / "failed"))
    assert open(e.source_path).read() == source
    again = pickle.loads(pickle.dumps(e))  # tuning workers raise it across processes
    assert (again.entry, again.log, again.source_path, str(again)) == (e.entry, e.log, e.source_path, str(e))


def test_nvjitlink_older_than_nvrtc_is_named_and_a_newer_one_warned(monkeypatch, caplog, cache_dir):
    """nvJitLink cannot link a newer NVRTC's IR; a newer nvJitLink links it, but its ptxas may schedule otherwise."""
    nvrtc._linker_mismatch.cache_clear()
    major, minor = nvrtc.nvrtc_version()
    monkeypatch.setattr(nvrtc, "nvjitlink_version", lambda: (major, minor - 1) if minor else (major - 1, 9))
    with pytest.raises(errors.CompileError, match="nvidia-nvjitlink=="):
        nvrtc.compile_source(PLAIN_SOURCE, "fg_plain", "sm80")
    nvrtc._linker_mismatch.cache_clear()
    monkeypatch.setattr(nvrtc, "nvjitlink_version", lambda: (major, minor + 5))
    with caplog.at_level(logging.WARNING, logger="flash_gen"):
        assert nvrtc._linker_mismatch() is None
    assert "SASS may differ" in caplog.text
    nvrtc._linker_mismatch.cache_clear()


def test_unknown_arch_and_include_dirs():
    with pytest.raises(ValueError, match="sm70"):
        nvrtc.compile_options_fingerprint("sm70", ())
    dirs = nvrtc.include_dirs()
    assert dirs[-1].endswith("templates/include") and dirs[-2].endswith("cccl")
    assert nvrtc.nvrtc_version() >= (13, 0)


# --- cache ----------------------------------------------------------------------------------------------


def test_second_get_or_compile_is_a_hit(monkeypatch, cache_dir):
    calls = []
    real = nvrtc.compile_source
    monkeypatch.setattr(nvrtc, "compile_source", lambda *a: calls.append(a) or real(*a))
    cubin, meta = cache.get_or_compile(PLAIN_SOURCE, "fg_plain", "sm80")
    again, meta2 = cache.get_or_compile(PLAIN_SOURCE, "fg_plain", "sm80")
    assert len(calls) == 1 and again == cubin and meta2 == meta
    assert meta["cubin_sha256"] == hashlib.sha256(cubin).hexdigest() and meta["registers"] > 0
    sha = meta["cubin_sha256"]
    assert meta["cubin_file"] == f"sm80/{sha[:2]}/{sha}.cubin"
    assert (cache_dir / meta["cubin_file"]).read_bytes() == cubin
    assert cache.lookup(PLAIN_SOURCE, "fg_plain", "sm80") == (cubin, meta)
    assert cache.info()["entries"] == {"sm80": 1, "sm90": 0, "sm100": 0}
    cache.clear()
    assert cache.lookup(PLAIN_SOURCE, "fg_plain", "sm80") is None


def test_key_covers_source_options_and_debug(monkeypatch):
    base = cache.cache_key("a", "k", "sm80")
    assert base != cache.cache_key("b", "k", "sm80")
    assert base != cache.cache_key("a", "k", "sm90")
    assert base != cache.cache_key("a", "k", "sm80", ("-DX=1",))
    monkeypatch.setenv("FLASH_GEN_DEBUG", "1")
    assert base != cache.cache_key("a", "k", "sm80")


def test_compile_is_logged_once_with_its_reason(monkeypatch, caplog):
    monkeypatch.setattr(nvrtc, "compile_source", lambda *a: fake_result(a[1], a[2]))
    monkeypatch.setenv("FLASH_GEN_VERBOSE", "1")
    with caplog.at_level(logging.INFO, logger="flash_gen"):
        cache.get_or_compile("src", "logged_kernel", "sm80")
        cache.get_or_compile("src", "logged_kernel", "sm80")
    lines = [r.getMessage() for r in caplog.records if r.name == "flash_gen"]
    assert len(lines) == 1 and "logged_kernel" in lines[0] and "cache miss" in lines[0]


def test_corrupt_entry_is_reported_and_rebuilt(monkeypatch):
    calls = []
    monkeypatch.setattr(nvrtc, "compile_source", lambda *a: calls.append(a) or fake_result(a[1], a[2]))
    cubin, meta = cache.get_or_compile("src", "k", "sm90")
    path = settings.cache_dir() / meta["cubin_file"]
    path.write_bytes(cubin[:5])  # truncated
    with pytest.warns(RuntimeWarning, match="corrupt cache entry"):
        again, meta = cache.get_or_compile("src", "k", "sm90")
    assert len(calls) == 2 and again == cubin and path.read_bytes() == cubin
    assert meta["cubin_sha256"] == hashlib.sha256(cubin).hexdigest()


def test_kernels_stored_together_share_one_cubin_file(monkeypatch):
    """store_many writes a batch's cubin once, named by its sha256, and every entry points at it; a damaged
    shared file is caught (sha256) for every entry that uses it. Compiling one of those kernels again in another
    batch leaves the first batch's file alone (it once overwrote it, breaking the other entries)."""
    shared = b"\x7fELF one cubin, two kernels"
    results = [nvrtc.CompileResult(e, "sm90", shared, None, "", 8, 0, 0, 0, 0) for e in ("a", "b")]
    metas = cache.store_many([("src a", results[0]), ("src b", results[1])], "sm90", (), 1.0)
    assert metas[0]["cubin_file"] == metas[1]["cubin_file"] == f"sm90/{metas[0]['cubin_sha256'][:2]}/" \
                                                              f"{metas[0]['cubin_sha256']}.cubin"
    assert [p.name for p in settings.cache_dir().rglob("*.cubin")] == [Path(metas[1]["cubin_file"]).name]
    assert cache.lookup("src b", "b", "sm90") == (shared, metas[1])
    other = b"\x7fELF a and c compiled together"
    results = [nvrtc.CompileResult(e, "sm90", other, None, "", 8, 0, 0, 0, 0) for e in ("a", "c")]
    cache.store_many([("src a", results[0]), ("src c", results[1])], "sm90", (), 1.0)
    assert cache.lookup("src a", "a", "sm90")[0] == other and cache.lookup("src b", "b", "sm90") == (shared, metas[1])
    (settings.cache_dir() / metas[1]["cubin_file"]).write_bytes(b"garbage")
    with pytest.warns(RuntimeWarning, match="corrupt cache entry"):
        assert cache.lookup("src b", "b", "sm90") is None


def _concurrent_writer(out_path: str, count_path: str, start) -> None:
    def slow_compile(source, entry, arch, options=()):
        with open(count_path, "a") as f:
            f.write("compiled\n")
        time.sleep(0.5)
        return fake_result(entry, arch)

    nvrtc.compile_source = slow_compile  # this child process's own copy of the module
    start.wait()  # all four ask at the same moment, so they really contend for the lock
    cubin, _ = cache.get_or_compile("same source", "k", "sm80")
    with open(out_path, "w") as f:
        f.write(hashlib.sha256(cubin).hexdigest())


def test_concurrent_writers_end_with_one_entry(tmp_path):
    # forkserver, not fork (which would copy other threads' locks, e.g. CUDA's) nor spawn (which re-imports
    # torch in every child): children fork from one server that has imported the cache module once.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["flash_gen.build.cache"])
    count, start = tmp_path / "count", ctx.Barrier(4)
    procs = [
        ctx.Process(target=_concurrent_writer, args=(str(tmp_path / f"out{i}"), str(count), start))
        for i in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    digests = {(tmp_path / f"out{i}").read_text() for i in range(4)}
    assert digests == {hashlib.sha256(fake_result("k", "sm80").cubin).hexdigest()}
    assert count.read_text().count("compiled") == 1  # the lock's second look saw the first writer's entry
    assert cache.lookup("same source", "k", "sm80") is not None
    assert list((settings.cache_dir() / "sm80").rglob("*.tmp")) == []


def test_no_jit_miss_raises(monkeypatch):
    monkeypatch.setattr(nvrtc, "compile_source", lambda *a: pytest.fail("compiled under FLASH_GEN_NO_JIT"))
    monkeypatch.setenv("FLASH_GEN_NO_JIT", "1")
    with pytest.raises(errors.KernelNotAvailable, match="my_variant") as info:
        cache.get_or_compile("src", "my_variant", "sm80")
    assert "my_variant" in info.value.variant


def test_no_jit_hit_is_served(monkeypatch):
    monkeypatch.setattr(nvrtc, "compile_source", lambda *a: fake_result(a[1], a[2]))
    cubin, _ = cache.get_or_compile("src", "k", "sm100")
    monkeypatch.setenv("FLASH_GEN_NO_JIT", "true")
    assert cache.get_or_compile("src", "k", "sm100")[0] == cubin


# --- settings, errors, imports --------------------------------------------------------------------------


def test_settings_read_the_environment_lazily(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASH_GEN_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert settings.cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("FLASH_GEN_CACHE_DIR")
    assert settings.cache_dir().parts[-2:] == (".cache", "flash_gen")
    for raw, value in (("1", True), ("on", True), ("0", False), ("", False)):
        monkeypatch.setenv("FLASH_GEN_VERBOSE", raw)
        assert settings.verbose() is value
    monkeypatch.setenv("FLASH_GEN_DEBUG", "maybe")
    with pytest.raises(ValueError, match="FLASH_GEN_DEBUG"):
        settings.debug()
    monkeypatch.delenv("FLASH_GEN_SECTION_PAIRS", raising=False)
    assert settings.section_pairs() is None
    monkeypatch.setenv("FLASH_GEN_SECTION_PAIRS", "model")
    assert settings.section_pairs() is None
    monkeypatch.setenv("FLASH_GEN_SECTION_PAIRS", "0")
    assert settings.section_pairs() == 0
    monkeypatch.setenv("FLASH_GEN_SECTION_PAIRS", "3")
    assert settings.section_pairs() == 3
    monkeypatch.setenv("FLASH_GEN_SECTION_PAIRS", "-1")
    with pytest.raises(ValueError, match="FLASH_GEN_SECTION_PAIRS"):
        settings.section_pairs()


def test_errors_pickle():
    for e in (
        errors.InfeasibleConfig("too much smem"),
        errors.KernelNotAvailable("fwd_x", "/cache"),
        errors.CudaError("cuLaunchKernel", 1, "CUDA_ERROR_INVALID_VALUE"),
    ):
        again = pickle.loads(pickle.dumps(e))
        assert type(again) is type(e) and str(again) == str(e)


def test_loader_import_skips_optuna_and_cuda_init():
    code = (
        "import sys\n"
        "sys.modules['optuna'] = None\n"  # importing optuna now raises ImportError
        "import flash_gen.runtime.loader\n"
        "from cuda.bindings import driver\n"
        "try:\n"
        "    print(driver.cuCtxGetCurrent()[0].name)\n"  # NOT_INITIALIZED unless something called cuInit
        "except Exception:\n"
        "    print('no driver')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() in ("no driver", "CUDA_ERROR_NOT_INITIALIZED"), result.stdout


# --- driver + loader (GPU) ------------------------------------------------------------------------------


@pytest.mark.parametrize("base", [0, 8])
def test_c_launcher_packs_like_python(base):
    """The C launcher's parameter copy (what cuLaunchKernel receives) equals driver.pack_params', and both reject
    patches outside the struct."""
    from flash_gen.runtime import driver

    assert driver._c_launch is not None, "the C launcher (setup.py's extension) is not built"

    class Wide(ctypes.Structure):
        _fields_ = [("a", ctypes.c_uint8 * 8), ("p", Params), ("tail", ctypes.c_int32)]

    template = Wide((ctypes.c_uint8 * 8)(*range(1, 9)), Params(0x1234, 77, 2.5), -3)
    patches = (0, 0xFFFF_FFFF_FFFF_FFF0, 8, 2**63 + 5) if base == 0 else (Params.out.offset, 0xDEAD_BEEF_0000)
    expected = bytes(driver.pack_params(template, patches, base))
    assert driver._c_launch.pack(template, patches, base) == expected
    assert expected != bytes(template) and bytes(Wide.from_buffer_copy(template)) == bytes(template)
    outside = (ctypes.sizeof(Wide) - base - 4, 1)
    with pytest.raises(ValueError, match="outside"):
        driver._c_launch.pack(template, outside, base)
    with pytest.raises(ValueError, match="outside"):
        driver.pack_params(template, outside, base)
    with pytest.raises(TypeError, match="patches"):
        driver._c_launch.pack(template, (0,), base)


@pytest.mark.gpu
def test_launch_struct_kernel_on_torch_stream(monkeypatch):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from flash_gen.runtime import driver, loader

    device = torch.cuda.current_device()
    arch = driver.device_arch(device)
    smem = 64 * 1024  # above the 48 KiB default: load_kernel must opt the kernel in
    cubin, _ = cache.get_or_compile(CUTE_SOURCE, ENTRY, arch)
    kernel = driver.load_kernel(cubin, ENTRY, smem, device)
    # With a driver present, a repeat compile must still run ptxas (no NVRTC/driver-side cache hit).
    assert nvrtc.compile_source(CUTE_SOURCE, ENTRY, arch).registers > 0

    n = 1000
    stream = torch.cuda.current_stream().cuda_stream
    grid = ((n + 255) // 256, 1, 1)
    out = torch.zeros(n, device="cuda", dtype=torch.float32)
    params = Params(out.data_ptr(), n, 0.5)
    kernel.launch(grid, (256, 1, 1), smem, stream, params)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.arange(n, device="cuda", dtype=torch.float32) + 0.5)
    # A template without the address, patched at launch, through the C launcher and through ctypes.
    assert driver._c_launch is not None, "the C launcher (setup.py's extension) is not built"
    template = Params(0, n, 1.5)
    for c_launch in (driver._c_launch, None):
        monkeypatch.setattr(driver, "_c_launch", c_launch)
        out = torch.zeros(n, device="cuda", dtype=torch.float32)
        kernel.launch(grid, (256, 1, 1), smem, stream, template, (Params.out.offset, out.data_ptr()))
        torch.cuda.synchronize()
        assert torch.equal(out, torch.arange(n, device="cuda", dtype=torch.float32) + 1.5)
    assert template.out is None  # launches copy the template

    with pytest.raises(errors.CudaError, match="cuLaunchKernel"):
        kernel.launch((1, 1, 1), (4096, 1, 1), 0, torch.cuda.current_stream().cuda_stream, params)

    renders = []

    def source_fn() -> str:
        renders.append(1)
        return CUTE_SOURCE

    first = loader.get_kernel(source_fn, ENTRY, arch, smem, device)
    assert loader.get_kernel(source_fn, ENTRY, arch, smem, device) is first and len(renders) == 1


def test_cache_key_follows_included_headers_only(tmp_path, monkeypatch):
    """A key covers the flash_gen headers its source includes, transitively, and no others."""
    (tmp_path / "flash_gen").mkdir()
    (tmp_path / "flash_gen" / "a.cuh").write_text('#include "flash_gen/b.cuh"\n')
    (tmp_path / "flash_gen" / "b.cuh").write_text("// b v1\n")
    (tmp_path / "flash_gen" / "c.cuh").write_text("// c v1\n")
    monkeypatch.setattr(nvrtc, "TEMPLATE_INCLUDE_DIR", tmp_path)
    source = '#include "flash_gen/a.cuh"\nextern "C" __global__ void k() {}\n'
    key = cache.cache_key(source, "k", "sm90")
    (tmp_path / "flash_gen" / "c.cuh").write_text("// c v2\n")
    assert cache.cache_key(source, "k", "sm90") == key
    (tmp_path / "flash_gen" / "b.cuh").write_text("// b v2\n")
    assert cache.cache_key(source, "k", "sm90") != key
