"""Persistent causal Hopper forwards under different section widths, side by side, with the model's figures beside
each: how well runtime/section_schedule.py's balance and running K/V foretell the time.

    python benchmarks/bench_section_width.py [--shapes 256:8192:8:2,...] [--widths 1,4] [--rounds 3] [--json f]

Each shape is head dim : seqlen (queries = keys) : heads : batch, bf16, causal. Per shape: the runtime's default
plan (`model`: the width choose_section_pairs picks), the kernel's own rule (`kernel`, FLASH_GEN_SECTION_PAIRS=0),
every width no other width beats in the model's balance and running K/V both (up to WIDTHS_TRIED pairs), the
--widths given, and SDPA's cuDNN backend. Each round times the widths in turn, starting one further along each round
(the clock drifts with temperature under the power limit), then cuDNN (whose power draw slows the call after it:
that call moves round by round too); a figure is its median round (median of triton.testing.do_bench, L2 flushed
between calls). TFLOP/s = 2 * b * h * d * s^2 / time. GPU only (sm_90).
"""

from __future__ import annotations

import os
import statistics

import torch
from torch.nn.attention import SDPBackend

from bench_common import sdpa_call, setup, write_rows
from flash_gen.runtime.fwd import plan_fwd, run_fwd, sm90_causal_launch
from flash_gen.runtime.section_schedule import WIDTHS_TRIED, figures

SHAPES = ("256:8192:8:2,256:4096:8:4,256:2048:8:8,128:2048:16:8,128:4096:16:4,128:8192:16:2,128:16384:16:1,"
          "256:4096:8:8,256:8192:8:4")


def _plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, width: str):
    """The runtime's causal plan with FLASH_GEN_SECTION_PAIRS=width ('' leaves it unset: the model's width)."""
    saved = os.environ.pop("FLASH_GEN_SECTION_PAIRS", None)
    try:
        if width:
            os.environ["FLASH_GEN_SECTION_PAIRS"] = width
        return plan_fwd(q, k, v, softmax_scale=q.shape[-1] ** -0.5, causal=True, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None)
    finally:
        os.environ.pop("FLASH_GEN_SECTION_PAIRS", None)
        if saved is not None:
            os.environ["FLASH_GEN_SECTION_PAIRS"] = saved


def _pareto(figs: dict[int, tuple[float, float]]) -> list[int]:
    """The widths no other width beats in balance and running K/V both."""
    return [w for w, (b, kv) in figs.items()
            if not any(b2 <= b and kv2 <= kv and (b2, kv2) != (b, kv) for b2, kv2 in figs.values())]


def main() -> int:
    if (ready := setup(__doc__, shapes=SHAPES, widths="", rounds="3")) is None:
        return 2
    args, timer = ready
    extra = [int(w) for w in args.widths.split(",") if w]
    cells = []
    for shape in args.shapes.split(","):
        d, s, h, b = map(int, shape.split(":"))
        gen = torch.Generator(device="cuda").manual_seed(d * s + h * 10 + b)
        q, k, v = (torch.randn(b, s, h, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        default = _plan(q, k, v, "")
        launch = sm90_causal_launch(default.var, s, b * h, 1, default.grid[0], 2)
        if not default.var.cfg.persistent or launch is None:
            print(f"{shape}: {default.var.cfg.name} walks no sections; skipped")
            continue
        figs = {w: figures(launch, w) for w in range(0, min(b * h, WIDTHS_TRIED) + 1)}  # balance, running K/V bytes
        widths = sorted(set(_pareto({w: f for w, f in figs.items() if w}) + [w for w in extra if w and w in figs]))
        plans = {"model": default, "kernel": _plan(q, k, v, "0")} | {str(w): _plan(q, k, v, str(w)) for w in widths}
        impls = {name: (lambda p=p: run_fwd(p, q, k, v, None)) for name, p in plans.items()}
        if (fn := sdpa_call(SDPBackend.CUDNN_ATTENTION, q, k, v, causal=True)) is not None:
            impls["cuDNN"] = fn
        cells.append(((d, s, h, b), plans, impls, figs, {name: [] for name in impls}))
    for r in range(int(args.rounds)):
        for _, _, impls, _, samples in cells:
            names = [name for name in impls if name != "cuDNN"]
            for name in names[r % len(names):] + names[:r % len(names)] + ["cuDNN"] * ("cuDNN" in impls):
                samples[name].append(timer(impls[name]))
    rows = []
    print("TFLOP/s, bf16, causal; width: the plan's section_pairs (0: the kernel's rule); the model's balance "
          "(busiest CTA / mean) and mean running K/V (MiB)")
    print(f"{'d':>4}{'s':>7}{'h':>4}{'b':>4} {'plan':>7}{'width':>6}{'balance':>9}{'K/V':>6}{'TFLOP/s':>9}"
          f"{'vs kernel':>10}")
    for (d, s, h, b), plans, impls, figs, samples in cells:
        flops = 2 * b * h * d * s * s
        tflops = {name: flops / (statistics.median(ms) * 1e-3) / 1e12 for name, ms in samples.items()}
        for name in impls:
            width = plans[name].section_pairs if name in plans else None
            bal, kv = figs[width] if width is not None else (None, None)
            rows.append({"hdim": d, "seqlen": s, "nheads": h, "batch": b, "plan": name, "section_pairs": width,
                         "config": plans[name].var.cfg.name if name in plans else None, "balance": bal,
                         "running_kv_mib": None if kv is None else kv / 2**20, "samples_ms": samples[name],
                         "tflops": tflops[name]})
            model = "" if bal is None else f"{width:6}{bal:9.3f}{kv / 2**20:6.0f}"
            print(f"{d:4}{s:7}{h:4}{b:4} {name:>7}{model:>21}{tflops[name]:9.1f}"
                  f"{tflops[name] / tflops['kernel'] - 1:+10.1%}")
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
