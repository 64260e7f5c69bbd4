"""flash-gen: a FlashAttention kernel generator and autotuning compiler.

Importing this package does no work: the public API (and with it torch) loads on first attribute access, so the
compiler side (spec, gen, build) imports without torch, and nothing touches CUDA or the compiler until called.
"""

from flash_gen.version import FLASH_GEN_VERSION as __version__

__all__ = ["flash_attn_func", "__version__"]


def __getattr__(name: str):
    if name == "flash_attn_func":
        from flash_gen.api import flash_attn_func

        return flash_attn_func
    raise AttributeError(f"module 'flash_gen' has no attribute {name!r}")
