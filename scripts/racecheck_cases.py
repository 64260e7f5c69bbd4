"""Hopper forward and backward calls whose warpgroups share or hand over shared memory in the ways race checking
should see, to run under `compute-sanitizer --tool racecheck` on an sm90 GPU:

    compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/racecheck_cases.py

- causal and windowed calls through tilings whose warpgroups skip or halve their last key steps;
- persistent tilings with more query tiles than CTAs, so each CTA stages O for several tiles in its own buffer
  while the previous tile's TMA stores may still read it, or (head dim 256) in the V ring the next tile loads;
- max-free steps ("_mf") on keys scaled up along the sequence, so that warps take the repair that reads Q and the
  held K stage from shared memory again (warp_scores.cuh) before releasing them;
- backward tilings that stage dS and dQ in shared memory between the warpgroups (bulk dQ, decoupled warpgroups
  with double-buffered dS), at head dims computed as 96 (other swizzles and dQ boxes) and 128.
Only races are checked here (the GPU tests check results). The tilings are those of tests/test_fwd_sm90_gpu.py,
tests/test_bwd_gpu.py's TILINGS and the shipped tuning database (prebuilt by scripts/prebuild_gpu_test_kernels.py).
"""

from __future__ import annotations

import torch

from flash_gen import bwd_tilings, fwd_tilings
from flash_gen.runtime.bwd import attention_bwd
from flash_gen.runtime.fwd import attention_fwd

CASES = [  # dtype, head dim, tiling, batch, seqlen_q, seqlen_k, heads, causal, window
    # head dim 256, 2 x 40 heads of 9 query tiles: O staged in the V ring, each CTA's next first V load waiting for
    # its O stores
    (torch.bfloat16, 256, "wgm128n80s2p_persist", 2, 1100, 1100, 40, True, (-1, -1)),
    (torch.bfloat16, 256, "wgm128n80s2p_persist", 2, 1100, 900, 40, True, (-1, -1)),  # empty tiles
    (torch.bfloat16, 64, "wgm192n128s4_persist", 1, 1000, 1300, 2, True, (-1, -1)),
    (torch.bfloat16, 128, "wgm128n128s2p_persist", 1, 1000, 1300, 2, True, (-1, -1)),
    (torch.bfloat16, 128, "wgm128n128s2_persist", 1, 1000, 700, 2, True, (-1, -1)),
    (torch.bfloat16, 64, "wgm192n112s4_serial_persist", 1, 777, 555, 2, True, (-1, -1)),
    (torch.bfloat16, 256, "wgm128n32s2p_serial_persist", 1, 300, 900, 2, False, (32, 0)),
    (torch.float16, 64, "wgm192n128s2p", 1, 700, 700, 2, True, (-1, -1)),
    # 2 x 40 heads of 9-11 query tiles: more tiles than an H200's 132 CTAs
    (torch.bfloat16, 128, "wgm128n128s2_persist", 2, 1100, 1100, 40, True, (-1, -1)),
    (torch.bfloat16, 128, "wgm128n128s2p_persist", 2, 1100, 900, 40, False, (-1, -1)),
    (torch.bfloat16, 128, "wgm192n80s3_persist", 2, 1100, 1100, 40, True, (-1, -1)),
    (torch.bfloat16, 64, "wgm192n128s4_persist", 2, 1300, 1300, 40, True, (-1, -1)),
    # head dim 72 with aligned rows: odd heads' O staged rotated back by one 8-column block
    (torch.bfloat16, 72, "wgm192n96s4p_al_persist", 2, 1100, 1100, 40, True, (-1, -1)),
    # max-free steps, two and three consumer warpgroups (rising keys)
    (torch.bfloat16, 128, "wgm128n128s2p_mf_persist", 1, 1000, 1300, 2, False, (-1, -1)),
    (torch.bfloat16, 64, "wgm192n128s3_mf_persist", 1, 1000, 1300, 2, True, (-1, -1)),
    (torch.bfloat16, 128, "wgm192n80s3_mf_persist", 2, 1100, 1100, 40, False, (-1, -1)),
]


BWD_CASES = [  # dtype, head dim, backward tiling, batch, seqlen_q, seqlen_k, heads, KV heads, causal
    (torch.bfloat16, 80, "wgbm64n128ob_h96", 1, 333, 517, 4, 2, False),  # computed as 96
    (torch.bfloat16, 96, "wgbm64n128obd_h96", 2, 300, 300, 2, 2, False),
    (torch.bfloat16, 96, "wgbm64n128b_h96", 1, 517, 333, 2, 1, True),
    (torch.float16, 72, "wgbm64n128o_h96", 1, 517, 333, 2, 1, False),
    (torch.bfloat16, 128, "wgbm80n128b", 1, 333, 517, 4, 2, False),
    (torch.float16, 128, "wgbm64n128obd", 1, 300, 300, 2, 2, True),
]


def main() -> None:
    for dtype, head_dim, name, batch, seqlen_q, seqlen_k, heads, causal, window in CASES:
        q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=dtype)
        k, v = (torch.randn(batch, seqlen_k, heads, head_dim, device="cuda", dtype=dtype) for _ in range(2))
        if "_mf" in name:
            k = k * torch.linspace(0.25, 6.0, seqlen_k, device="cuda")[None, :, None, None].to(dtype)
        attention_fwd(q, k, v, softmax_scale=head_dim**-0.5, causal=causal, window_size=window, softcap=0.0,
                      alibi_slopes=None, config=fwd_tilings.config_from_name(name))
    for dtype, head_dim, name, batch, seqlen_q, seqlen_k, heads, heads_k, causal in BWD_CASES:
        q, dout = (torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=dtype) for _ in range(2))
        k, v = (torch.randn(batch, seqlen_k, heads_k, head_dim, device="cuda", dtype=dtype) for _ in range(2))
        common = dict(softmax_scale=head_dim**-0.5, causal=causal, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None)
        out, lse = attention_fwd(q, k, v, **common)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        attention_bwd(dout, q, k, v, out, lse, *grads, deterministic=False,
                      config=bwd_tilings.config_from_name(name), **common)
    torch.cuda.synchronize()
    print(f"racecheck_cases: {len(CASES) + len(BWD_CASES)} calls completed")


if __name__ == "__main__":
    main()
