"""One shape's flash_gen forward, three calls, for `ncu` (the main table's shapes: 32768 tokens, 2048 / hdim heads):

    ncu --clock-control none -k regex:fwd_sm90 -s 1 -c 1 --section SpeedOfLight --section Occupancy \
        --section ComputeWorkloadAnalysis python3 benchmarks/profile_fwd_sm90.py causal   # or: none
    FLASH_GEN_FWD_CONFIG=wgm128n128s2p_persist ncu ... python3 benchmarks/profile_fwd_sm90.py none --hdim 128

Defaults: head dim 64, seqlen 2048 (the Hopper kernel's weakest cell when this was written).
"""

from __future__ import annotations

import argparse

import torch

import flash_gen

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("mask", choices=["causal", "none"])
    ap.add_argument("--hdim", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=2048)
    args = ap.parse_args()
    shape = (32768 // args.seqlen, args.seqlen, 2048 // args.hdim, args.hdim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):
        flash_gen.flash_attn_func(q, k, v, causal=args.mask == "causal")
    torch.cuda.synchronize()
