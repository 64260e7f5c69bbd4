"""Attention benchmark (forward, or forward+backward through autograd): flash_gen against PyTorch SDPA's
FlashAttention-2 and cuDNN backends and, where installed, FlashAttention-4, in one run.

Owns the benchmark shapes (the shared/ANCHORS.md convention: batch = total_tokens / seqlen, nheads =
model_dim / hdim or a fixed count, seqlen_q = seqlen_k), the timing, the TFLOP/s table and the JSON record. GPU only.
flash_gen is measured through its public API, like a user would call it (or, for --configs, through the runtime
forced to one tiling); this module must not import the compiler, the tuner or optuna. The options are declared
in flash_gen.cli.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import math
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_gen
from flash_gen import bwd_tilings, fwd_tilings, ops
from flash_gen.bwd_tilings import BwdTiling
from flash_gen.gpu_monitor import GpuMonitor
from flash_gen.validate import derive_mask

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PEERS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}  # through torch SDPA
# FlashAttention-4 (the flash-attn-4 package, CuTe DSL; its Sm90 path on Hopper), called directly when installed.
OWN_PEERS = ("fa4",)
LABELS = {"flash_gen": "flash_gen", "flash": "FA2", "cudnn": "cuDNN", "fa4": "FA4"}
CAUSAL = {"both": (False, True), "no": (False,), "yes": (True,)}
FLOP_FACTOR = {"fwd": 1.0, "fwd+bwd": 3.5}  # the backward pass counts as 2.5 forwards
WARMUP_MS, REP_MS = 25, 100  # triton.testing.do_bench's defaults
# Untimed load before each implementation's first timing in a cell. After the GPU idles (between cells; during
# a peer's first call, which builds its plan) the H200 runs above its sustained clock for up to a second (1980
# against 1600-1850 MHz at its 700 W limit): such first timings ran up to 12% faster than the rest at 2k
# (2026-12-02), which favoured whichever implementation came right after an idle gap. (The run's very first timing
# still did with 3 s and with 10 s: that idle came after the preheat, see median_timer.)
PREHEAT_MS = 1000
FALLBACK_L2_BYTES = 60 * 2**20  # H200; used when the device does not report its L2 size


@dataclass(frozen=True)
class Shape:
    hdim: int
    causal: bool
    seqlen: int
    batch: int
    nheads: int
    dtype: str
    direction: str = "fwd"
    softcap: float = 0.0  # flash_gen's only (the peers are off)
    window: tuple[int, int] = (-1, -1)  # flash_attn's window_size (-1: unbounded side); flash_gen's only too
    dropout: float = 0.0  # dropout_p of every implementation (FLOPs unchanged)

    @property
    def flops(self) -> float:
        """Forward: two matmuls of 2*D flops per visible (query, key) pair, S*S of them, causal counting half;
        with a window, the pairs inside it, counted exactly; backward: 2.5x that."""
        if self.window == (-1, -1):
            pairs = self.seqlen * self.seqlen / (2 if self.causal else 1)
        else:
            pairs = visible_pairs(self.seqlen, self.window[0], 0 if self.causal else self.window[1])
        return 4 * self.batch * self.nheads * pairs * self.hdim * FLOP_FACTOR[self.direction]


def visible_pairs(seqlen: int, left: int, right: int) -> int:
    """(query, key) pairs with key - query in [-left, right] (-1: unbounded) of a seqlen x seqlen attention."""
    i = torch.arange(seqlen, dtype=torch.int64)
    lo = (i - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
    hi = (i + right).clamp(max=seqlen - 1) if right >= 0 else torch.full_like(i, seqlen - 1)
    return int((hi - lo + 1).clamp(min=0).sum())


def run(args: argparse.Namespace) -> int:
    """Benchmark every (hdim, causal, seqlen) cell, print the table and write the JSON. Returns an exit code."""
    unknown = sorted(set(args.peers) - set(PEERS) - set(OWN_PEERS))
    if unknown:
        print(f"--peers: unknown {unknown}; choose from {[*PEERS, *OWN_PEERS]}", file=sys.stderr)
        return 2
    own = [name for name, on in (("--softcap", args.softcap), ("--window", args.window != (-1, -1))) if on]
    if own and args.peers:
        print(f"{', '.join(own)}: flash_gen's only (not in SDPA); pass --peers= to time flash_gen alone",
              file=sys.stderr)
        return 2
    if args.dropout and "fa4" in args.peers:
        print("--dropout: FA4 has no dropout; leave fa4 out of --peers", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("flash-gen bench needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    timer_name, timer = median_timer()
    scores = dict(softcap=args.softcap, window=args.window, dropout=args.dropout)
    impls = {"flash_gen": (contextlib.nullcontext, functools.partial(_flash_gen, **scores))}
    for name in args.configs:
        if args.direction == "fwd":
            impl = functools.partial(_flash_gen, config=fwd_tilings.config_from_name(name), **scores)
        else:
            impl = functools.partial(_flash_gen_bwd_config, config=bwd_tilings.config_from_name(name), **scores)
        impls[f"fg:{name}"] = (contextlib.nullcontext, impl)
    impls.update({p: (functools.partial(sdpa_kernel, PEERS[p]), functools.partial(_sdpa, dropout=args.dropout))
                  if p in PEERS else (contextlib.nullcontext, fa4_attention) for p in args.peers})
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2_bytes = getattr(props, "L2_cache_size", 0)
    results = []
    with GpuMonitor(_nvidia_smi_id(props)) as monitor:
        for hdim, causal, seqlen in itertools.product(args.hdim, CAUSAL[args.causal], args.seqlen):
            shape = Shape(
                hdim=hdim,
                causal=causal,
                seqlen=seqlen,
                batch=max(1, args.total_tokens // seqlen),
                nheads=args.nheads or max(1, args.model_dim // hdim),
                dtype=args.dtype,
                direction=args.direction,
                softcap=args.softcap,
                window=args.window,
                dropout=args.dropout,
            )
            results.append(_bench_shape(shape, impls, timer, args.repeats, l2_bytes or FALLBACK_L2_BYTES))
            _print_row(results[-1])
    for row in results:
        _attach_clocks(row, monitor)
    _print_table(results, list(impls), args.direction)
    record = {
        **run_record(),
        "timer": timer_name,
        "settings": {k: v for k, v in vars(args).items() if not callable(v)},
        "results": results,
    }
    with open(args.json, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {args.json}")
    return 0


def run_record() -> dict:
    """Where and when a benchmark ran: device, library versions, UTC date (the head of every JSON record)."""
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "flash_gen": flash_gen.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _flash_gen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, config=None,
               softcap: float = 0.0, window: tuple[int, int] = (-1, -1), dropout: float = 0.0) -> torch.Tensor:
    """flash_gen's forward as a user calls it, or (with `config`) forced to one tiling through the runtime."""
    if config is None:
        return flash_gen.flash_attn_func(q, k, v, dropout_p=dropout, causal=causal, window_size=window,
                                         softcap=softcap)
    from flash_gen.runtime.fwd import attention_fwd

    return attention_fwd(q, k, v, **_runtime_scores(q, k, causal, softcap, window), config=config,
                         **_dropout_args(q, dropout))[0]


def _dropout_args(q: torch.Tensor, dropout: float) -> dict:
    """The runtime's dropout arguments: dropout_p and a fresh seed (as the public functions draw one per call)."""
    return dict(dropout_p=dropout, rng_state=ops.dropout_seed(q, dropout)) if dropout else {}


def _runtime_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, softcap: float,
                    window: tuple[int, int]) -> dict:
    """The runtime's score arguments for a forced tiling: causal and the window normalised as the public
    functions do (the runtime takes a causal flag or a finite window, not both)."""
    mask, window = derive_mask(causal, window, q.shape[1], k.shape[1])
    return dict(softmax_scale=q.shape[-1] ** -0.5, causal=mask == "causal", window_size=window, softcap=softcap,
                alibi_slopes=None)


class _ForcedBackward(torch.autograd.Function):
    """flash_gen's default forward with its backward forced to one tiling (fg:NAME columns of fwd+bwd runs)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, config: BwdTiling, softcap: float, window: tuple[int, int],
                dropout: float):
        from flash_gen.runtime.fwd import attention_fwd

        ctx.attn = _runtime_scores(q, k, causal, softcap, window)
        ctx.dropout = _dropout_args(q, dropout)
        out, lse = attention_fwd(q, k, v, **ctx.attn, **ctx.dropout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = config
        return out

    @staticmethod
    def backward(ctx, dout):
        from flash_gen.runtime.bwd import attention_bwd

        q, k, v, out, lse = ctx.saved_tensors
        grads = tuple(torch.empty_like(t) for t in (q, k, v))
        attention_bwd(dout.contiguous(), q, k, v, out, lse, *grads, deterministic=False, config=ctx.config,
                      **ctx.attn, **ctx.dropout)
        return (*grads, None, None, None, None, None)


def _flash_gen_bwd_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, config: BwdTiling,
                          softcap: float = 0.0, window: tuple[int, int] = (-1, -1),
                          dropout: float = 0.0) -> torch.Tensor:
    return _ForcedBackward.apply(q, k, v, causal, config, softcap, window, dropout)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dropout: float = 0.0) -> torch.Tensor:
    """SDPA with whichever backend the caller's context selects. SDPA takes (batch, heads, seqlen, dim): the
    transposes are views, so every implementation reads the same memory layout."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                         dropout_p=dropout)
    return out.transpose(1, 2)


def fa4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """FlashAttention-4's public function (same layout as flash_gen's); ImportError where it is not installed,
    which shows its column as n/a."""
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(q, k, v, causal=causal)
    return out[0] if isinstance(out, tuple) else out


def _input_sets(shape: Shape, l2_bytes: int) -> list[tuple[torch.Tensor, ...]]:
    """Enough independent (q, k, v[, dout]) sets that cycling through them streams at least twice the L2 size, so
    a timing never measures inputs the previous call left in cache. With a backward pass q, k, v require grad."""
    dims = (shape.batch, shape.seqlen, shape.nheads, shape.hdim)
    grads = shape.direction != "fwd"
    set_bytes = (4 if grads else 3) * math.prod(dims) * DTYPES[shape.dtype].itemsize
    count = max(2, math.ceil(2 * l2_bytes / set_bytes))
    make = functools.partial(torch.randn, *dims, dtype=DTYPES[shape.dtype], device="cuda")
    if not grads:
        return [(make(), make(), make()) for _ in range(count)]
    return [(make().requires_grad_(), make().requires_grad_(), make().requires_grad_(), make()) for _ in range(count)]


def _call(impl: Callable, shape: Shape, inputs: tuple[torch.Tensor, ...]) -> object:
    """One timed step: the forward, or the forward and the backward of its output against dout."""
    out = impl(*inputs[:3], shape.causal)
    if shape.direction == "fwd":
        return out
    return torch.autograd.grad(out, inputs[:3], inputs[3])


def _bench_shape(shape: Shape, impls: dict, timer: Callable, repeats: int, l2_bytes: int) -> dict:
    sets = _input_sets(shape, l2_bytes)
    samples: dict[str, list[float]] = {name: [] for name in impls}
    spans: dict[str, list[tuple[datetime, datetime]]] = {name: [] for name in impls}  # local times, as nvidia-smi's
    errors: dict[str, str] = {}
    # Interleave the implementations so clock or thermal drift during the run hits all of them alike, and rotate
    # their order each repeat so that none always runs first (on the H200 one kernel read up to 6% apart as two
    # columns of one cell, 2026-12-02).
    order = list(impls.items())
    for i in range(repeats):
        for name, (backend, impl) in order[i % len(order):] + order[:i % len(order)]:
            if name in errors:
                continue
            rotation = itertools.cycle(sets)
            fn = lambda: _call(impl, shape, next(rotation))  # noqa: E731
            try:
                with backend():
                    fn()  # first call: JIT compile / kernel selection stays out of the timing
                    torch.cuda.synchronize()
                    if i == 0:
                        preheat(fn)
                    start = datetime.now()
                    samples[name].append(timer(fn))
                    spans[name].append((start, datetime.now()))
            except Exception as e:  # an unavailable peer shows "n/a"; it never ends the run
                first_line = (str(e).strip().splitlines() or [""])[0]
                errors[name] = f"{type(e).__name__}: {first_line}"
    ms = {name: statistics.median(s) if s and name not in errors else None for name, s in samples.items()}
    return {
        **asdict(shape),
        "tflop": shape.flops / 1e12,
        "ms": ms,
        "samples_ms": samples,  # every repeat's median, in run order: the spread behind each median
        "_spans": spans,  # replaced by each sample's clock and power once the run's monitor has stopped
        "tflops": {name: shape.flops / (t * 1e-3) / 1e12 if t else None for name, t in ms.items()},
        "errors": errors,
        # SDPA has neither softcap nor windows; with dropout every implementation draws its own mask
        "max_abs_diff": (None if shape.softcap or shape.window != (-1, -1) or shape.dropout
                         else _max_abs_diff(sets[0], shape.causal)),
    }


def _nvidia_smi_id(props: object) -> str:
    """nvidia-smi's --id for the current device: its UUID (CUDA and nvidia-smi may number GPUs differently)."""
    uuid = str(getattr(props, "uuid", "")).removeprefix("GPU-")
    if re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", uuid):
        return f"GPU-{uuid}"
    return str(torch.cuda.current_device())


def _attach_clocks(row: dict, monitor: GpuMonitor) -> None:
    """Each sample's median SM clock and power draw (None where nvidia-smi gave nothing), in `samples_ms`' order."""
    windows = {name: [monitor.window(*span) for span in spans] for name, spans in row.pop("_spans").items()}
    row["samples_sm_mhz"] = {name: [w and w["sm_mhz"] for w in ws] for name, ws in windows.items()}
    row["samples_power_w"] = {name: [w and w["power_w"] for w in ws] for name, ws in windows.items()}


def _max_abs_diff(qkv: tuple[torch.Tensor, ...], causal: bool) -> float | None:
    """flash_gen against SDPA's default backend on one input set: a cheap sanity check, not the test-suite."""
    try:
        with torch.no_grad():
            diff = _flash_gen(*qkv[:3], causal).float() - _sdpa(*qkv[:3], causal).float()
        return diff.abs().max().item()
    except Exception:  # flash_gen's own failure is already reported with its timing
        return None


def median_timer() -> tuple[str, Callable[[Callable[[], object]], float]]:
    """Median milliseconds per call: triton's do_bench when triton is installed, else CUDA events."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return "cuda_events", events_median
    # The process's first do_bench sets up triton's driver, which on a fresh machine builds its launcher with the
    # host compiler: seconds of GPU idle between the first preheat and the first timing, which then ran 9-12% fast
    # (H200, 2026-12-02). Done here, before anything is timed.
    x = torch.zeros(1, device="cuda")
    do_bench(lambda: x.add_(1), warmup=1, rep=1)
    return "triton.testing.do_bench", lambda fn: do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def preheat(fn: Callable[[], object], ms: float = PREHEAT_MS) -> None:
    """Run `fn` untimed for about `ms` milliseconds, so that the timing that follows sees the GPU's sustained
    clock under load rather than the burst its power limiter allows after idle."""
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < ms:
        for _ in range(4):
            fn()
        torch.cuda.synchronize()


def events_median(fn: Callable[[], object]) -> float:
    """do_bench's scheme with CUDA events but no L2 flush (for callers that rotate their inputs past L2): size
    warmup and timed runs from a 5-call estimate, time each call."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    per_call = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(WARMUP_MS / per_call))):
        fn()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(max(1, int(REP_MS / per_call)))
    ]
    for begin, finish in events:
        begin.record()
        fn()
        finish.record()
    torch.cuda.synchronize()
    return statistics.median(begin.elapsed_time(finish) for begin, finish in events)


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _clock_range(row: dict) -> str:
    """The lowest and highest SM clock the cell's timings ran at: a wide range means its ratios are suspect."""
    mhz = [m for ms in row.get("samples_sm_mhz", {}).values() for m in ms if m is not None]
    if not mhz:
        return "n/a"
    low, high = min(mhz), max(mhz)
    return f"{low:.0f}" if low == high else f"{low:.0f}-{high:.0f}"


def _ratio(row: dict, peer: str) -> float | None:
    mine, theirs = row["tflops"]["flash_gen"], row["tflops"].get(peer)
    return mine / theirs if mine and theirs else None


def _print_row(row: dict) -> None:
    """One progress line per cell, so a long run shows where it is."""
    cells = "  ".join(f"{name}={_fmt(t, '.1f')}" for name, t in row["tflops"].items())
    print(f"hdim={row['hdim']} causal={row['causal']} S={row['seqlen']}: {cells} TFLOP/s", flush=True)
    for name, err in row["errors"].items():
        print(f"  {name} n/a: {err}", flush=True)


def _print_table(results: list[dict], impls: list[str], direction: str) -> None:
    from rich.console import Console
    from rich.table import Table

    peers = [name for name in impls if name in PEERS or name in OWN_PEERS]
    title = "Forward" if direction == "fwd" else "Forward+backward"
    fa4 = "; FA4: flash-attn-4" if "fa4" in impls else ""
    table = Table(title=f"{title} TFLOP/s on {torch.cuda.get_device_name()} (FA2, cuDNN: torch SDPA backends{fa4})")
    for col in ("hdim", "causal", "seqlen", *(LABELS.get(n, n) for n in impls), *(f"fg/{LABELS[p]}" for p in peers)):
        table.add_column(col, justify="right")
    table.add_column("max|Δ| vs SDPA", justify="right")
    table.add_column("SM MHz", justify="right")
    for row in results:
        table.add_row(
            str(row["hdim"]),
            "yes" if row["causal"] else "no",
            str(row["seqlen"]),
            *(_fmt(row["tflops"][n], ".1f") for n in impls),
            *(_fmt(_ratio(row, p), ".2f") for p in peers),
            _fmt(row["max_abs_diff"], ".2e"),
            _clock_range(row),
        )
    Console(width=None if sys.stdout.isatty() else 160).print(table)  # logs get the whole table
