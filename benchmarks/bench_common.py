"""What benchmarks/bench_{pack_gqa,dense_split,kvcache_chunks}.py share: their command line and timer, an SDPA
peer call, and the JSON record."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_gen.bench import run_record


def setup(doc: str, **defaults: str) -> tuple[argparse.Namespace, Callable[[Callable[[], object]], float]] | None:
    """The script's options (`--name` for each default given, plus --json) and its timer, the median milliseconds
    of triton.testing.do_bench with L2 flushed between calls; None (after saying so) without a CUDA GPU."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), default=default)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return None
    from triton.testing import do_bench

    return args, lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")


def sdpa_call(backend: SDPBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False):
    """A zero-argument SDPA call on (b, s, h, d) inputs, or None when the backend refuses the shape."""
    group = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    for gqa in (True, False):
        kt, vt = ((t if gqa else t.repeat_interleave(group, dim=2)).transpose(1, 2) for t in (k, v))

        def call(kt=kt, vt=vt, gqa=gqa):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)

        try:
            call()
            return call
        except RuntimeError:
            continue
    return None


def write_rows(path: str, rows: list[dict]) -> None:
    """The rows under run_record()'s head, as JSON at `path` (nothing when empty)."""
    if path:
        with open(path, "w") as f:
            json.dump({"meta": run_record(), "rows": rows}, f, indent=1)
