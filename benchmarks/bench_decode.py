"""Decoding benchmark (issue 4): flash_attn_with_kvcache reading a KV cache, as bandwidth against the card's
copy ceiling measured in the same run.

    python benchmarks/bench_decode.py [--seqlen-q 1,4] [--json bench_decode.json]

GQA 32 query / 8 KV heads, head dim 128, bf16; (batch, cache length) pairs from 1 x 8k to 128 x 8k (capped at
2^20 cached tokens); contiguous cache and paged caches with pages of 16 and 256 rows; cache_seqlens a tensor
(every entry full); num_splits from the heuristic. Bandwidth counts the K and V bytes a step must read
(2 * batch * cache_len * 8 heads * 128 * 2 B) over the step's time.

A step is timed as a model decodes: one CUDA graph (eager calls with --eager) runs the step for L layers, each
with its own cache, L chosen so the caches total at least 4x the L2 size; the step time is the median replay
time / L (CUDA events per replay, flash_gen.bench.events_median: do_bench's scheme without its flush). So no
step finds its K/V in L2, as when a model's other layers ran in between, and none pays for writing back dirty
lines either (--flush times one call after an L2 flush by triton.testing.do_bench instead,
as the tables before 2026-12-01 did: the flush leaves L2 full of dirty lines whose write-back the step then
pays). The ceiling is a device-to-device copy of 1 GiB (bytes read + written). Timed alongside: SDPA
(PyTorch's pick of backend, enable_gqa, unmasked) on the contiguous cache, and a read-only kernel summing
the same K/V bytes (triton), the floor of any kernel that reads them. GPU only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

import flash_gen
from flash_gen.bench import FALLBACK_L2_BYTES, events_median, median_timer

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


def read_kernel():
    """A triton kernel summing K and V (the floor of any kernel reading those bytes), or None without triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def read_sum(k, v, out, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        total = tl.sum(tl.load(k + offs).to(tl.float32)) + tl.sum(tl.load(v + offs).to(tl.float32))
        tl.atomic_add(out, total)

    out = torch.zeros(1, device="cuda")
    block = 8192
    return lambda k, v: read_sum[(k.numel() // block,)](k, v, out, BLOCK=block)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen-q", default="1,4")
    p.add_argument("--json", default="bench_decode.json")
    p.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA-graph replays")
    p.add_argument("--flush", action="store_true", help="time one call after an L2 flush instead of rotating caches")
    p.add_argument("--num-splits", type=int, default=0, help="split-KV count (0: flash_gen's heuristic)")
    p.add_argument("--shapes", default="", help="batch x cache pairs, e.g. 1x8192,8x8192 (default: the table's)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    timer_name, timer = median_timer()
    ceiling = copy_ceiling(timer)
    print(f"copy ceiling {ceiling:.2f} TB/s ({timer_name})", flush=True)
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size or FALLBACK_L2_BYTES
    read = read_kernel()
    rows = []
    for sq in (int(x) for x in args.seqlen_q.split(",")):
        shapes = [tuple(int(x) for x in pair.split("x")) for pair in args.shapes.split(",")] if args.shapes else SHAPES
        for batch, length in shapes:
            kv_bytes = 2 * batch * length * NHEADS_K * HDIM * 2
            layers = 1 if args.flush else max(2, math.ceil(4 * l2_bytes / kv_bytes))
            qs = [torch.randn(batch, sq, NHEADS, HDIM, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
            ks = [torch.randn(batch, length, NHEADS_K, HDIM, device="cuda", dtype=torch.bfloat16)
                  for _ in range(layers)]
            vs = [torch.randn_like(k) for k in ks]
            seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
            row = {"seqlen_q": sq, "batch": batch, "cache": length, "layers": layers, "tbps": {}}
            # Each column's arguments per layer, views made here so that eager timing sees only the calls.
            kvcache = {"contiguous": [(q, k, v, None) for q, k, v in zip(qs, ks, vs)]}
            for page in (16, 256):
                table = torch.arange(batch * (length // page), dtype=torch.int32, device="cuda").view(batch, -1)
                kvcache[f"paged {page}"] = [(q, k.view(-1, page, NHEADS_K, HDIM), v.view(-1, page, NHEADS_K, HDIM),
                                             table) for q, k, v in zip(qs, ks, vs)]
            steps = {name: (lambda i, layer_args=layer_args: flash_gen.flash_attn_with_kvcache(
                *layer_args[i][:3], cache_seqlens=seqlens, block_table=layer_args[i][3], causal=True,
                num_splits=args.num_splits)) for name, layer_args in kvcache.items()}
            # Peers, shown as n/a when unavailable. SDPA unmasked: its is_causal aligns to the top-left corner,
            # which would hide almost the whole cache.
            transposed = [tuple(t.transpose(1, 2) for t in qkv) for qkv in zip(qs, ks, vs)]
            peers = {"SDPA contiguous": lambda i: F.scaled_dot_product_attention(*transposed[i], enable_gqa=True)}
            if read is not None:
                peers["K/V read"] = lambda i: read(ks[i], vs[i])
            for name, step in {**steps, **peers}.items():
                def fn(step=step):
                    for i in range(layers):
                        step(i)
                try:
                    fn()
                    if args.flush:
                        ms = timer(fn if args.eager else graphed(fn))
                    else:
                        ms = events_median(fn if args.eager else graphed(fn)) / layers
                    row["tbps"][name] = kv_bytes / (ms * 1e-3) / 1e12
                except Exception as e:  # noqa: BLE001 - an unavailable peer shows n/a; flash_gen's errors raise
                    if name not in peers:
                        raise
                    row["tbps"][name] = None
                    row.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
            rows.append(row)
            print(row, flush=True)
            for held in (qs, ks, vs, kvcache, transposed):  # free this shape's caches before the next one's
                held.clear()
    names = list(rows[0]["tbps"])
    mode = ("eager calls" if args.eager else "CUDA-graph replays") + (
        ", one call after an L2 flush" if args.flush else ", each step on its own cache (caches >= 4x L2)")
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
                   "mode": mode, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
