"""Chunks of queries over a KV cache (chunked prefill, speculative decoding): flash_attn_with_kvcache with
tensor cache_seqlens over a contiguous and a paged cache, where on sm90 the Hopper kernel's cache form runs from
64 query rows per KV head (fwd_tilings.cache_chunk_runs_hopper) and the portable kernel below.

    python benchmarks/bench_kvcache_chunks.py [--seqlen-q 1,16,64,256,1024] [--seqlen-k 8192,32768]
                                              [--json bench_kvcache_chunks.json]

bf16, head dim 128, GQA 32 query / 8 KV heads, batch 1 and 4, every entry's length the same (seqlen_k), no mask.
Timed side by side (median of triton.testing.do_bench, L2 flushed between calls), TFLOP/s = 4 * b * h * d * sq *
sk / time:
- "auto": flash_gen's choice (the Hopper cache form or the portable kernel), contiguous cache ("c") and pages of
  256 rows ("p");
- "portable", "hopper": the runtime forced to that kernel's default tiling, both layouts;
- "dense": the dense kernel (the Hopper kernel on sm90) over views of the cache's first rows, as an int
  cache_seqlens runs where the query tiles fill the SMs: what the cache form should reach;
- "cuDNN": SDPA's cuDNN backend on dense K/V of the used rows. GPU only.
"""

from __future__ import annotations

import sys

import torch
from torch.nn.attention import SDPBackend

from bench_common import sdpa_call, setup, write_rows
from flash_gen import fwd_tilings
from flash_gen.runtime import driver
from flash_gen.runtime.fwd import attention_fwd
from flash_gen.runtime.fwd_kvcache import KvCache, attention_fwd_kvcache
from flash_gen.spec import FwdKey

NHEADS, NHEADS_K, HDIM, PAGE = 32, 8, 128, 256
BATCHES = (1, 4)


def main() -> int:
    if (ready := setup(__doc__, seqlen_q="1,16,64,256,1024", seqlen_k="8192,32768")) is None:
        return 2
    args, timer = ready
    score = dict(softmax_scale=HDIM**-0.5, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None)
    key = FwdKey(driver.device_arch(0), "bf16", HDIM, kv="cache", pack_gqa=True)
    forced = {"portable": fwd_tilings.portable_config(key), "hopper": fwd_tilings.default_config(key)}
    names = ("auto_c", "portable_c", "hopper_c", "auto_p", "portable_p", "hopper_p", "dense", "cuDNN")
    rows = []
    print(f"TFLOP/s, bf16, GQA {NHEADS}/{NHEADS_K}, head dim {HDIM}, no mask, cache capacity = seqlen_k + 1024")
    print(f"{'b':>2}{'sq':>6}{'sk':>7} |" + "".join(f"{n:>11}" for n in names) + " | auto_c/dense auto_c/cuDNN")
    for sk in map(int, args.seqlen_k.split(",")):
        for batch in BATCHES:
            for sq in map(int, args.seqlen_q.split(",")):
                gen = torch.Generator(device="cuda").manual_seed(sq * 1000 + batch)
                randn = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=torch.bfloat16)  # noqa: E731
                capacity = sk + 1024  # rows past each entry's length: the cache forms must mask them
                q = randn(batch, sq, NHEADS, HDIM)
                k, v = randn(batch, capacity, NHEADS_K, HDIM), randn(batch, capacity, NHEADS_K, HDIM)
                pages = capacity // PAGE
                table = torch.randperm(batch * pages, device="cuda").view(batch, pages).to(torch.int32)
                k_paged = torch.empty(batch * pages, PAGE, NHEADS_K, HDIM, device="cuda", dtype=torch.bfloat16)
                v_paged = torch.empty_like(k_paged)
                k_paged[table.flatten().long()] = k.view(batch * pages, PAGE, NHEADS_K, HDIM)
                v_paged[table.flatten().long()] = v.view(batch * pages, PAGE, NHEADS_K, HDIM)
                lens = torch.full((batch,), sk, dtype=torch.int32, device="cuda")

                def cache_call(kc, vc, bt, config=None):
                    cache = KvCache(lens, None, None, None, bt, 0)
                    return lambda: attention_fwd_kvcache(q, kc, vc, cache, **score, config=config)

                impls = {}
                for suffix, kc, vc, bt in (("c", k, v, None), ("p", k_paged, v_paged, table)):
                    impls[f"auto_{suffix}"] = cache_call(kc, vc, bt)
                    impls.update({f"{name}_{suffix}": cache_call(kc, vc, bt, cfg) for name, cfg in forced.items()})
                impls["dense"] = lambda: attention_fwd(q, k[:, :sk], v[:, :sk], **score)
                if (fn := sdpa_call(SDPBackend.CUDNN_ATTENTION, q, k[:, :sk], v[:, :sk])) is not None:
                    impls["cuDNN"] = fn
                ref = impls["dense"]()[0].float()
                maxdiff = {n: (impls[n]()[0].float() - ref).abs().max().item() for n in names[:6]}
                flops = 4 * batch * NHEADS * HDIM * sq * sk
                row = {"batch": batch, "seqlen_q": sq, "seqlen_k": sk, "maxdiff_vs_dense": maxdiff}
                row.update({n: flops / (timer(fn) * 1e-3) / 1e12 for n, fn in impls.items()})
                rows.append(row)
                cells = "".join(f"{row[n]:11.1f}" if n in row else f"{'-':>11}" for n in names)
                ratio = f"{row['auto_c'] / row['cuDNN']:12.2f}" if "cuDNN" in row else f"{'-':>12}"
                print(f"{batch:2}{sq:6}{sk:7} |{cells} | {row['auto_c'] / row['dense']:12.2f}{ratio}")
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
