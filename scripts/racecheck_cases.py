"""Hopper forward calls whose warpgroups share or hand over shared memory in the ways race checking should see, to
run under `compute-sanitizer --tool racecheck` on an sm90 GPU:

    compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/racecheck_cases.py

- causal and windowed calls through tilings whose warpgroups skip or halve their last key steps;
- persistent tilings with more query tiles than CTAs, so each CTA stages O for several tiles in its own buffer
  while the previous tile's TMA stores may still read it, or (head dim 256) in the V ring the next tile loads.
Only races are checked here (the GPU tests check results). The tilings are those of tests/test_fwd_sm90_gpu.py
and the shipped tuning database (prebuilt by scripts/prebuild_gpu_test_kernels.py).
"""

from __future__ import annotations

import torch

from flash_gen import fwd_tilings
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
]


def main() -> None:
    for dtype, head_dim, name, batch, seqlen_q, seqlen_k, heads, causal, window in CASES:
        q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=dtype)
        k, v = (torch.randn(batch, seqlen_k, heads, head_dim, device="cuda", dtype=dtype) for _ in range(2))
        attention_fwd(q, k, v, softmax_scale=head_dim**-0.5, causal=causal, window_size=window, softcap=0.0,
                      alibi_slopes=None, config=fwd_tilings.config_from_name(name))
    torch.cuda.synchronize()
    print(f"racecheck_cases: {len(CASES)} calls completed")


if __name__ == "__main__":
    main()
