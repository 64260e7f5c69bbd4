"""The float64 reference of flash_attn's attention semantics (and the same math in the inputs' dtype): the yardstick
of flash_attn's accuracy rule, used by the GPU tests and by the tuner's correctness check of every candidate.

Also the bit-exact reference of attention dropout's random draws (templates/include/flash_gen/philox.cuh), so tests
can rebuild the exact keep mask a kernel applied from the call's seed."""

from __future__ import annotations

import torch

from flash_gen.spec import dropout_keep_threshold

_MASK32 = 0xFFFFFFFF
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57  # Random123's Philox4x32 multipliers (of counter words 0 and 2)
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85  # and Weyl key increments


def _mulhilo32(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of m * x for uint32 m and x held in int64. m * x reaches 2^64, past int64, so x is
    split into 16-bit limbs: each limb product stays below 2^48 and the recombination below 2^49."""
    p_lo, p_hi = m * (x & 0xFFFF), m * (x >> 16)  # m * x = p_hi * 2^16 + p_lo
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = (p_lo + ((p_hi & 0xFFFF) << 16)) & _MASK32
    return hi, lo


def philox4x32_10(
    c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, k0: int, k1: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random123's Philox4x32-10 of counter (c0, c1, c2, c3) under key (k0, k1), elementwise over int64 tensors
    holding uint32 values (broadcast together, on any one device); returns the four output words, int64 too."""
    c0, c1, c2, c3 = torch.broadcast_tensors(*(c.to(torch.int64) & _MASK32 for c in (c0, c1, c2, c3)))
    k0, k1 = k0 & _MASK32, k1 & _MASK32
    for _ in range(10):
        hi0, lo0 = _mulhilo32(_PHILOX_M0, c0)
        hi1, lo1 = _mulhilo32(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W0) & _MASK32, (k1 + _PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def _seed_key(seed: int) -> tuple[int, int]:
    """Philox key (k0, k1) of a 64-bit seed; kernels read it from an int64 tensor, so a negative seed stands for
    its two's-complement uint64."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return seed & _MASK32, seed >> 32


def dropout_bits(
    seed: int, b: torch.Tensor | int, h: torch.Tensor | int, i: torch.Tensor | int, j: torch.Tensor | int
) -> torch.Tensor:
    """The 16 random bits (int64 in [0, 2^16)) that score (b, h, i, j) draws, straight from philox.cuh's rule,
    elementwise over broadcastable non-negative int tensors; for scattered points (the grid helpers below are
    8x cheaper on whole grids)."""
    b, h, i, j = (torch.as_tensor(x, dtype=torch.int64) for x in (b, h, i, j))
    k0, k1 = _seed_key(seed)
    words = philox4x32_10(j // 16, (i // 16) * 32 + (i % 8) * 4 + (j % 8) // 2, h, b, k0, k1)
    slot = (((j % 16) // 8) * 4 + ((i % 16) // 8) * 2 + j % 2).expand_as(words[0])
    word = torch.stack(words, dim=-1).gather(-1, (slot // 2).unsqueeze(-1)).squeeze(-1)
    return (word >> (16 * (slot % 2))) & 0xFFFF


def _dropout_bits_grid(
    seed: int, batch: torch.Tensor, nheads: int, seqlen_q: int, seqlen_k: int
) -> torch.Tensor:
    """dropout_bits over the grid (batch entries `batch`, all heads, rows, columns) as int32 (len(batch), nheads,
    seqlen_q, seqlen_k). One Philox block feeds 8 scores (rows i, i + 8 of a 16-row tile x columns j, j + 1, j + 8,
    j + 9), so each block is drawn once over (row tile, i % 8) x (column tile, (j % 8) // 2) and then scattered:
    8x less work and memory than drawing per score."""
    device = batch.device
    tiles_q, tiles_k = -(-seqlen_q // 16), -(-seqlen_k // 16)
    k0, k1 = _seed_key(seed)
    tq = torch.arange(tiles_q, device=device)[:, None, None, None]
    r = torch.arange(8, device=device)[None, :, None, None]  # i % 8
    tk = torch.arange(tiles_k, device=device)[None, None, :, None]
    lane_k = torch.arange(4, device=device)[None, None, None, :]  # (j % 8) // 2
    words = philox4x32_10(
        tk, tq * 32 + r * 4 + lane_k, torch.arange(nheads, device=device)[:, None, None, None, None],
        batch[:, None, None, None, None, None], k0, k1,
    )  # each (B, H, tiles_q, 8, tiles_k, 4)
    # word w = slot // 2 = ((j % 16) // 8) * 2 + (i % 16) // 8, half e = slot % 2 = j % 2
    halves = torch.stack([torch.stack([w & 0xFFFF, w >> 16], dim=-1).to(torch.int32) for w in words], dim=-2)
    halves = halves.view(*halves.shape[:6], 2, 2, 2)  # (B, H, tq, r, tk, lane_k, j8, i8, e)
    bits = halves.permute(0, 1, 2, 7, 3, 4, 6, 5, 8)  # i = tq*16 + i8*8 + r, j = tk*16 + j8*8 + lane_k*2 + e
    bits = bits.reshape(len(batch), nheads, tiles_q * 16, tiles_k * 16)
    return bits[:, :, :seqlen_q, :seqlen_k]


def dropout_keep(
    seed: int,
    dropout_p: float,
    batch_index: int,
    nheads: int,
    seqlen_q: int,
    seqlen_k: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Bool keep mask (nheads, seqlen_q, seqlen_k) that dropout kernels apply to batch entry `batch_index` (rows
    and columns count from that entry's start, as in varlen calls) for the call's seed and dropout_p."""
    batch = torch.tensor([batch_index], dtype=torch.int64, device=device)
    return _dropout_bits_grid(seed, batch, nheads, seqlen_q, seqlen_k)[0] < dropout_keep_threshold(dropout_p)


def dropout_keep_dense(
    seed: int,
    dropout_p: float,
    batch: int,
    nheads: int,
    seqlen_q: int,
    seqlen_k: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """dropout_keep of entries 0 .. batch - 1 stacked: the (batch, nheads, seqlen_q, seqlen_k) mask of a dense
    call, ready for attention_ref's dropout_mask."""
    entries = torch.arange(batch, dtype=torch.int64, device=device)
    return _dropout_bits_grid(seed, entries, nheads, seqlen_q, seqlen_k) < dropout_keep_threshold(dropout_p)


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
    dropout_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of flash_attn's attention: float64 throughout when `upcast`, else matmuls in the inputs' dtype
    and the softmax in fp32. lse is +inf for rows that see no key (their output is 0).

    With `dropout_mask` (bool, broadcastable to (batch, nheads, seqlen_q, seqlen_k); e.g. dropout_keep_dense's),
    P @ V uses the probabilities kept by the mask and scaled by 1 / (1 - dropout_p); lse is unchanged, as
    flash_attn's softmax_lse is taken before dropout."""
    if dropout_mask is None and dropout_p != 0.0:
        raise ValueError("dropout_p needs the dropout_mask it applies (see dropout_keep_dense)")
    if dropout_mask is not None and dropout_mask.dtype != torch.bool:
        raise TypeError(f"dropout_mask must be bool, got {dropout_mask.dtype}")
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
    if dropout_mask is not None:
        # where, not a multiply by 1 / (1 - p): dropout_p = 1 drops everything to 0 rather than 0 * inf = nan
        attn = torch.where(dropout_mask.to(attn.device), attn / (1.0 - dropout_p), 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", attn.to(v.dtype), v)
    return out, lse
