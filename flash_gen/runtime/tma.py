"""TMA tensor maps (CUtensorMap) for the Hopper kernels, encoded per call by libcuda on the host.

A map describes a (batch, seqlen, heads, head_dim) tensor to the TMA unit as 4-D (head_dim innermost), or as 5-D
with a GQA group's heads split out (encode_rows), with a box of one swizzled row's columns (64: 128 bytes,
CU_TENSOR_MAP_SWIZZLE_128B; the forward's head dims that 64 does not divide, 32 or 16 columns with a 64- or 32-byte
swizzle) by a tile's rows; rows past seqlen arrive as zeros. Encoding goes through ctypes, like the launch
(driver.py): cuda-bindings converts each argument in Python (the runtime keeps encoded maps per shape and
addresses, flash_gen.runtime.fwd._sm90_params). Must not import anything under flash_gen.build.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
import itertools
import operator

import torch
from cuda.bindings import driver as cu

from flash_gen.memo import BoundedMemo
from flash_gen.runtime import driver

MAP_BYTES, MAP_ALIGN = 128, 64  # sizeof and alignof(CUtensorMap)
BOX_COLS = 64  # elements of a 128-byte swizzle row, the default box width
_DTYPE = {torch.float16: int(cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16),
          torch.bfloat16: int(cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16),
          torch.float32: int(cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32)}
_SWIZZLE = {128: int(cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B),  # by the bytes of a box row
            64: int(cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B),
            32: int(cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B)}
_L2_256B = int(cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B)
_INTERLEAVE_NONE = int(cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE)
_OOB_ZERO = int(cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)


@functools.cache
def _encode_tiled() -> ctypes._CFuncPtr:
    fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p] + [ctypes.c_void_p] * 4 + [
        ctypes.c_int] * 4
    fn.restype = ctypes.c_int
    return fn


def encode_rows(dest: ctypes.Array | ctypes.Structure, offset: int, t: torch.Tensor, box_rows: int,
                group: int | None = None, box_cols: int = BOX_COLS) -> None:
    """Write into `dest` at byte `offset` the map of `t` (batch, seqlen, heads, head_dim) with boxes of
    `box_cols` x `box_rows`, swizzled in rows of `box_cols` (128, 64 or 32 bytes). With `group`, the map is 5-D,
    (head_dim, group, seqlen, heads / group, batch), and a box holds `box_rows` positions of a group's heads
    stacked position by position (box_cols x group x box_rows): the Hopper forward's Q and O, packed (pack-GQA)
    or with a group of 1. TMA needs a 16-byte aligned base and strides: flash_gen.validate already requires them
    of every attention input (the portable kernels' vector loads do too)."""
    b, s, h, d = t.shape
    sb, ss, sh, _ = t.stride()
    if group is None:
        dims, strides, box = (d, s, h, b), (ss, sh, sb), (box_cols, box_rows, 1, 1)
    else:
        dims, strides, box = (d, group, s, h // group, b), (sh, ss, group * sh, sb), (box_cols, group, box_rows, 1, 1)
    # A dim of extent 1 is never stepped over, but TMA still checks its stride: give it the contiguous one.
    contiguous = itertools.accumulate(dims[:-1], operator.mul)
    size = t.element_size()
    byte_strides = [(st if n > 1 else c) * size for n, st, c in zip(dims[1:], strides, contiguous)]
    rank = len(dims)
    err = _encode_tiled()(ctypes.addressof(dest) + offset, _DTYPE[t.dtype], rank, t.data_ptr(),
                          (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * (rank - 1))(*byte_strides),
                          (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*[1] * rank), _INTERLEAVE_NONE,
                          _SWIZZLE[box_cols * size], _L2_256B, _OOB_ZERO)
    if err:
        raise driver.cuda_error("cuTensorMapEncodeTiled", cu.CUresult(err))


MAPS_PER_SHAPE = 64  # address sets kept per forward plan or backward shape (a training loop cycles through a few)


def params_with_maps(struct: type, base: ctypes.Structure, cache: BoundedMemo, key: tuple,
                     maps: tuple[tuple, ...] | Callable[[], tuple[tuple, ...]],
                     box_cols: int = BOX_COLS,
                     fill: Callable[[ctypes.Structure], None] | None = None) -> ctypes.Structure:
    """A Hopper kernel's parameter `struct`: TMA map fields first (`maps`: field, tensor (b, s, h, d) or packed
    (s, h, d), then encode_rows' box rows and, for a 5-D map, group; every box `box_cols` wide), then `base`, the
    shape's template (the same object for every call of a shape; per-call addresses are patched in at launch); a
    map entry may end in its own box width after the group (None: not 5-D). `maps` may be a function returning
    them, called only when they are encoded (views made for a map then cost nothing on a repeated call). A
    map depends only on the address, shape, strides, dtype and box, so the struct is kept in `cache` (one per
    shape) under `key` (the variant and the addresses): a repeated call (the caching allocator hands out the same
    blocks step after step) encodes nothing. `fill` sets the struct's other fields that depend only on the same
    addresses and layouts, once when it is made. Callers must not modify it."""
    params = cache.get(key)
    if params is None:
        params = struct()
        for field, t, box_rows, *extra in (maps() if callable(maps) else maps):
            group, cols = (*extra, None, None)[:2]
            encode_rows(params, getattr(struct, field).offset, t if t.dim() == 4 else t[None], box_rows, group,
                        box_cols=cols or box_cols)
        params.base = base
        if fill is not None:
            fill(params)
        cache.put(key, params)
    return params
