"""flash-gen: a FlashAttention kernel generator and autotuning compiler.

Importing this package does no work: the public API (and with it torch) loads on first attribute access, so the
compiler side (spec, gen, build) imports without torch, and nothing touches CUDA or the compiler until called.
"""

from flash_gen.version import FLASH_GEN_VERSION as __version__

_API = (
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "merge_attention_states",
)
__all__ = [*_API, "__version__"]


def __getattr__(name: str):
    if name in _API:
        from flash_gen import api

        value = globals()[name] = getattr(api, name)  # later lookups are plain module attributes, no hook
        return value
    raise AttributeError(f"module 'flash_gen' has no attribute {name!r}")
