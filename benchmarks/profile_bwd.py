"""One forward+backward step of flash_gen and of a peer (SDPA's FA2 by default, its cuDNN, or FlashAttention-4)
on one shape, for a profiler to capture, or (--times) each kernel's GPU time per step under torch.profiler:

    ncu --clock-control none -k regex:bwd --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 benchmarks/profile_bwd.py --hdim 128 --seqlen 4096
    python3 benchmarks/profile_bwd.py --hdim 256 --seqlen 2048 --peer cudnn --times

Shapes of shared/ANCHORS.md (bf16, 32768 tokens, 2048 / head dim heads). GPU only.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from flash_gen import flash_attn_func
from flash_gen.bench import OWN_PEERS, PEERS, fa4_attention


def print_kernel_times(name: str, step, rounds: int = 5) -> None:
    """Each kernel's GPU µs per call of `step` (after warm-up calls), largest first."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            step()
        torch.cuda.synchronize()
    rows = sorted(((e.device_time_total / rounds, e.key) for e in prof.key_averages() if e.device_time_total > 0),
                  reverse=True)
    print(f"{name}: {sum(us for us, _ in rows):.0f} us per fwd+bwd")
    for us, key in rows:
        print(f"  {us:9.1f} us  {key[:100]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--peer", choices=sorted([*PEERS, *OWN_PEERS]), default="flash",
                        help="SDPA backend (flash, cudnn) or fa4, run beside flash_gen")
    parser.add_argument("--times", action="store_true", help="print per-kernel GPU times (torch.profiler)")
    args = parser.parse_args()
    batch, heads = max(1, 32768 // args.seqlen), 2048 // args.hdim
    q, k, v, dout = (torch.randn(batch, args.seqlen, heads, args.hdim, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def ours() -> None:
        torch.autograd.grad(flash_attn_func(q, k, v, causal=args.causal), (q, k, v), dout)

    def peer() -> None:
        if args.peer in OWN_PEERS:
            torch.autograd.grad(fa4_attention(q, k, v, args.causal), (q, k, v), dout)
            return
        with sdpa_kernel(PEERS[args.peer]):
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=args.causal)
            torch.autograd.grad(out.transpose(1, 2), (q, k, v), dout)

    if args.times:
        print_kernel_times("flash_gen", ours)
        print_kernel_times(args.peer, peer)
        return
    for _ in range(2):  # the second round is the one to look at: kernels loaded, caches warm
        ours()
        peer()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
