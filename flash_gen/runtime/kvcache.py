"""Host-side steps of flash_attn_with_kvcache around the attention kernel: rotary embedding of q and the new
keys, and appending the new keys and values to the cache in place. Both are PyTorch tensor ops on the current
stream (indices computed on the device, so no host sync: decoding steps stay capturable in CUDA graphs).
Positions and pages are clamped to the tensors, so bad cache_seqlens or block_table values give wrong rows,
never an access outside them (FLASH_GEN_DEBUG=1 checks the values on the host first).
"""

from __future__ import annotations

import torch


def positions(start: torch.Tensor, count: int) -> torch.Tensor:
    """(batch, count) int64 positions start[b] + i."""
    return start.long()[:, None] + torch.arange(count, device=start.device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """x (b, s, h, d) with its first 2 * cos.shape[1] dims rotated by the angles at positions pos (b, s):
    pairs (x[2i], x[2i+1]) when interleaved (GPT-J), else (x[i], x[i + rotary_dim/2]) (GPT-NeoX). fp32 math."""
    half = cos.shape[1]
    pos = pos.clamp(0, cos.shape[0] - 1)
    c, s = cos[pos].float()[:, :, None], sin[pos].float()[:, :, None]  # (b, s, 1, half)
    rot = x[..., : 2 * half].float()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., 2 * half :]), dim=-1)


def append_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
              batch_idx: torch.Tensor | None, block_table: torch.Tensor | None) -> None:
    """Write k, v (b, s_new, hk, d) into the caches at rows pos (b, s_new) of each entry: cache entry
    batch_idx[b] (or b) of a contiguous cache, or the pages block_table[b] lists."""
    if block_table is None:
        entries = batch_idx.long() if batch_idx is not None else torch.arange(k.shape[0], device=k.device)
        index = (entries.clamp(0, k_cache.shape[0] - 1)[:, None], pos.clamp(0, k_cache.shape[1] - 1))
    else:
        page_size = k_cache.shape[1]
        column = (pos // page_size).clamp(0, block_table.shape[1] - 1)
        pages = block_table.long().gather(1, column).clamp(0, k_cache.shape[0] - 1)
        index = (pages, pos % page_size)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)
