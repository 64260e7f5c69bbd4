"""CPU checks of the real kernels: every forward key renders, and a representative matrix of forward and
backward kernels compiles with NVRTC for sm_80, sm_90a and sm_100a without register spills. No GPU needed.

Compiling one variant takes about a minute on a 2-core machine (CuTe's templates dominate), so the matrix is
chosen to cover every code path at least once (each mask kind, softcap, ALiBi, packed ragged batches, a paged
KV cache with split-KV and pack-GQA, fp16 and bf16, a padded head dim, one and two K/V stages, 4 and 8 warps) and is compiled once, two at a time, for all tests here.
"""

from __future__ import annotations

import re
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

import pytest

from flash_gen import cli
from flash_gen.gen.render import entry_name, render_fwd
from flash_gen.spec import FwdConfig, FwdKey, default_config, enumerate_configs, enumerate_keys, smem_bytes
from flash_gen.build import spill_free
from flash_gen.spec_bwd import BwdKey
from flash_gen.spec_bwd_sm90 import Sm90BwdConfig

MATRIX = (
    FwdKey("sm80", "bf16", 128, "causal"),
    FwdKey("sm80", "fp16", 96, "causal", kv="paged", split=True, pack_gqa=True),  # decoding: paged, split, packed
    FwdKey("sm90", "fp16", 72, "local", softcap=True, alibi=True),
    FwdKey("sm90", "bf16", 64, "none"),
    FwdKey("sm100", "bf16", 256, "none"),
    FwdKey("sm100", "fp16", 160, "causal", alibi=True, varlen=True),
    # backward: every arch, both dQ orders, every feature, a padded head dim, the three tiling families
    BwdKey("sm80", "bf16", 128, "causal"),
    BwdKey("sm80", "bf16", 64, "none"),  # its default (128 x 128) spills on sm80: the runtime falls back
    BwdKey("sm90", "fp16", 72, "local", softcap=True, alibi=True, varlen=True, deterministic=True),
    BwdKey("sm90", "bf16", 128, "local", alibi=True, varlen=True),  # the Hopper backward at its register limit
    BwdKey("sm100", "bf16", 256, "none"),
)


def test_every_key_renders_with_its_default_config():
    for key in enumerate_keys():
        cfg = default_config(key)
        source = render_fwd(key, cfg)
        assert f"{entry_name(key, cfg)}(const __grid_constant__" in source
        assert "{{" not in source and "}}" not in source


def test_every_feasible_config_renders():
    key = FwdKey("sm90", "bf16", 128, "local", softcap=True)
    configs = list(enumerate_configs(key))
    assert len(configs) > 10
    for cfg in configs:
        assert f"Traits0::kSmemBytes == {smem_bytes(key, cfg)}" in render_fwd(key, cfg)


def test_render_rejects_infeasible_config():
    with pytest.raises(ValueError, match="shared memory"):
        render_fwd(FwdKey("sm80", "bf16", 256, "none"), FwdConfig(128, 128, 8, 2))


def _first(key):
    """The portable forward's default (the Hopper one has tests/test_spec_sm90.py), the head of a backward chain."""
    return spill_free.chain(key)[0] if isinstance(key, BwdKey) else default_config(key)


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    """Every compile of the MATRIX keys' default chains the way the runtime walks them (each default that spills
    followed by its fallback, flash_gen.build.spill_free), through the CLI's worker (which also fills the kernel
    cache), two processes at a time."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASH_GEN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        with ProcessPoolExecutor(max_workers=2) as pool:
            yield spill_free.compile_resolved([(k, _first(k)) for k in MATRIX], 2, pool)


@pytest.fixture(scope="module")
def compiled(resolved):
    """MATRIX key -> the compile the runtime runs (the last of its chain's)."""
    return {c.key: c for c in resolved}


@pytest.mark.parametrize("key", MATRIX, ids=lambda k: k.name)
def test_representative_kernel_compiles_without_spills(compiled, key: FwdKey | BwdKey):
    c = compiled[key]
    assert c.error is None, c.error
    r = c.result
    assert r.cubin[:4] == b"\x7fELF"
    # nvJitLink kept only what the kernels use: none of CuTe's constexpr variables (4,333 of them in a Hopper
    # forward's cubin through NVRTC alone, 20x its size)
    assert b"integral_constant" not in r.cubin and b"rank_v" not in r.cubin
    assert f".entry {c.entry}" in r.ptx
    assert 0 < r.registers <= 255
    assert (r.spill_stores, r.spill_loads, r.stack_frame) == (0, 0, 0), f"{c.entry} spills on {key.arch}"
    # The MMAs are the tensor-core path, not a scalar fallback.
    if isinstance(c.cfg, Sm90BwdConfig):
        assert "wgmma.mma_async.sync.aligned" in r.ptx
        return
    assert re.search(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(bf16|f16)", r.ptx)
    assert "cp.async.cg.shared.global" in r.ptx and "ldmatrix.sync.aligned" in r.ptx


def test_a_spilling_default_is_replaced_by_its_fallback(resolved):
    """sm80 backward at head dim 64: 128 x 128 holds S, dP, dK and dV (192 fp32 registers per thread) and spills
    (NVRTC 13.0); the runtime runs the next tiling of the chain, which does not."""
    key = BwdKey("sm80", "bf16", 64, "none")
    tried = [c for c in resolved if c.key == key]
    assert [c.cfg for c in tried] == list(spill_free.chain(key)[: len(tried)])
    assert len(tried) >= 2 and tried[0].result.spills and not tried[-1].result.spills


def test_batched_compile_matches_single_compiles(compiled, tmp_path, monkeypatch):
    """Several variants in one translation unit: each entry gets its own ptxas report, the same registers as
    when compiled alone, and a cache entry the runtime's single-variant lookup finds."""
    from flash_gen.build import cache

    monkeypatch.setenv("FLASH_GEN_CACHE_DIR", str(tmp_path))
    alone = FwdKey("sm90", "bf16", 64, "none")
    batch = [(alone, default_config(alone)), (FwdKey("sm90", "bf16", 64, "causal"), default_config(alone))]
    results = cli.compile_batch(batch)
    assert [c.error for c in results] == [None, None]
    assert results[0].result.registers == compiled[alone].result.registers
    assert results[0].result.cubin == results[1].result.cubin  # one cubin, both entries
    for key, cfg in batch:
        hit = cache.lookup(render_fwd(key, cfg), entry_name(key, cfg), "sm90")
        assert hit is not None and hit[0] == results[0].result.cubin


def test_batches_group_by_arch_and_head_dim():
    variants = [(k, default_config(k)) for k in enumerate_keys(("sm80", "sm90"), ("bf16",), (64, 128), ("none", "causal"))]
    for jobs in (1, 2, 16):
        batches = cli.plan_batches(variants, jobs)
        assert Counter(v for b in batches for v in b) == Counter(variants)
        assert all(len({(k.arch, k.head_dim) for k, _ in b}) == 1 for b in batches)
        assert len(batches) >= min(jobs, len(variants)) and max(map(len, batches)) <= 24


def test_cli_compile_writes_report_and_files(compiled, tmp_path, monkeypatch, capsys):
    """`flash-gen compile --out` prints the ptxas table and writes .cu/.ptx/.cubin (reusing the matrix's
    compile instead of compiling again)."""
    key = FwdKey("sm80", "bf16", 128, "causal")  # a portable-kernel default, so the matrix holds it
    done = compiled[key].result
    monkeypatch.setattr("flash_gen.build.nvrtc.compile_many", lambda *a, **k: [done])
    rc = cli.main(["compile", "--arch", "sm80", "--hdim", "128", "--dtype", "bf16", "--mask", "causal",
                   "--out", str(tmp_path), "-j", "1"])
    assert rc == 0
    entry = entry_name(key, default_config(key))
    out = capsys.readouterr().out
    assert key.name in out and str(done.registers) in out
    for suffix in (".cu", ".ptx", ".cubin"):
        assert (tmp_path / f"{entry}{suffix}").stat().st_size > 0


@pytest.mark.parametrize("module,struct,header", [("fwd", "FwdParams", "fwd_params.cuh"),
                                                   ("bwd", "BwdParams", "bwd_params.cuh"),
                                                   ("kvcache", "AppendParams", "kv_append.cuh"),
                                                   ("fwd", "Sm90FwdParams", "fwd_sm90_params.cuh"),
                                                   ("bwd", "Sm90BwdParams", "bwd_sm90_params.cuh")])
def test_params_struct_layout_matches_kernel(module: str, struct: str, header: str):
    """Each ctypes mirror in flash_gen.runtime and its C++ struct agree on every field offset and the size. NVRTC
    has no constant offsetof, so one probe kernel per field reads its first byte, and the PTX names the offset of
    that parameter load."""
    import ctypes
    import importlib

    from flash_gen.build.nvrtc import compile_many

    params = getattr(importlib.import_module(f"flash_gen.runtime.{module}"), struct)
    names = [name for name, _ in params._fields_ if not name.startswith("_")]  # "_pad": the C++ tail padding
    source = f'#include "flash_gen/{header}"\n' + "".join(
        f'extern "C" __global__ void fg_probe_{n}(const __grid_constant__ flash_gen::{struct} p, '
        f"unsigned char* out) {{ *out = *reinterpret_cast<const unsigned char*>(&p.{n}); }}\n"
        for n in names
    )
    ptx = compile_many(source, [f"fg_probe_{n}" for n in names], "sm80")[0].ptx
    size = re.search(rf"\.b8 fg_probe_{names[0]}_param_0\[(\d+)\]", ptx)
    assert size and int(size[1]) == ctypes.sizeof(params)
    for n in names:
        load = re.search(rf"ld\.param\.\w+\s+[^,]+, \[fg_probe_{n}_param_0(?:\+(\d+))?\]", ptx)
        assert load, f"no parameter load found for {n}"
        assert int(load[1] or 0) == getattr(params, n).offset, f"{n}: C++ offset {load[1]} != ctypes"


@pytest.mark.parametrize("kernel", ["combine", "append"])
@pytest.mark.parametrize("arch,dtype", [("sm80", "fp16"), ("sm90", "bf16"), ("sm100", "bf16")])
def test_kv_cache_helper_kernels_compile(kernel: str, arch: str, dtype: str):
    """The head-dim-generic split-KV combine and KV-cache append + rotary: no CuTe, so seconds to compile."""
    from flash_gen.build.nvrtc import compile_many
    from flash_gen.gen import render

    source = getattr(render, f"render_{kernel}")(arch, dtype)
    (result,) = compile_many(source, [getattr(render, f"{kernel}_entry")(arch, dtype)], arch)
    assert f".entry {result.entry}" in result.ptx and not result.spills


@pytest.mark.parametrize("arch,dtype", [("sm80", "fp16"), ("sm90", "bf16"), ("sm100", "bf16")])
def test_backward_helper_kernels_compile(arch: str, dtype: str):
    """The head-dim-generic preprocess and dQ-convert kernels: no CuTe, so seconds to compile."""
    from flash_gen.build.nvrtc import compile_many
    from flash_gen.gen.render import bwd_aux_prefix, render_bwd_aux

    prefix = bwd_aux_prefix(arch, dtype)
    results = compile_many(render_bwd_aux(arch, dtype), [f"{prefix}_preprocess", f"{prefix}_convert_dq"], arch)
    for r in results:
        assert f".entry {r.entry}" in r.ptx and not r.spills
