"""Decoding benchmark (issue 4): flash_attn_with_kvcache reading a KV cache, as bandwidth against the card's
copy ceiling measured in the same run.

    python benchmarks/bench_decode.py [--seqlen-q 1,4] [--json bench_decode.json]

GQA 32 query / 8 KV heads, head dim 128, bf16; (batch, cache length) pairs from 1 x 8k to 128 x 8k (capped at
2^20 cached tokens); contiguous cache and paged caches with pages of 16 and 256 rows; cache_seqlens a tensor
(every entry full); num_splits from the heuristic. Bandwidth counts the K and V bytes the step must read
(2 * batch * cache_len * 8 heads * 128 * 2 B) over the median time of a CUDA-graph replay of one call (as
serving engines run decode steps; eager calls of small shapes measure Python launch overhead instead: --eager),
timed with triton.testing.do_bench via flash_gen.bench.median_timer; the ceiling is a device-to-device copy of
1 GiB (bytes read + written). SDPA (PyTorch's pick of backend, enable_gqa, unmasked) on the contiguous cache is
timed alongside. GPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

import flash_gen
from flash_gen.bench import median_timer

SHAPES = [(1, 8192), (1, 32768), (1, 131072), (8, 8192), (8, 32768), (32, 8192), (32, 32768), (128, 1024),
          (128, 8192)]
NHEADS, NHEADS_K, HDIM = 32, 8, 128


def graphed(fn):
    """fn captured in a CUDA graph (after a warm-up call on a side stream); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_ceiling(timer) -> float:
    src = torch.empty(2**29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / (timer(lambda: dst.copy_(src)) * 1e-3) / 1e12  # TB/s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen-q", default="1,4")
    p.add_argument("--json", default="bench_decode.json")
    p.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA-graph replays")
    p.add_argument("--num-splits", type=int, default=0, help="split-KV count (0: flash_gen's heuristic)")
    p.add_argument("--shapes", default="", help="batch x cache pairs, e.g. 1x8192,8x8192 (default: the table's)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    timer_name, timer = median_timer()
    ceiling = copy_ceiling(timer)
    print(f"copy ceiling {ceiling:.2f} TB/s ({timer_name})", flush=True)
    rows = []
    for sq in (int(x) for x in args.seqlen_q.split(",")):
        shapes = [tuple(int(x) for x in pair.split("x")) for pair in args.shapes.split(",")] if args.shapes else SHAPES
        for batch, length in shapes:
            q = torch.randn(batch, sq, NHEADS, HDIM, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(batch, length, NHEADS_K, HDIM, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
            kv_bytes = 2 * k.numel() * k.element_size()
            row = {"seqlen_q": sq, "batch": batch, "cache": length, "tbps": {}}
            cells = {"contiguous": (k, v, None)}
            for page in (16, 256):
                pages = length // page
                table = torch.arange(batch * pages, dtype=torch.int32, device="cuda").view(batch, pages)
                cells[f"paged {page}"] = (k.view(batch * pages, page, NHEADS_K, HDIM),
                                          v.view(batch * pages, page, NHEADS_K, HDIM), table)
            for name, (kc, vc, table) in cells.items():
                fn = lambda: flash_gen.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens,  # noqa: E731
                                                               block_table=table, causal=True,
                                                               num_splits=args.num_splits)
                fn()
                row["tbps"][name] = kv_bytes / (timer(fn if args.eager else graphed(fn)) * 1e-3) / 1e12
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            try:
                # Unmasked: SDPA's is_causal aligns to the top-left corner, which would hide almost the whole cache.
                sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)  # noqa: E731
                sdpa()
                row["tbps"]["SDPA contiguous"] = kv_bytes / (timer(sdpa if args.eager else graphed(sdpa)) * 1e-3) / 1e12
            except Exception as e:  # noqa: BLE001 - an unavailable peer shows n/a
                row["tbps"]["SDPA contiguous"] = None
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
            print(row, flush=True)
            del q, k, v, cells
    names = list(rows[0]["tbps"])
    mode = "eager calls" if args.eager else "CUDA-graph replays"
    print(f"\nDecoding, GQA {NHEADS}/{NHEADS_K} heads, hdim {HDIM}, bf16 on {torch.cuda.get_device_name()}, {mode}: "
          f"K/V TB/s (fraction of the {ceiling:.2f} TB/s copy ceiling)")
    print("| seqlen_q | batch | cache | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 3) + "|")
    for r in rows:
        cells = [f"{r['tbps'][n]:.2f} ({r['tbps'][n] / ceiling:.0%})" if r["tbps"][n] else "n/a" for n in names]
        print(f"| {r['seqlen_q']} | {r['batch']} | {r['cache']} | " + " | ".join(cells) + " |")
    with open(args.json, "w") as f:
        json.dump({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "device": torch.cuda.get_device_name(), "torch": torch.__version__, "ceiling_tbps": ceiling,
                   "mode": mode,
                   "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
