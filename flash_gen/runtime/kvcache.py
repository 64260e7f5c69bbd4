"""flash_attn_with_kvcache's steps before attention, as one generated kernel (templates/kv_append.cu.j2): the new
keys (rotated when cos/sin are given) and values written into the cache in place at rows cache_seqlens[b] + i
(through the block table when paged), and q rotated into a new tensor. One launch on the current stream, no host
sync (decoding steps stay capturable in CUDA graphs). Positions, entries and pages are clamped in the kernel, so
bad index values give wrong rows, never an access outside the tensors (FLASH_GEN_DEBUG=1 checks them first).
"""

from __future__ import annotations

import ctypes

import torch

from flash_gen.gen.render import append_entry, render_append
from flash_gen.runtime import driver, loader
from flash_gen.runtime.score_params import DTYPES, set_strides

_THREADS, _ROWS = 128, 4  # kAppendThreads, kAppendRows in templates/include/flash_gen/kv_append.cuh


class AppendParams(ctypes.Structure):
    """Mirror of flash_gen::AppendParams (templates/include/flash_gen/kv_append.cuh): keep the two in step."""

    _fields_ = (
        [(name, ctypes.c_void_p) for name in ("q", "q_out", "k_new", "v_new", "k_cache", "v_cache", "cos", "sin",
                                               "cache_seqlens", "batch_idx", "block_table")]
        + [(f"{t}_{s}_stride", ctypes.c_int64) for t in ("q", "qo", "kn", "vn", "kc", "vc")
           for s in ("batch", "row", "head")]
        + [("block_table_stride", ctypes.c_int64)]
        + [(name, ctypes.c_int) for name in ("batch", "seqlen_q", "seqlen_new", "nheads", "nheads_k", "head_dim",
                                             "rotary_half", "seqlen_ro", "seqlen_int", "kv_entries", "rows",
                                             "capacity", "q_same_pos", "interleaved")]
    )


def append_and_rotate(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    seqlen_int: int,
    batch_idx: torch.Tensor | None,
    block_table: torch.Tensor | None,
    *,
    interleaved: bool,
    q_same_pos: bool,
) -> torch.Tensor:
    """Append k, v (batch, seqlen_new, hk, d) to the cache and return q rotated (or q itself without cos/sin).
    cos/sin: (seqlen_ro, rotary_dim / 2); new key i of entry b and (unless q_same_pos) query row i sit at position
    cache_seqlens[b] + i (seqlen_int when cache_seqlens is None)."""
    rotary = cos is not None
    if k is None and not rotary:
        return q
    batch, seqlen_q, nheads, head_dim = q.shape
    p = AppendParams()
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format) if rotary else q
    p.q, p.q_out = q.data_ptr(), q_out.data_ptr()
    set_strides(p, "q", q)
    set_strides(p, "qo", q_out)
    if rotary:
        cos, sin = cos.float().contiguous(), sin.float().contiguous()  # no copy when already fp32 and dense
        p.cos, p.sin, p.rotary_half, p.seqlen_ro = cos.data_ptr(), sin.data_ptr(), cos.shape[1], cos.shape[0]
    if k is not None:
        p.k_new, p.v_new = k.data_ptr(), v.data_ptr()
        set_strides(p, "kn", k)
        set_strides(p, "vn", v)
    p.k_cache, p.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
    set_strides(p, "kc", k_cache)
    set_strides(p, "vc", v_cache)
    for name, t in (("cache_seqlens", cache_seqlens), ("batch_idx", batch_idx), ("block_table", block_table)):
        if t is not None:
            setattr(p, name, t.data_ptr())
    p.block_table_stride = block_table.stride(0) if block_table is not None else 0
    seqlen_new = k.shape[1] if k is not None else 0
    p.batch, p.seqlen_q, p.seqlen_new, p.nheads, p.head_dim = batch, seqlen_q, seqlen_new, nheads, head_dim
    p.nheads_k = k_cache.shape[2]
    p.seqlen_int, p.kv_entries, p.rows = max(seqlen_int, 0), k_cache.shape[0], k_cache.shape[1]
    p.capacity = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    p.q_same_pos, p.interleaved = int(q_same_pos), int(interleaved)

    items = batch * seqlen_new * p.nheads_k + (batch * seqlen_q * nheads if rotary else 0)
    device = q.device.index
    arch, dtype = driver.device_arch(device), DTYPES[q.dtype]
    kernel = loader.get_kernel(lambda: render_append(arch, dtype), append_entry(arch, dtype), arch, 0, device)
    stream = torch._C._cuda_getCurrentRawStream(device)
    kernel.launch((-(-items // _ROWS), 1, 1), (_THREADS, 1, 1), 0, stream, p)
    return q_out
