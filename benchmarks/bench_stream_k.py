"""Stream-K on the Hopper forward: unmasked shapes whose query tiles leave a partial last round of the persistent
CTAs (batch-1 prefills, few heads per GPU), with and without it.

    python benchmarks/bench_stream_k.py [--shapes 128:2048:9:1,128:4608:8:1,...] [--json bench_stream_k.json]

Each shape is head dim : seqlen (queries = keys) : heads : batch, bf16. Timed side by side: flash_gen's
flash_attn_func (stream-K where runtime.fwd's StreamKPlan says it pays), the runtime planned without it
(FLASH_GEN_NO_STREAM_K), and SDPA's cuDNN backend. Median of triton.testing.do_bench (L2 flushed between calls),
TFLOP/s = 4 * b * h * d * s^2 / time. GPU only (sm_90 for stream-K).
"""

from __future__ import annotations

import os
import sys

import torch
from torch.nn.attention import SDPBackend

import flash_gen
from bench_common import sdpa_call, setup, write_rows
from flash_gen.runtime.fwd import plan_fwd, run_fwd

SHAPES = "128:2048:9:1,128:4608:8:1,128:3072:12:2,128:8192:5:1,256:2048:10:2,256:4096:9:1,128:2048:16:16"


def main() -> int:
    if (ready := setup(__doc__, shapes=SHAPES)) is None:
        return 2
    args, timer = ready
    rows = []
    print("TFLOP/s, bf16, no mask; 'rounds' of whole tiles + the tiles left, 'chunk' key steps per CTA of those")
    print(f"{'d':>4}{'s':>6}{'h':>4}{'b':>4}{'rounds':>10}{'chunk':>7} | {'default':>8}{'no SK':>8}{'cuDNN':>8} | "
          f"{'default/no SK':>13}{'default/cuDNN':>14}")
    for shape in args.shapes.split(","):
        d, s, h, b = map(int, shape.split(":"))
        gen = torch.Generator(device="cuda").manual_seed(d * s + h * 10 + b)
        q, k, v = (torch.randn(b, s, h, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        score = dict(softmax_scale=d**-0.5, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None)
        plan = plan_fwd(q, k, v, **score)
        os.environ["FLASH_GEN_NO_STREAM_K"] = "1"
        try:
            whole = plan_fwd(q, k, v, **score)
        finally:
            del os.environ["FLASH_GEN_NO_STREAM_K"]
        impls = {"default": lambda: flash_gen.flash_attn_func(q, k, v),
                 "no SK": lambda: run_fwd(whole, q, k, v, None)}
        if (fn := sdpa_call(SDPBackend.CUDNN_ATTENTION, q, k, v)) is not None:
            impls["cuDNN"] = fn
        sk = plan.stream_k
        row = {"hdim": d, "seqlen": s, "nheads": h, "batch": b, "config": plan.var.cfg.name,
               "rounds": None if sk is None else f"{sk.rounds}+{sk.left}", "chunk": None if sk is None else sk.chunk,
               "maxdiff_vs_no_sk": (impls["default"]().float() - impls["no SK"]()[0].float()).abs().max().item()}
        flops = 4 * b * h * d * s * s
        row.update({name: flops / (timer(fn) * 1e-3) / 1e12 for name, fn in impls.items()})
        rows.append(row)
        cudnn = row.get("cuDNN", float("nan"))
        print(f"{d:4}{s:6}{h:4}{b:4}{row['rounds'] or '-':>10}{row['chunk'] or 0:7} | {row['default']:8.1f}"
              f"{row['no SK']:8.1f}{cudnn:8.1f} | {row['default'] / row['no SK']:13.2f}{row['default'] / cudnn:14.2f}")
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
