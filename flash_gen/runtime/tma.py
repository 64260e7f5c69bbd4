"""TMA tensor maps (CUtensorMap) for the Hopper kernels, encoded per call by libcuda on the host.

A map describes a (batch, seqlen, heads, head_dim) tensor to the TMA unit as 4-D (head_dim innermost) with a box
of 64 columns (one 128-byte swizzled row, CU_TENSOR_MAP_SWIZZLE_128B) by a tile's rows; rows past seqlen arrive
as zeros. Encoding goes through ctypes, like the launch (driver.py): cuda-bindings converts each argument in
Python (the runtime keeps encoded maps per shape and addresses, flash_gen.runtime.fwd._sm90_params). Must not
import anything under flash_gen.build.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from cuda.bindings import driver as cu

from flash_gen.runtime import driver

MAP_BYTES, MAP_ALIGN = 128, 64  # sizeof and alignof(CUtensorMap)
BOX_COLS = 64  # elements of a 128-byte swizzle row
_DTYPE = {torch.float16: int(cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16),
          torch.bfloat16: int(cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16)}
_SWIZZLE_128B = int(cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B)
_L2_256B = int(cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B)
_INTERLEAVE_NONE = int(cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE)
_OOB_ZERO = int(cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
_Dims, _Strides, _Box = ctypes.c_uint64 * 4, ctypes.c_uint64 * 3, ctypes.c_uint32 * 4
_UNIT = _Box(1, 1, 1, 1)  # element strides


@functools.cache
def _encode_tiled() -> ctypes._CFuncPtr:
    fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p] + [ctypes.c_void_p] * 4 + [
        ctypes.c_int] * 4
    fn.restype = ctypes.c_int
    return fn


def encode_rows(dest: ctypes.Array | ctypes.Structure, offset: int, t: torch.Tensor, box_rows: int) -> None:
    """Write into `dest` at byte `offset` the map of `t` (batch, seqlen, heads, head_dim) with boxes of
    BOX_COLS x `box_rows`. TMA needs a 16-byte aligned base and strides: flash_gen.validate already requires them
    of every attention input (the portable kernels' vector loads do too)."""
    b, s, h, d = t.shape
    sb, ss, sh, _ = t.stride()
    size = t.element_size()
    # A dim of extent 1 is never stepped over, but TMA still checks its stride: give it the contiguous one.
    dense = (d, d * s, d * s * h)
    strides = _Strides(*((st if n > 1 else c) * size for n, st, c in zip((s, h, b), (ss, sh, sb), dense)))
    err = _encode_tiled()(ctypes.addressof(dest) + offset, _DTYPE[t.dtype], 4, t.data_ptr(), _Dims(d, s, h, b),
                          strides, _Box(BOX_COLS, box_rows, 1, 1), _UNIT, _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_256B,
                          _OOB_ZERO)
    if err:
        raise driver.cuda_error("cuTensorMapEncodeTiled", cu.CUresult(err))


MAPS_PER_SHAPE = 64  # address sets kept per shape (a training loop cycles through a few)


def params_with_maps(struct: type, base: ctypes.Structure, cache: dict, key: tuple,
                     maps: tuple[tuple[str, torch.Tensor, int], ...]) -> ctypes.Structure:
    """A Hopper kernel's parameter `struct`: TMA map fields first (`maps`: field, tensor (b, s, h, d) or packed
    (s, h, d), box rows), then `base`, the shape's template (the same object for every call of a shape; per-call
    addresses are patched in at launch). A map depends only on the address, shape, strides, dtype and box, so the
    struct is kept in `cache` (one per shape) under `key` (the variant and the addresses): a repeated call (the
    caching allocator hands out the same blocks step after step) encodes nothing. Callers must not modify it."""
    params = cache.get(key)
    if params is None:
        params = struct()
        for field, t, rows in maps:
            encode_rows(params, getattr(struct, field).offset, t if t.dim() == 4 else t[None], rows)
        params.base = base
        if len(cache) >= MAPS_PER_SHAPE:
            cache.clear()
        cache[key] = params
    return params
