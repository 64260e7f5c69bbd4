"""Where a batch-1 decoding step's time goes: the CUDA-graph replay time of flash_attn_with_kvcache per num_splits,
with each kernel's GPU time (torch.profiler) beside a plain read (sum) and copy of the same K/V bytes.

    python benchmarks/profile_decode.py [--cache 8192,32768] [--num-splits 0,16,33,66]

GQA 32 query / 8 KV heads, head dim 128, bf16, one query row, contiguous cache, as bench_decode.py; every
replay starts with L2 flushed (triton.testing.do_bench, and a 256 MiB memset before each profiled replay).
GPU only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

import flash_gen

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import HDIM, NHEADS, NHEADS_K, graphed  # noqa: E402


def kernel_times(replay, flush: torch.Tensor, rounds: int = 20) -> dict[str, float]:
    """Median GPU µs of each kernel a replay runs (the L2 flush excluded)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            flush.zero_()
            replay()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and "flash_gen" in e.name:
            times.setdefault(e.name, []).append(e.device_time_total)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", default="8192,32768")
    p.add_argument("--num-splits", default="0,16,33,66", help="0: flash_gen's heuristic")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("profile_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    flush = torch.empty(2**28, dtype=torch.int8, device="cuda")
    for length in (int(x) for x in args.cache.split(",")):
        q = torch.randn(1, 1, NHEADS, HDIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, length, NHEADS_K, HDIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        seqlens = torch.full((1,), length, dtype=torch.int32, device="cuda")
        kv = torch.cat([k.flatten(), v.flatten()])
        mb = kv.numel() * kv.element_size() / 1e6
        dst = torch.empty_like(kv)
        t_sum = do_bench(graphed(lambda: kv.sum(dtype=torch.float32)), return_mode="median") * 1e3
        t_copy = do_bench(graphed(lambda: dst.copy_(kv)), return_mode="median") * 1e3
        print(f"cache {length}: {mb:.1f} MB of K/V; read (sum) {t_sum:.1f} us, copy {t_copy:.1f} us")
        for splits in (int(x) for x in args.num_splits.split(",")):
            replay = graphed(lambda: flash_gen.flash_attn_with_kvcache(  # noqa: B023 - called in this iteration
                q, k, v, cache_seqlens=seqlens, causal=True, num_splits=splits))
            t = do_bench(replay, return_mode="median") * 1e3
            parts = ", ".join(f"{name}: {us:.1f}" for name, us in kernel_times(replay, flush).items())
            print(f"  num_splits {splits}: replay {t:.1f} us ({mb / t:.2f} TB/s) | kernels, us: {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
