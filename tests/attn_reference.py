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
    """A new seed per run (inputs are never the same twice); tests print it so a failure can be replayed."""
    return int.from_bytes(os.urandom(4), "little")
