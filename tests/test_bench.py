"""CPU checks of `flash-gen bench`'s timing loop (flash_gen.bench), with stand-in implementations and timer."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import shutil
import time
from datetime import datetime

import pytest

from flash_gen import bench
from flash_gen.gpu_monitor import GpuMonitor, parse_samples


def test_each_repeat_rotates_which_implementation_runs_first(monkeypatch):
    """Implementations are interleaved per repeat, and their order rotates, so none is always timed first; each
    implementation's first timing follows an untimed preheat."""
    monkeypatch.setattr(bench, "_input_sets", lambda shape, l2_bytes: [()])
    monkeypatch.setattr(bench, "_max_abs_diff", lambda qkv, causal: None)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    calls: list[str] = []
    preheated: list[str] = []
    monkeypatch.setattr(bench, "preheat", lambda fn: preheated.append(calls[-1]))
    impls = {name: (contextlib.nullcontext, lambda causal, name=name: calls.append(name)) for name in "abc"}
    timer = lambda fn: (fn(), 2.0)[1]  # noqa: E731
    row = bench._bench_shape(bench.Shape(64, False, 128, 1, 1, "bf16"), impls, timer, repeats=3, l2_bytes=0)
    runs = [name for name, _ in itertools.groupby(calls)]  # each implementation: its first call, then the timed one
    assert runs == list("abc" "bca" "cab")
    assert preheated == list("abc")  # each before its first timing
    assert row["ms"] == {"a": 2.0, "b": 2.0, "c": 2.0}
    assert row["samples_ms"] == {name: [2.0] * 3 for name in "abc"}
    assert [len(spans) for spans in row["_spans"].values()] == [3, 3, 3]


def test_each_timing_gets_the_clock_and_power_it_ran_at():
    """nvidia-smi's samples are matched to each timing's span; a span with no sample gets None."""
    text = (
        "2026/12/02 05:30:00.000, 1980, 650.5\n"
        "2026/12/02 05:30:00.100, 1755, 700.0\n"
        "2026/12/02 05:30:00.200, [N/A], [N/A]\n"  # left out
        "2026/12/02 05:30:00.300, 1800, 690.0\n"
        "2026/12/02 05:30"  # a truncated last line: left out
    )
    monitor = GpuMonitor("0")
    monitor.samples = parse_samples(text)
    assert len(monitor.samples) == 3
    t = lambda ms: datetime(2026, 12, 2, 5, 30, 0, ms * 1000)  # noqa: E731
    row = {"_spans": {"a": [(t(0), t(150)), (t(250), t(400))], "b": [(t(500), t(600))]}}
    bench._attach_clocks(row, monitor)
    assert "_spans" not in row
    assert row["samples_sm_mhz"] == {"a": [1867.5, 1800.0], "b": [None]}
    assert row["samples_power_w"] == {"a": [675.25, 690.0], "b": [None]}
    assert bench._clock_range(row) == "1800-1868"


def test_the_monitor_reads_what_nvidia_smi_wrote_until_it_was_stopped(tmp_path, monkeypatch):
    """The background process runs until the context exits; its output is parsed then (a stand-in nvidia-smi)."""
    fake, ready = tmp_path / "nvidia-smi", tmp_path / "sampled"
    fake.write_text(f"#!/bin/sh\necho '2026/12/02 05:30:00.000, 1980, 650.5'\n: > {ready}\n"
                    f"exec {shutil.which('sleep')} 60\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with GpuMonitor("0") as monitor:
        deadline = time.monotonic() + 30  # a loaded machine may take a while to start the script
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert monitor.samples == [(datetime(2026, 12, 2, 5, 30), 1980.0, 650.5)]
    monkeypatch.setenv("PATH", "")
    with GpuMonitor("0") as monitor:  # no nvidia-smi: nothing recorded, nothing raised
        pass
    assert monitor.samples == [] and monitor.window(datetime.min, datetime.max) is None


def test_windowed_shapes_count_the_visible_pairs():
    """With --window, FLOPs count the (query, key) pairs inside the window exactly (causal: right side 0); without,
    the ANCHORS convention (S*S, causal half)."""
    brute = lambda s, left, right: sum(  # noqa: E731
        1 for i in range(s) for j in range(s) if (left < 0 or j >= i - left) and (right < 0 or j <= i + right))
    for left, right in ((-1, -1), (-1, 0), (3, 0), (2, 5), (0, 0), (40, 40)):
        assert bench.visible_pairs(17, left, right) == brute(17, left, right)
    shape = lambda causal, window: bench.Shape(64, causal, 1000, 2, 3, "bf16", "fwd+bwd", window=window)  # noqa: E731
    per_pair = 4 * 2 * 3 * 64 * 3.5
    assert shape(True, (-1, -1)).flops == per_pair * 1000 * 1000 / 2
    assert shape(True, (100, 7)).flops == per_pair * bench.visible_pairs(1000, 100, 0)
    assert shape(False, (100, 7)).flops == per_pair * bench.visible_pairs(1000, 100, 7)
    # a forced tiling goes through the runtime, which takes a causal flag or a finite window, normalised
    q = bench.torch.empty(1, 1000, 1, 64)
    assert bench._runtime_scores(q, q, True, 0.0, (100, 7))["window_size"] == (100, 0)
    assert not bench._runtime_scores(q, q, True, 0.0, (100, 7))["causal"]
    assert bench._runtime_scores(q, q, True, 0.0, (-1, -1))["causal"]


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is installed here")
def test_a_peer_that_is_not_installed_shows_na_and_the_run_goes_on(monkeypatch):
    """FlashAttention-4 is an optional peer: where flash-attn-4 is missing its column reads n/a (an error recorded
    per cell), and the other implementations are still timed."""
    monkeypatch.setattr(bench, "_input_sets", lambda shape, l2_bytes: [(None, None, None)])
    monkeypatch.setattr(bench, "_max_abs_diff", lambda qkv, causal: None)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "preheat", lambda fn: None)
    impls = {"flash_gen": (contextlib.nullcontext, lambda q, k, v, causal: None),
             "fa4": (contextlib.nullcontext, bench.fa4_attention)}
    row = bench._bench_shape(bench.Shape(64, False, 128, 1, 1, "bf16"), impls, lambda fn: (fn(), 1.0)[1], repeats=2,
                             l2_bytes=0)
    assert row["ms"] == {"flash_gen": 1.0, "fa4": None}
    assert row["errors"]["fa4"].startswith(("ModuleNotFoundError", "ImportError"))


def test_unknown_peers_are_refused_with_the_choices(capsys):
    args = bench.argparse.Namespace(peers=("cudnn", "fa5"), softcap=0.0, window=(-1, -1))
    assert bench.run(args) == 2
    assert "unknown ['fa5']; choose from ['flash', 'cudnn', 'fa4']" in capsys.readouterr().err


def test_dropout_with_fa4_is_refused(capsys):
    """FA4 has no dropout: asking for both is an error before any GPU work."""
    args = bench.argparse.Namespace(peers=("cudnn", "fa4"), softcap=0.0, window=(-1, -1), dropout=0.1)
    assert bench.run(args) == 2
    assert "--dropout: FA4 has no dropout" in capsys.readouterr().err


def test_cli_takes_dropout():
    from flash_gen import cli

    args = cli._parser().parse_args(["bench", "--dropout", "0.1", "--peers", "flash,cudnn"])
    assert args.dropout == 0.1 and args.peers == ("flash", "cudnn")
