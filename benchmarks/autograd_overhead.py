"""Where the host time of a forward + backward step goes (issue 6): torch.autograd.grad over a C++ node against a
Python autograd.Function (the kind flash_gen's eager path records), and flash_gen / SDPA-FLASH forwards with
gradient recording, with and without the backward. Host µs per call with the GPU asleep (bench_overhead.py's
method), median of 9 rounds of 40 calls; batch 1, seqlen 128, 4 heads, head dim 64, bf16. GPU only.

    python3 benchmarks/autograd_overhead.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_gen

sys.path.insert(0, str(Path(__file__).parent))
from bench_overhead import sleep_cycles_per_us, timed_round  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("autograd_overhead needs a CUDA GPU")
cyc = sleep_cycles_per_us()
x = torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn_like(x, requires_grad=True)
v = torch.randn_like(x, requires_grad=True)
g = torch.randn_like(x)


class Py(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a.mul(2)

    @staticmethod
    def backward(ctx, grad):
        return grad.mul(2)


class Py3(torch.autograd.Function):  # like flash_gen's: 3 inputs, 2 outputs (one non-differentiable), 3 new grads
    @staticmethod
    def forward(ctx, a, b, c):
        ctx.save_for_backward(a, b, c)
        out, lse = a.mul(2), a.new_empty((1, 4, 128), dtype=torch.float32)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad, _):
        a, b, c = ctx.saved_tensors
        return torch.empty_like(a), torch.empty_like(b), torch.empty_like(c)


def sdpa():
    return F.scaled_dot_product_attention(x.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


cases = {
    "C++ mul, grad": lambda: torch.autograd.grad(x.mul(2), x, g),
    "Python Function, grad": lambda: torch.autograd.grad(Py.apply(x), x, g),
    "Python Function x3, grad": lambda: torch.autograd.grad(Py3.apply(x, k, v)[0], (x, k, v), g),
    "flash_gen fwd (recording)": lambda: flash_gen.flash_attn_func(x, k, v),
    "flash_gen fwd+bwd": lambda: torch.autograd.grad(flash_gen.flash_attn_func(x, k, v), (x, k, v), g),
    "SDPA-FLASH fwd (recording)": sdpa,
    "SDPA-FLASH fwd+bwd": lambda: torch.autograd.grad(sdpa(), (x, k, v), g),
}
res = {name: [] for name in cases}
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    for fn in cases.values():
        for _ in range(30):
            fn()
    torch.cuda.synchronize()
    for _ in range(9):
        for name, fn in cases.items():
            us = None
            calls, sleep = 40, 40_000.0
            while us is None:
                us = timed_round(fn, calls, sleep, cyc)
                sleep *= 2
            res[name].append(us)
for name, r in res.items():
    print(f"{name:30s} {statistics.median(r):8.1f} µs (min {min(r):.1f})")
