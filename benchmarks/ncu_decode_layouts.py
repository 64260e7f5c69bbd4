"""One decoding step per cache layout, for Nsight Compute to compare the kernels (issue 4's paged path):

    ncu --clock-control none --set full -k regex:fwd_sm90_bf16_hd128_none_split --launch-skip 2 --launch-count 2 \
        -o decode python3 benchmarks/ncu_decode_layouts.py [--batch 8 --cache 8192 --page 16 --seqlen-q 1]

GQA 32 query / 8 KV heads, head dim 128, bf16, causal, as bench_decode.py (with --seqlen-q 4 the kernels are the
causal ones: -k regex:fwd_sm90_bf16_hd128_causal_split): a contiguous cache, then the same
bytes as a paged cache (identity block table); each step runs twice (the first pair warms up) and the results must
agree exactly. GPU only.
"""

from __future__ import annotations

import argparse

import torch

import flash_gen
from bench_decode import HDIM, NHEADS, NHEADS_K


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--cache", type=int, default=8192)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--seqlen-q", type=int, default=1)
    args = p.parse_args()
    b, length, page = args.batch, args.cache, args.page
    q = torch.randn(b, args.seqlen_q, NHEADS, HDIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, length, NHEADS_K, HDIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    seqlens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    table = torch.arange(b * (length // page), dtype=torch.int32, device="cuda").view(b, -1)
    k_paged, v_paged = k.view(-1, page, NHEADS_K, HDIM), v.view(-1, page, NHEADS_K, HDIM)
    for _ in range(2):
        contiguous = flash_gen.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True)
        paged = flash_gen.flash_attn_with_kvcache(q, k_paged, v_paged, cache_seqlens=seqlens, block_table=table,
                                                  causal=True)
    torch.cuda.synchronize()
    if not torch.equal(contiguous, paged):
        raise SystemExit(f"paged and contiguous differ: {(contiguous - paged).abs().max().item()}")


if __name__ == "__main__":
    main()
