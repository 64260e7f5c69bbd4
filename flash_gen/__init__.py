"""flash-gen: a FlashAttention kernel generator and autotuning compiler.

Importing this package does no work: no CUDA, no compiler, no file-system access until a function is called.
"""

from flash_gen.version import FLASH_GEN_VERSION as __version__  # noqa: E402

from flash_gen.api import flash_attn_func  # noqa: E402  (torch is imported here; CUDA is not touched)

__all__ = ["flash_attn_func", "__version__"]
