"""CPU tests of the prebuilt kernel library: what `flash-gen build` plans, the manifest round trip, incremental
rebuilds, corrupt or foreign entries falling back to the cache/JIT, and the loader's lookup order."""

from __future__ import annotations

import itertools
import time

import pytest

from flash_gen import bwd_tilings, fwd_tilings, tuned
from flash_gen.build import cache, library, make_library
from flash_gen.gen import render
from flash_gen.spec import FwdKey, config_from_name, default_config
from flash_gen.spec_bwd import BwdKey
from flash_gen.spec_sm90 import Sm90FwdConfig


@pytest.fixture
def helpers_only(monkeypatch):
    """A library of the bf16 sm90 helper kernels only (they compile in seconds)."""
    monkeypatch.setattr(make_library, "plan", lambda arch: [])
    everything = make_library.helpers
    monkeypatch.setattr(make_library, "helpers",
                        lambda arch: [h for h in everything(arch) if h[1][0].endswith(("bf16", "bf16_preprocess"))])


def test_plan_holds_defaults_and_every_live_tuned_variant():
    variants = set(make_library.plan("sm90"))
    kernels = {render.entry_name(*v) for v in variants}
    assert len(kernels) == len(variants)  # one pair per kernel, though keys share kernels (render.kernel_key)
    for key in (FwdKey("sm90", "bf16", 128, "causal"), FwdKey("sm90", "bf16", 96, "causal")):
        assert (key, fwd_tilings.default_config(key)) in variants  # the Hopper kernel, also at a padded head dim
    assert {render.entry_name(*v) for v in tuned.live_configs("sm90")} <= kernels
    for hd in (72, 80, 96):  # the vision head dims run 80's forward kernels and, like 96, 96's backward ones
        fwd, bwd = FwdKey("sm90", "fp16", hd, "local"), BwdKey("sm90", "fp16", hd, "local")
        assert {render.entry_name(fwd, fwd_tilings.default_config(fwd)),
                render.entry_name(bwd, bwd_tilings.default_config(bwd))} <= kernels
    for hd in make_library.DROPOUT_HEAD_DIMS:  # training with dropout, forward and backward
        fwd = FwdKey("sm90", "bf16", hd, "causal", dropout=True)
        bwd = BwdKey("sm90", "bf16", hd, "causal", dropout=True)
        assert {(fwd, fwd_tilings.default_config(fwd)), (bwd, bwd_tilings.default_config(bwd))} <= variants
    for hd, mask in itertools.product(make_library.VARLEN_HEAD_DIMS, ("causal", "local")):  # packed batches
        fwd, bwd = FwdKey("sm90", "fp16", hd, mask, varlen=True), BwdKey("sm90", "fp16", hd, mask, varlen=True)
        assert {(fwd, fwd_tilings.default_config(fwd)), (bwd, bwd_tilings.default_config(bwd))} <= variants
    assert any(getattr(k, "kv", "") == "paged" and k.split and k.pack_gqa for k, _ in variants)  # decoding
    assert (FwdKey("sm90", "bf16", 128, "causal", split=True), fwd_tilings.default_config(
        FwdKey("sm90", "bf16", 128, "causal", split=True))) in variants  # decoding-like dense calls


def test_build_is_incremental_and_found_by_the_loader(tmp_path, monkeypatch, helpers_only):
    monkeypatch.setenv("FLASH_GEN_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "lib"
    compiled, kept = make_library.build(("sm90",), out, jobs=1, progress=lambda _: None)
    assert compiled == 4 and kept == 0  # preprocess + convert_dq, combine, append (bf16)
    start = time.perf_counter()
    assert make_library.build(("sm90",), out, jobs=1, progress=lambda _: None) == (0, 4)
    assert time.perf_counter() - start < 10
    lib = library.Library.open(out)
    assert library.Library.open(out).records == lib.records  # manifest round trip

    monkeypatch.setenv("FLASH_GEN_LIBRARY", str(out))
    library.installed.cache_clear()
    source, entry = render.render_combine("sm90", "bf16"), render.combine_entry("sm90", "bf16")
    assert library.find(source, entry, "sm90") == ((out / lib.records[("sm90", entry)].cubin).read_bytes(), 0)
    monkeypatch.setenv("FLASH_GEN_NO_JIT", "1")  # and the cache never had to be asked
    assert cache.lookup(source, entry, "sm90") is None
    library.installed.cache_clear()


def test_foreign_or_corrupt_entries_fall_back(tmp_path, monkeypatch, helpers_only):
    monkeypatch.setenv("FLASH_GEN_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "lib"
    make_library.build(("sm90",), out, jobs=1, progress=lambda _: None)
    lib = library.Library.open(out)
    entry = render.combine_entry("sm90", "bf16")
    rec = lib.records[("sm90", entry)]
    with pytest.warns(RuntimeWarning, match="other sources"):
        assert lib.cubin("sm90", entry, "not-" + rec.source_key) is None
    (out / rec.cubin).write_bytes(b"truncated")
    with pytest.warns(RuntimeWarning, match="corrupt library cubin"):
        assert lib.cubin("sm90", entry, rec.source_key) is None
    # The next build notices the damage and rebuilds just that file's kernels.
    assert make_library.build(("sm90",), out, jobs=1, progress=lambda _: None)[0] >= 1
    assert library.Library.open(out).cubin("sm90", entry, rec.source_key) is not None


def test_cli_info_names_default_and_tuned_tilings(capsys, monkeypatch):
    from flash_gen import cli

    db = tuned.TunedDb("sm90")
    monkeypatch.setattr(tuned, "shipped", lambda arch: db)
    stale = FwdKey("sm90", "bf16", 96, "causal")  # tuned against the portable kernel, before the Hopper one
    db.record(stale.name, "s<=4k", tuned.Entry("m128n64w4s2", 1.0, "m128n64w4s2", 1.0, "gpu", "drv", "now", 3))
    assert cli.main(["info", stale.name]) == 0
    out = capsys.readouterr().out
    assert "default tiling wgm128n128s2_persist " in out and "tuned s<=4k: m128n64w4s2 (stale" in out
    key = FwdKey("sm90", "bf16", 256, "causal")
    hopper = fwd_tilings.default_config(key)
    db.record(key.name, "s<=4k", tuned.Entry("wgm128n80s2", 1.0, hopper.name, 1.1, "gpu", "drv", "now", 3))
    assert cli.main(["info", key.name]) == 0
    out = capsys.readouterr().out
    assert f"default tiling {hopper.name} " in out and "tuned s<=4k: wgm128n80s2 " in out and "stale" not in out
    # head dim 232 computes as 256, so it runs 256's entries where it has none of its own
    assert cli.main(["info", FwdKey("sm90", "bf16", 232, "causal").name]) == 0
    assert "tuned s<=4k: wgm128n80s2 (head dim 256's entry) " in capsys.readouterr().out


def test_cli_info_lists_the_library_kernels_that_serve_a_key(capsys, monkeypatch, tmp_path):
    from flash_gen import cli

    key72, key80 = FwdKey("sm90", "bf16", 72, "causal"), FwdKey("sm90", "bf16", 80, "causal")
    hopper, portable = fwd_tilings.default_config(key80), fwd_tilings.portable_config(key80)
    lib = library.Library(tmp_path)
    for cfg, registers in ((hopper, 168), (portable, 255)):
        entry = render.entry_name(key80, cfg)
        lib.records[("sm90", entry)] = library.Record(entry, "sm90", key80.name, cfg.name, "src", "c", "0", registers,
                                                      0, 1024, cfg.num_threads)
    monkeypatch.setattr(library, "installed", lambda arch: (lib,))
    assert cli.main(["info", key72.name]) == 0
    out = capsys.readouterr().out
    # head dim 72's Hopper kernel is 80's (render.kernel_key); its portable kernel is its own
    assert f"library {tmp_path}: {hopper.name} registers=168" in out and f": {portable.name} registers" not in out


def test_wheel_installs_and_is_discovered_in_a_fresh_venv(tmp_path, monkeypatch, helpers_only):
    import os
    import subprocess
    import sys
    from pathlib import Path

    monkeypatch.setenv("FLASH_GEN_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "lib"
    make_library.build(("sm90",), out, jobs=1, progress=lambda _: None)
    wheel = make_library.pack_wheel(out, "sm90", tmp_path / "wheels")
    venv = tmp_path / "venv"  # sees this environment's packages (torch, cuda-bindings), not flash_gen's kernels
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
    probe = ("from flash_gen.build import library; libs = library.installed('sm90'); "
             "print(len(libs), sum(len(l.records) for l in libs))")
    env = {k: v for k, v in os.environ.items() if k != "FLASH_GEN_LIBRARY"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    found = subprocess.run([str(python), "-c", probe], check=True, capture_output=True, text=True, env=env).stdout
    assert found.split() == ["1", "4"]


def test_a_tuned_decoding_tiling_serves_decoding_steps_not_chunks(monkeypatch):
    """A KV-cache key's tuned entry measured against the portable default (the tuner's decode family) serves the
    decoding steps' portable route; chunks, which start the chain at the Hopper kernel, keep its default."""
    from flash_gen.runtime import fwd

    key = FwdKey("sm90", "bf16", 128, "none", kv="cache", pack_gqa=True)
    portable = fwd_tilings.portable_config(key)
    db = tuned.TunedDb("sm90")
    db.record(key.name, "cache<=8k", tuned.Entry("m64n64w4s1", 1.0, portable.name, 1.1, "gpu", "drv", "now", 3))
    monkeypatch.setattr(tuned, "shipped", lambda arch: db)
    monkeypatch.setattr(library, "obtain", lambda source, entry, arch, options=(): (b"", 0))  # no NVRTC: no spills
    assert fwd._config(key, "cache<=8k", portable) == config_from_name("m64n64w4s1")
    assert fwd._config(key, "cache<=8k") == fwd_tilings.default_config(key)
    assert fwd._config(key, "cache>8k", portable) == portable  # no entry: the portable default


def test_dispatch_picks_the_tuned_tiling_per_bucket(monkeypatch):
    from flash_gen.runtime import fwd

    key = FwdKey("sm90", "bf16", 64, "none", kv="paged")  # a portable-kernel key (pages of any size)
    db = tuned.TunedDb("sm90")
    db.record(key.name, "s<=1k", tuned.Entry("m128n64w4s2_qreg", 1.0, default_config(key).name, 1.1, "gpu", "drv",
                                             "now", 3))
    monkeypatch.setattr(tuned, "shipped", lambda arch: db)
    monkeypatch.setattr(library, "obtain", lambda source, entry, arch, options=(): (b"", 0))  # no NVRTC: no spills
    assert fwd._config(key, "s<=1k") == config_from_name("m128n64w4s2_qreg")
    assert fwd._config(key, "s>4k") == default_config(key)  # no entry: the default
    monkeypatch.setenv("FLASH_GEN_FWD_CONFIG", "m64n64w4s1")  # a forced tiling wins
    assert fwd._config(key, "s<=1k") == config_from_name("m64n64w4s1")


def test_dispatch_prefers_the_hopper_kernel_and_drops_stale_entries(monkeypatch):
    """Dense sm90 keys the Hopper kernel supports get it by default; a database entry tuned against another
    default (the portable kernel's, before the Hopper kernel existed) is stale and ignored."""
    from flash_gen.runtime import fwd

    key = FwdKey("sm90", "bf16", 64, "none")
    assert isinstance(fwd._config(key, "s>4k"), Sm90FwdConfig)
    db = tuned.TunedDb("sm90")
    db.record(key.name, "s<=1k", tuned.Entry("m128n64w4s2_qreg", 1.0, "m128n64w4s1", 1.1, "gpu", "drv", "now", 3))
    hopper = fwd_tilings.default_config(key)
    db.record(key.name, "s>4k", tuned.Entry("wgm128n96s3", 1.0, hopper.name, 1.1, "gpu", "drv", "now", 3))
    monkeypatch.setattr(tuned, "shipped", lambda arch: db)
    assert fwd._config(key, "s<=1k") == hopper
    assert fwd._config(key, "s>4k") == Sm90FwdConfig(96, 3, pingpong=False)
    assert list(tuned.live_configs("sm90")) == [(key, Sm90FwdConfig(96, 3, pingpong=False))]


def _fake_compile(spilling: set):
    """A stand-in for build.batches.compile_batch: no NVRTC; the tilings in `spilling` report 8 B of spills."""
    from types import SimpleNamespace

    from flash_gen.build.batches import Compiled

    def compile_batch(variants):
        out = []
        for key, cfg in variants:
            entry = render.entry_name(key, cfg)
            spills = 8 if cfg in spilling else 0
            result = SimpleNamespace(cubin=b"\x7fELF" + entry.encode(), registers=255, spill_stores=spills,
                                     spill_loads=spills, spills=bool(spills))
            out.append(Compiled(key, cfg, entry, "", result, 0.0, None))
        return out

    return compile_batch


def test_build_adds_the_fallback_of_a_spilling_default(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from flash_gen.build import spill_free
    from flash_gen.spec_bwd import BwdKey

    key = BwdKey("sm80", "bf16", 64, "none")
    head, second, third = spill_free.chain(key)[:3]
    monkeypatch.setattr(make_library, "plan", lambda arch: [(key, head)])
    monkeypatch.setattr(make_library, "helpers", lambda arch: [])
    monkeypatch.setattr(make_library, "ProcessPoolExecutor", ThreadPoolExecutor)
    monkeypatch.setattr(make_library, "compile_batch", _fake_compile({head, second}))
    out = tmp_path / "lib"
    assert make_library.build(("sm80",), out, jobs=1, progress=lambda _: None) == (3, 0)
    records = library.Library.open(out).records
    assert [records[("sm80", render.entry_name(key, c))].spills for c in (head, second, third)] == [16, 16, 0]
    assert make_library.build(("sm80",), out, jobs=1, progress=lambda _: None) == (0, 3)  # walked from the manifest


def test_runtime_takes_the_first_spill_free_tiling_of_the_chain(monkeypatch):
    from flash_gen.build import spill_free
    from flash_gen.runtime import loader
    from flash_gen.spec_bwd import BwdKey

    key = BwdKey("sm80", "bf16", 128, "causal", varlen=True, deterministic=True)
    chain = spill_free.chain(key)
    spilling = {render.entry_name(key, c) for c in chain[:2]}
    asked = []

    def obtain(source, entry, arch, options=()):
        asked.append(entry)
        return b"", 12 if entry in spilling else 0

    monkeypatch.setattr(library, "obtain", obtain)
    monkeypatch.setattr(loader, "_spill_free", {})
    assert loader.spill_free_config(key) == chain[2] and len(asked) == 3
    assert loader.spill_free_config(key) == chain[2] and len(asked) == 3  # once per key and process
    spilling = {render.entry_name(key, c) for c in chain}
    loader._spill_free.clear()
    assert loader.spill_free_config(key) == chain[0]  # all spill: the head, with a warning in the log
    assert spill_free.fallback(key, chain[-1]) is None and spill_free.fallback(key, object()) is None
