"""CPU check of benchmarks/wgmma_rate.py: its micro-benchmark kernels compile with NVRTC for sm_90a without spills
or serialised wgmmas (what the rates it prints assume). No GPU needed; about 10 s."""

from __future__ import annotations

from flash_gen.build import nvrtc
from script_module import load_script


def test_rate_kernels_compile_clean():
    rate = load_script("benchmarks/wgmma_rate.py")
    results = nvrtc.compile_many(rate.SOURCE, [rate.entry(*v) for v in rate.VARIANTS], "sm90")
    assert [r.entry for r in results] == [rate.entry(*v) for v in rate.VARIANTS]
    for r in results:
        assert r.spill_stores == 0 and not r.wgmma_serialized, r.entry
    # the HGMMA shape the benchmark is about (80 needs CuTe's extended wgmma shapes)
    assert "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16" in results[0].ptx
