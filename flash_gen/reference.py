"""The float64 reference of flash_attn's attention semantics (and the same math in the inputs' dtype): the yardstick
of flash_attn's accuracy rule, used by the GPU tests and by the tuner's correctness check of every candidate."""

from __future__ import annotations

import torch


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    window: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    upcast: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of flash_attn's attention: float64 throughout when `upcast`, else matmuls in the inputs' dtype
    and the softmax in fp32. lse is +inf for rows that see no key (their output is 0)."""
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    acc = torch.float64 if upcast else torch.float32
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)  # GQA/MQA in the reference only
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k).to(acc) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    row = torch.arange(seqlen_q, device=q.device)[:, None] + (seqlen_k - seqlen_q)  # bottom-right aligned
    col = torch.arange(seqlen_k, device=q.device)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(acc)
        slopes = slopes[None, :, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
        scores = scores - slopes * (row - col).abs()
    left, right = window[0], 0 if causal else window[1]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if right >= 0:
        visible &= col <= row + right
    if left >= 0:
        visible &= col >= row - left
    scores = scores.masked_fill(~visible, float("-inf"))
    blind = ~visible.any(dim=-1)  # rows that see no key
    lse = torch.logsumexp(scores, dim=-1).masked_fill(blind, float("inf"))
    attn = torch.softmax(scores, dim=-1).masked_fill(blind[:, None], 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", attn.to(v.dtype), v)
    return out, lse
