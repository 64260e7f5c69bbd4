"""CPU checks of flash_gen.build.sass: the HGMMA batch census, and the compile check reading it (with a stand-in
cuobjdump, so no CUDA toolkit is needed)."""

from __future__ import annotations

import stat

from flash_gen.build import nvrtc, sass

_CHAIN = "".join(f"        /*{i:04x}*/  HGMMA.64x128x16.F32.BF16 R24, R{152 + 4 * i}, gdesc[UR8].tnspB, R24"
                 f"{', gsb0' if i == 4 else ''} ;\n" for i in range(5))
_WAITED = "".join(f"        /*{i:04x}*/  HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR8].tnspB, R24, gsb0 ;\n"
                  f"        /*{i:04x}*/  WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\n" for i in range(5))


def test_hgmma_batches_flag_serialised_wgmmas():
    assert sass.hgmma_batches(_CHAIN * 2) == (10, 2) and not sass.serialised(*sass.hgmma_batches(_CHAIN * 2))
    assert sass.hgmma_batches(_WAITED * 2) == (10, 10) and sass.serialised(*sass.hgmma_batches(_WAITED * 2))
    assert not sass.serialised(*sass.hgmma_batches(_WAITED[: len(_WAITED) // 5]))  # one lone waited HGMMA


def test_compile_check_reads_the_sass(tmp_path, monkeypatch):
    listing = tmp_path / "listing.txt"
    listing.write_text(f"\n\tcode for sm_90a\n\t\tFunction : k\n{_WAITED * 2}\n\t\tFunction : other\n{_CHAIN}\n")
    tool = tmp_path / "cuobjdump"
    tool.write_text(f"#!/bin/sh\ncat {listing}\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(sass, "cuobjdump", lambda: str(tool))
    assert set(sass.functions(b"\0")) == {"k", "other"}
    source = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] = 1.f; }'
    result = nvrtc.compile_source(source, "k", "sm90")
    assert result.wgmma_serialized and not result.spills
