"""Split-KV on dense calls: few query tiles against many keys (decoding or a short chunk through
flash_attn_func), where an unsplit launch leaves most SMs idle.

    python benchmarks/bench_dense_split.py [--seqlen-q 1,64,128,256,512] [--seqlen-k 2048,4096,8192,32768]
                                           [--json bench_dense_split.json]

bf16, head dim 128, 8 KV heads with groups of 1 and 8 query heads, batch 1 and 4, no mask. Timed side by side:
flash_gen's flash_attn_func (splits where runtime.fwd._split_plan says so), the runtime forced to 1 (never split),
2, 4, 8 and 16 splits (each planned once, as flash_attn_func's repeated calls are), and SDPA's cuDNN backend.
Median of triton.testing.do_bench (L2 flushed between calls), TFLOP/s = 4 * b * h * d * sq * sk / time. GPU only.
"""

from __future__ import annotations

import sys

import torch
from torch.nn.attention import SDPBackend

import flash_gen
from bench_common import sdpa_call, setup, write_rows
from flash_gen.runtime.fwd import plan_fwd, run_fwd

NHEADS_K, HDIM = 8, 128
BATCHES, GROUPS, SPLITS = (1, 4), (1, 8), (1, 2, 4, 8, 16)


def main() -> int:
    if (ready := setup(__doc__, seqlen_q="1,64,128,256,512", seqlen_k="2048,4096,8192,32768")) is None:
        return 2
    args, timer = ready
    score = dict(softmax_scale=HDIM**-0.5, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None)
    rows = []
    print(f"TFLOP/s, bf16, {NHEADS_K} KV heads, head dim {HDIM}, no mask; 'splits' is the default's choice")
    print(f"{'b':>2}{'group':>6}{'sq':>5}{'sk':>7}{'splits':>7} | {'default':>8}"
          + "".join(f"{f'x{s}':>8}" for s in SPLITS) + f"{'cuDNN':>8} | {'default/x1':>10}{'default/cuDNN':>14}")
    for sk in map(int, args.seqlen_k.split(",")):
        for batch in BATCHES:
            for group in GROUPS:
                for sq in map(int, args.seqlen_q.split(",")):
                    gen = torch.Generator(device="cuda").manual_seed(sq * 1000 + group * 10 + batch)
                    randn = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=torch.bfloat16)  # noqa
                    q = randn(batch, sq, NHEADS_K * group, HDIM)
                    k, v = randn(batch, sk, NHEADS_K, HDIM), randn(batch, sk, NHEADS_K, HDIM)
                    impls = {"default": lambda: flash_gen.flash_attn_func(q, k, v)}
                    plans = {s: plan_fwd(q, k, v, **score, num_splits=s) for s in SPLITS}
                    impls.update({f"x{s}": (lambda p=p: run_fwd(p, q, k, v, None)) for s, p in plans.items()})
                    if (fn := sdpa_call(SDPBackend.CUDNN_ATTENTION, q, k, v)) is not None:
                        impls["cuDNN"] = fn
                    flops = 4 * batch * NHEADS_K * group * HDIM * sq * sk
                    row = {"batch": batch, "group": group, "seqlen_q": sq, "seqlen_k": sk,
                           "splits": plan_fwd(q, k, v, **score).splits,
                           "x1_vs_x4_maxdiff": (impls["x1"]()[0].float() - impls["x4"]()[0].float()).abs().max().item()}
                    row.update({name: flops / (timer(fn) * 1e-3) / 1e12 for name, fn in impls.items()})
                    rows.append(row)
                    cudnn = f"{row['cuDNN']:8.1f}" if "cuDNN" in row else f"{'-':>8}"
                    ratio = f"{row['default'] / row['cuDNN']:14.2f}" if "cuDNN" in row else f"{'-':>14}"
                    print(f"{batch:2}{group:6}{sq:5}{sk:7}{row['splits']:7} | {row['default']:8.1f}"
                          + "".join(f"{row[f'x{s}']:8.1f}" for s in SPLITS)
                          + f"{cudnn} | {row['default'] / row['x1']:10.2f}{ratio}")
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
