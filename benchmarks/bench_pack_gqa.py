"""Pack-GQA on the forward (issue 7): dense GQA calls with few query positions against many keys (chunked
prefill, a speculative decoder's verify step), where unpacked query tiles run mostly empty rows.

    python benchmarks/bench_pack_gqa.py [--seqlen-q 1,16,64,128,256,512] [--json bench_pack_gqa.json]

bf16, head dim 128, 8 KV heads with groups of 4 and 8 query heads, batch 4, seqlen_k 8192. Timed side by side:
flash_gen's flash_attn_func (the runtime packs where fwd_tilings.pack_gqa_pays says so), the runtime forced
packed and forced unpacked, and SDPA's cuDNN and FLASH backends (enable_gqa, else K/V expanded to every query
head beforehand, outside the timing). Masks: none, and causal for flash_gen alone (SDPA aligns a causal mask
top-left when seqlen_q != seqlen_k, flash_attn bottom-right). Median of triton.testing.do_bench (L2 flushed
between calls); TFLOP/s count 4 * b * h * d per (query, key) pair a row sees: sq * sk pairs, or under the causal
mask sq * (sk - sq) + sq * (sq + 1) / 2. GPU only.
"""

from __future__ import annotations

import sys

import torch
from torch.nn.attention import SDPBackend

import flash_gen
from bench_common import sdpa_call, setup, write_rows
from flash_gen.runtime.fwd import attention_fwd

BATCH, NHEADS_K, HDIM, SEQLEN_K = 4, 8, 128, 8192
GROUPS = (4, 8)
PEERS = {"cuDNN": SDPBackend.CUDNN_ATTENTION, "FA2": SDPBackend.FLASH_ATTENTION}


def main() -> int:
    if (ready := setup(__doc__, seqlen_q="1,16,64,128,256,512")) is None:
        return 2
    args, timer = ready
    rows = []
    header = f"{'mask':7}{'group':>6}{'sq':>6} | {'default':>8}{'packed':>8}{'unpacked':>9}{'cuDNN':>8}{'FA2':>8} | " \
             f"{'packed/unpacked':>15}{'default/cuDNN':>14}"
    print("TFLOP/s, bf16, batch 4, 8 KV heads, head dim 128, seqlen_k 8192\n" + header)
    for causal in (False, True):
        for group in GROUPS:
            for sq in map(int, args.seqlen_q.split(",")):
                gen = torch.Generator(device="cuda").manual_seed(sq * 100 + group)
                q = torch.randn(BATCH, sq, NHEADS_K * group, HDIM, generator=gen, device="cuda", dtype=torch.bfloat16)
                k, v = (torch.randn(BATCH, SEQLEN_K, NHEADS_K, HDIM, generator=gen, device="cuda",
                                    dtype=torch.bfloat16) for _ in range(2))
                runtime = dict(softmax_scale=HDIM**-0.5, causal=causal, window_size=(-1, 0) if causal else (-1, -1),
                               softcap=0.0, alibi_slopes=None)
                impls = {
                    "default": lambda: flash_gen.flash_attn_func(q, k, v, causal=causal),
                    "packed": lambda: attention_fwd(q, k, v, **runtime, pack_gqa=True),
                    "unpacked": lambda: attention_fwd(q, k, v, **runtime, pack_gqa=False),
                }
                if not causal:
                    impls.update({name: fn for name, b in PEERS.items() if (fn := sdpa_call(b, q, k, v)) is not None})
                diff = (impls["packed"]()[0].float() - impls["unpacked"]()[0].float()).abs().max().item()
                pairs = sq * (SEQLEN_K - sq) + sq * (sq + 1) // 2 if causal else sq * SEQLEN_K
                flops = 4 * BATCH * NHEADS_K * group * HDIM * pairs
                row = {"causal": causal, "group": group, "seqlen_q": sq, "packed_vs_unpacked_maxdiff": diff}
                row.update({name: flops / (timer(fn) * 1e-3) / 1e12 for name, fn in impls.items()})
                rows.append(row)
                fmt = lambda name: f"{row[name]:8.1f}" if name in row else f"{'-':>8}"  # noqa: E731
                cudnn = f"{row['default'] / row['cuDNN']:14.2f}" if "cuDNN" in row else f"{'-':>14}"
                print(f"{'causal' if causal else 'none':7}{group:6}{sq:6} | {fmt('default')}{fmt('packed')}"
                      f"{row['unpacked']:9.1f}{fmt('cuDNN')}{fmt('FA2')} | {row['packed'] / row['unpacked']:15.2f}"
                      f"{cudnn}")
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
