"""The case vocabulary shared by the GPU tests, and the float64 reference (flash_gen.reference) they check against."""

from __future__ import annotations

import os

import torch

from flash_gen.reference import attention_ref  # noqa: F401  (re-exported for the tests)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MASKS = {  # name -> (causal, window_size): every mask kind, windows that cut on one side, both, and (0, 0)
    "none": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "win32_0": (False, (32, 0)),
    "winInf_17": (False, (-1, 17)),
    "win64_64": (False, (64, 64)),
    "win0_0": (False, (0, 0)),
}
SOFTCAP = 30.0


def fresh_seed() -> int:
    """A new seed per run (inputs are never the same twice); tests print it so that a failure can be replayed with
    FLASH_GEN_TEST_SEED=<seed> (every test of the run then draws that seed)."""
    replay = os.environ.get("FLASH_GEN_TEST_SEED")
    return int(replay) if replay else int.from_bytes(os.urandom(4), "little")


def reference_grads(out: torch.Tensor, lse: torch.Tensor, leaves, dout: torch.Tensor,
                    stored: torch.dtype) -> tuple[tuple, tuple]:
    """The gradients of sum(out * dout) with respect to `leaves`, and the amount by which they move when
    D = rowsum(dO * O) reads the output rounded to `stored`, as the kernels' backward does (flash_attn's too: it reads
    the output it stored). That rounding changes D by dD and dS by -P dD, which is the gradient of -sum(dD * lse)
    through the scores. PyTorch's autograd in the inputs' dtype never takes that rounding, so flash_attn's rule (2x
    its error) leaves no budget for it where a gradient nearly cancels: a query over a few keys failed 3% of seeds
    with dQ equal, bit for bit, to that algorithm's in fp32 (H100, 2026-12-07)."""
    dout = dout.to(out.dtype)
    grads = torch.autograd.grad(out, leaves, dout, retain_graph=True, allow_unused=True, materialize_grads=True)
    rounding = (dout * (out.detach().to(stored).to(out.dtype) - out.detach())).sum(-1).transpose(-1, -2)  # lse's
    seen = lse.masked_fill(~lse.isfinite(), 0.0)  # rows that see no key have no gradient
    shift = torch.autograd.grad((rounding * seen).sum(), leaves, allow_unused=True, materialize_grads=True)
    return grads, shift


def budgets(shift) -> tuple[float, ...]:
    """Each gradient's tolerance for reading the stored output: the largest move of reference_grads' shift."""
    return tuple(s.abs().max().item() if s.numel() else 0.0 for s in shift)


def grad_leaves(tensors, upcast: bool) -> list[torch.Tensor]:
    """Copies of `tensors` to differentiate a reference through: float64 when `upcast`. Autograd returns a leaf's
    gradient in the leaf's dtype, so float64 math on bf16 leaves would still round the reference's gradients to
    bf16, and a kernel correct to half an ulp could then be a whole ulp off its reference."""
    return [t.detach().to(torch.float64 if upcast else t.dtype, copy=True).requires_grad_() for t in tensors]
