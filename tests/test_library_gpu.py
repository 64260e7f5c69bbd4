"""GPU test of the kernel library (issue 6): a forward call served from a prebuilt library, from the on-disk cache
and from a JIT compile gives bitwise identical results, and a cold call with an empty cache on a key the library
holds launches without compiling.

Each serving path runs in a fresh process, so the loader's in-process kernel memo and the library lookup start
empty; there NVRTC (flash_gen.build.nvrtc.compile_many, which every compile goes through) records what it compiles,
or fails the run when it must not compile. The library holds one kernel, so the test compiles twice (library build,
JIT run). The CPU side of the library (planning, manifest, incremental builds, fallbacks) is in test_library.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flash_gen.build import make_library
from flash_gen.gen.render import entry_name
from flash_gen.spec import FwdKey, bucket_name

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parent.parent
SEQLEN, HDIM = 200, 64  # seqlen not a multiple of the tile: the masked last tile runs too

# argv: mode ("jit": compiles allowed and recorded; "no-compile": any compile fails the run), output path, seqlen,
# head dim.
_WORKER = """
import sys

import torch

from flash_gen import flash_attn_func
from flash_gen.build import nvrtc

mode, path, seqlen, hdim = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
compiled = []
real_compile = nvrtc.compile_many


def compile_many(source, entries, *args, **kwargs):
    if mode != "jit":
        raise AssertionError(f"NVRTC compile of {list(entries)}: the library or the cache should have served it")
    compiled.extend(entries)
    return real_compile(source, entries, *args, **kwargs)


nvrtc.compile_many = compile_many
gen = torch.Generator(device="cuda").manual_seed(20261130)
q, k, v = (torch.randn(2, seqlen, 4, hdim, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
out = flash_attn_func(q, k, v)
torch.save({"q": q.cpu(), "k": k.cpu(), "v": v.cpu(), "out": out.cpu(), "compiled": compiled}, path)
"""


def _serve(mode: str, cache: Path, out: Path, library: Path | None = None) -> dict:
    """One forward call in a fresh process with this cache (and library); returns what the worker saved."""
    env = {k: v for k, v in os.environ.items() if k != "FLASH_GEN_LIBRARY"}
    env["FLASH_GEN_CACHE_DIR"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
    if library is not None:
        env["FLASH_GEN_LIBRARY"] = str(library)
    run = subprocess.run([sys.executable, "-c", _WORKER, mode, str(out), str(SEQLEN), str(HDIM)], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, f"{mode} run failed:\n{run.stderr}"
    return torch.load(out)


def test_library_cache_and_jit_serve_identical_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The build here and the runs in the workers must render the same sources with the same options.
    for name in ("FLASH_GEN_FWD_CONFIG", "FLASH_GEN_DEBUG", "FLASH_GEN_LINEINFO", "FLASH_GEN_NO_JIT"):
        monkeypatch.delenv(name, raising=False)
    from flash_gen.runtime import driver, fwd

    key = FwdKey(driver.device_arch(torch.cuda.current_device()), "bf16", HDIM, "none")
    cfg = fwd._config(key, bucket_name("fwd", SEQLEN))  # the tiling the call asks for (tuned or default)
    monkeypatch.setenv("FLASH_GEN_CACHE_DIR", str(tmp_path / "build_cache"))  # the build fills a cache of its own
    monkeypatch.setattr(make_library, "plan", lambda arch: [(key, cfg)])
    monkeypatch.setattr(make_library, "helpers", lambda arch: [])
    library = tmp_path / "library"
    assert make_library.build((key.arch,), library, jobs=1, progress=lambda _: None) == (1, 0)
    empty, jit_cache = tmp_path / "empty_cache", tmp_path / "jit_cache"
    empty.mkdir()

    from_library = _serve("no-compile", empty, tmp_path / "library.pt", library)
    assert not any(empty.iterdir())  # the library served it: the cache was not even written
    from_jit = _serve("jit", jit_cache, tmp_path / "jit.pt")
    assert from_jit["compiled"] == [entry_name(key, cfg)]
    from_cache = _serve("no-compile", jit_cache, tmp_path / "cache.pt")

    for served in (from_library, from_cache):
        for name in ("q", "k", "v", "out"):
            assert torch.equal(served[name], from_jit[name]), name
    q, k, v = (from_jit[name].float().transpose(1, 2) for name in ("q", "k", "v"))
    ref = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    torch.testing.assert_close(from_jit["out"].float(), ref, atol=2e-2, rtol=2e-2)  # and it is attention
