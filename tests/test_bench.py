"""CPU checks of `flash-gen bench`'s timing loop (flash_gen.bench), with stand-in implementations and timer."""

from __future__ import annotations

import contextlib
import itertools

from flash_gen import bench


def test_each_repeat_rotates_which_implementation_runs_first(monkeypatch):
    """Implementations are interleaved per repeat, and their order rotates, so none is always timed first."""
    monkeypatch.setattr(bench, "_input_sets", lambda shape, l2_bytes: [()])
    monkeypatch.setattr(bench, "_max_abs_diff", lambda qkv, causal: None)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    calls: list[str] = []
    impls = {name: (contextlib.nullcontext, lambda causal, name=name: calls.append(name)) for name in "abc"}
    timer = lambda fn: (fn(), 2.0)[1]  # noqa: E731
    row = bench._bench_shape(bench.Shape(64, False, 128, 1, 1, "bf16"), impls, timer, repeats=3, l2_bytes=0)
    runs = [name for name, _ in itertools.groupby(calls)]  # each implementation: its first call, then the timed one
    assert runs == list("abc" "bca" "cab")
    assert row["ms"] == {"a": 2.0, "b": 2.0, "c": 2.0}
    assert row["samples_ms"] == {name: [2.0] * 3 for name in "abc"}
