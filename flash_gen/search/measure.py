"""The tuner's GPU side: a candidate config is first checked for correctness on random inputs against the
float64 reference (flash_attn's rule: error at most twice that of the same math in the input dtype, plus 1e-4),
so a wrong kernel can never win; then timed on every shape of a bucket (median of triton's do_bench, or CUDA
events, with inputs rotated past the L2). The search minimises the total over the bucket; the per-shape times let
the tune keep only configs that are not slower than the default on any shape. The runtime is
forced to the candidate's tiling; its cubin is already in the kernel cache (compiled by a worker process).
"""

from __future__ import annotations

import itertools

import torch

from flash_gen.bench import median_timer, preheat
from flash_gen.ops import dropout_seed
from flash_gen.reference import attention_ref, dropout_keep_dense
from flash_gen.search.space import Bucket, Family, Shape
from flash_gen.search.study import Rejected

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_WINDOW = {"none": (-1, -1), "causal": (-1, 0), "local": (256, 256)}
_ROTATE_BYTES = 2 * 60 * 2**20  # twice the H200's L2


class Measurer:
    """measure(cfg) -> milliseconds on each shape of `bucket`, or Rejected when the candidate computes wrong
    values."""

    def __init__(self, family: Family, bucket: Bucket, device: int = 0) -> None:
        self.family, self.bucket, self.device = family, bucket, device
        self.dtype = _DTYPES[family.dtype]
        self.causal = family.mask == "causal"
        self.window = _WINDOW[family.mask] if family.mask == "local" else (-1, -1)
        self.timer = median_timer()[1]

    def __call__(self, cfg) -> list[float] | Rejected:
        why = self.check(cfg)
        if why is not None:
            return Rejected(why)
        return [self.time(cfg, shape) for shape in self.bucket.shapes]

    # --- one call of the family's kernel ----------------------------------------------------------------------

    def _inputs(self, shape: Shape, gen: torch.Generator | None = None) -> dict:
        randn = lambda *s: torch.randn(*s, generator=gen, device=f"cuda:{self.device}", dtype=self.dtype)  # noqa: E731
        d = self.family.head_dim
        q = randn(shape.batch, shape.seqlen_q, shape.nheads, d)
        k, v = (randn(shape.batch, shape.seqlen_k, shape.nheads_k, d) for _ in range(2))
        t = {"q": q, "k": k, "v": v}
        if self.family.dropout:
            t["rng_state"] = dropout_seed(q, self.family.dropout)
        if self.family.direction == "bwd":
            t["dout"] = randn(*q.shape)
            t["out"], t["lse"] = self._forward(q, k, v, None, rng_state=t.get("rng_state"))
        if self.family.direction == "decode":
            t["seqused"] = torch.full((shape.batch,), shape.seqlen_k, dtype=torch.int32, device=q.device)
        return t

    def _attn(self, rng_state=None) -> dict:
        drop = dict(dropout_p=self.family.dropout, rng_state=rng_state) if self.family.dropout else {}
        return dict(softmax_scale=self.family.head_dim ** -0.5, causal=self.causal, window_size=self.window,
                    softcap=0.0, alibi_slopes=None, **drop)

    def _forward(self, q, k, v, cfg, seqused=None, rng_state=None):
        from flash_gen.runtime.fwd import attention_fwd
        from flash_gen.runtime.fwd_kvcache import KvCache, attention_fwd_kvcache

        if self.family.direction == "decode":
            cache = KvCache(seqused_k=seqused, used=None, leftpad_k=None, batch_idx=None, block_table=None,
                            num_splits=0)
            return attention_fwd_kvcache(q, k, v, cache, config=cfg, **self._attn())
        return attention_fwd(q, k, v, config=cfg if self.family.direction == "fwd" else None,
                             **self._attn(rng_state))

    def _call(self, t: dict, cfg):
        if self.family.direction == "bwd":
            from flash_gen.runtime.bwd import attention_bwd

            grads = [torch.empty_like(t[name]) for name in ("q", "k", "v")]
            attention_bwd(t["dout"], t["q"], t["k"], t["v"], t["out"], t["lse"], *grads, deterministic=False,
                          config=cfg, **self._attn(t.get("rng_state")))
            return grads
        return [self._forward(t["q"], t["k"], t["v"], cfg, t.get("seqused"), t.get("rng_state"))[0]]

    # --- correctness ----------------------------------------------------------------------------------------

    def check(self, cfg) -> str | None:
        """None when the candidate passes flash_attn's rule on a small random case, else why it failed."""
        decode = self.family.direction == "decode"
        shape = Shape(2, 1 if decode else 203, 1000 if decode else 333, 8, 2 if decode else 8)
        gen = torch.Generator(device=f"cuda:{self.device}").manual_seed(1234)
        t = self._inputs(shape, gen)
        for g in (t["q"], t["k"], t["v"]):
            g.requires_grad_(self.family.direction == "bwd")
        try:
            got = self._call(t, cfg)
        except Exception as e:  # a candidate that cannot run is rejected, never fatal to the tune
            return f"run: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        refs = [self._reference(t, upcast) for upcast in (True, False)]
        for i, g in enumerate(got):
            if g.isnan().any():
                return "NaN in the output"
            err = (g.double() - refs[0][i]).abs().max().item()
            tol = 2 * (refs[1][i].double() - refs[0][i]).abs().max().item() + 1e-4
            if err > tol:
                return f"max |error| {err:.3e} > {tol:.3e}"
        return None

    def _reference(self, t: dict, upcast: bool) -> list[torch.Tensor]:
        leaves = [t[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
        drop = {}
        if self.family.dropout:  # the kernels' own keep decisions (flash_gen.reference rebuilds them exactly)
            (b, sq, h, _), sk = t["q"].shape, t["k"].shape[1]
            mask = dropout_keep_dense(int(t["rng_state"].item()), self.family.dropout, b, h, sq, sk,
                                      device=t["q"].device)
            drop = dict(dropout_mask=mask, dropout_p=self.family.dropout)
        out, _ = attention_ref(*leaves, scale=self.family.head_dim ** -0.5, causal=self.causal, window=self.window,
                               softcap=0.0, alibi_slopes=None, upcast=upcast, **drop)
        if self.family.direction != "bwd":
            return [out.detach()]
        return list(torch.autograd.grad(out, leaves, t["dout"].to(out.dtype)))

    # --- timing ---------------------------------------------------------------------------------------------

    def time(self, cfg, shape: Shape) -> float:
        first = self._inputs(shape)
        per_set = sum(x.numel() * x.element_size() for x in first.values() if isinstance(x, torch.Tensor))
        sets = [first] + [self._inputs(shape) for _ in range(max(0, -(-_ROTATE_BYTES // per_set) - 1))]
        rotation = itertools.cycle(sets)
        fn = lambda: self._call(next(rotation), cfg)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        preheat(fn)  # each timing follows a compile wait or a correctness check: time it at the sustained clock
        return self.timer(fn)
