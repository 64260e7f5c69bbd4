"""One shape's flash_gen forward, three calls, for `ncu` (hdim 64, 2k, the Hopper kernel's weakest cell):

    ncu --clock-control none -k regex:fwd_sm90 -s 1 -c 1 --section SpeedOfLight --section Occupancy \
        --section ComputeWorkloadAnalysis python3 benchmarks/profile_fwd_sm90.py causal   # or: none
"""

from __future__ import annotations

import sys

import torch

import flash_gen

if __name__ == "__main__":
    causal = sys.argv[1:] == ["causal"]
    q, k, v = (torch.randn(16, 2048, 32, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):
        flash_gen.flash_attn_func(q, k, v, causal=causal)
    torch.cuda.synchronize()
