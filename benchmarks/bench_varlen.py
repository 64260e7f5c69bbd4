"""Packed-training benchmark (issue 4): a ragged batch through flash_attn_varlen_func against the dense kernel
at equal useful work and against SDPA on the padded batch, forward and forward+backward.

    python benchmarks/bench_varlen.py [--hdim 128] [--total-tokens 32768] [--min-len 128] [--max-len 8192]
                                      [--directions fwd,fwd+bwd]

The batch: lengths drawn uniformly from [min-len, max-len] (seeded) until they fill total-tokens. Useful FLOPs
count each entry's own attention only: 4 * H * D * sum(len^2), halved for causal, x3.5 with the backward.
- dense-eq: flash_gen's dense kernel on total-tokens / S sequences of length S = sum(len^2) / total-tokens
  (rounded to 128), the same useful FLOPs in equal-length sequences: the "within 5%" yardstick.
- FA2/cuDNN padded: SDPA on the batch padded to its longest entry, without a padding mask (SDPA's FLASH and
  cuDNN paths take none here), so this is a lower bound on what padding costs; their TFLOP/s count useful FLOPs.
Medians of triton.testing.do_bench (flash_gen.bench.median_timer). GPU only.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from datetime import datetime, timezone

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_gen
from flash_gen.bench import median_timer

PEERS = {"FA2 padded": SDPBackend.FLASH_ATTENTION, "cuDNN padded": SDPBackend.CUDNN_ATTENTION}


def ragged_lengths(total: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < total:
        lens.append(min(rng.randint(lo, hi), total - sum(lens)))
    if len(lens) > 1 and lens[-1] < lo:  # fold a short remainder into the previous entry
        lens[-2] += lens.pop()
    return lens


def _step(fn, inputs: tuple, dout: torch.Tensor | None):
    out = fn(*inputs)
    return out if dout is None else torch.autograd.grad(out, inputs, dout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--model-dim", type=int, default=2048)
    p.add_argument("--total-tokens", type=int, default=32768)
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--directions", default="fwd,fwd+bwd", help="comma list of fwd and fwd+bwd")
    p.add_argument("--json", default="bench_varlen.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_varlen needs a CUDA GPU", file=sys.stderr)
        return 2
    timer_name, timer = median_timer()
    lens = ragged_lengths(args.total_tokens, args.min_len, args.max_len, args.seed)
    d, h, total = args.hdim, args.model_dim // args.hdim, sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    s_eq = max(128, round(sum(x * x for x in lens) / total / 128) * 128)
    print(f"{len(lens)} entries, total {total}, max {max(lens)}; dense-eq: {total // s_eq} x {s_eq}; "
          f"hdim {d}, {h} heads, bf16", flush=True)
    randn = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731

    rows = []
    for direction in args.directions.split(","):
        for causal in (False, True):
            factor = (0.5 if causal else 1.0) * (3.5 if direction == "fwd+bwd" else 1.0)
            useful = 4 * h * d * sum(x * x for x in lens) * factor
            dense_flops = 4 * h * d * (total // s_eq) * s_eq * s_eq * factor
            grad = direction == "fwd+bwd"
            packed = tuple(randn(total, h, d) for _ in range(3))
            dense = tuple(randn(total // s_eq, s_eq, h, d) for _ in range(3))
            padded = tuple(randn(len(lens), h, max(lens), d) for _ in range(3))
            cells = {
                "flash_gen varlen": (lambda q, k, v: flash_gen.flash_attn_varlen_func(q, k, v, cu, cu, None, None,
                                                                                      causal=causal),
                                     packed, useful, None),
                "flash_gen dense-eq": (lambda q, k, v: flash_gen.flash_attn_func(q, k, v, causal=causal), dense,
                                       dense_flops, None),
            }
            for name, backend in PEERS.items():
                cells[name] = (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), padded,
                               useful, backend)
            row = {"direction": direction, "causal": causal, "tflops": {}, "errors": {}}
            for name, (fn, inputs, flops, backend) in cells.items():
                dout = torch.randn_like(inputs[0]) if grad else None
                try:
                    with sdpa_kernel(backend) if backend is not None else torch.enable_grad():
                        call = lambda: _step(fn, inputs, dout)  # noqa: E731
                        call()
                        torch.cuda.synchronize()
                        row["tflops"][name] = flops / (timer(call) * 1e-3) / 1e12
                except Exception as e:  # an unavailable peer shows n/a
                    row["tflops"][name] = None
                    row["errors"][name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            rows.append(row)
            print(row, flush=True)

    names = list(rows[0]["tflops"])
    print(f"\nPacked training, {len(lens)} entries ({args.min_len}..{args.max_len}), total {total}, hdim {d}, "
          f"{h} heads, bf16 on {torch.cuda.get_device_name()}; TFLOP/s of useful work ({timer_name})")
    print("| direction | causal | " + " | ".join(names) + " | varlen/dense-eq | varlen/best padded |")
    print("|---" * (len(names) + 4) + "|")
    for r in rows:
        t = r["tflops"]
        pads = [t[n] for n in PEERS if t.get(n)]
        ratio_dense = t["flash_gen varlen"] / t["flash_gen dense-eq"] if t["flash_gen dense-eq"] else None
        ratio_pad = t["flash_gen varlen"] / max(pads) if pads else None
        fmt = lambda x: "n/a" if x is None else f"{x:.2f}" if x < 10 else f"{x:.0f}"  # noqa: E731
        print(f"| {r['direction']} | {'yes' if r['causal'] else 'no'} | " + " | ".join(fmt(t[n]) for n in names)
              + f" | {fmt(ratio_dense)} | {fmt(ratio_pad)} |")
    with open(args.json, "w") as f:
        json.dump({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "device": torch.cuda.get_device_name(), "torch": torch.__version__, "lengths": lens,
                   "dense_eq": [total // s_eq, s_eq], "settings": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
