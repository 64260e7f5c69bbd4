"""Input checks for the forward API, run before anything is compiled or launched.

Owns flash_attn 2.8's argument contract: every rejection raises an exception whose message starts with the name
of the offending argument (TypeError for wrong types and dtypes, ValueError for shapes, devices and values,
NotImplementedError for features flash-gen does not have yet). What passes is returned as a normalized `FwdArgs`
(scale resolved, window and mask kind derived) so the runtime never re-interprets user arguments.

The checks are split so the CPU test-suite can run them: `check_fwd` looks only at shapes, strides, dtypes and
values and works on CPU or meta tensors; `check_device` is the one CUDA-specific check; `validate_fwd` runs both.

Imports torch only: never the runtime, the compiler or cuda.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch

from flash_gen import settings

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
MAX_HEAD_DIM = 256
# The kernels move rows with 16-byte vector loads (8 half-precision elements), so every tensor's base address
# and every stride that is actually stepped over must keep that alignment.
VECTOR_BYTES = 16


@dataclass(frozen=True)
class FwdArgs:
    """Checked and normalized forward arguments.

    `window_size` is (left, right) with -1 for "unbounded"; bounds that cannot hide any key have already been
    dropped, so `mask` is the cheapest kernel that computes exactly what was asked for.
    """

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int
    dtype: str  # "fp16" | "bf16", the spelling of flash_gen.spec
    softmax_scale: float
    mask: str  # "none" | "causal" | "local"
    window_size: tuple[int, int]
    softcap: float  # 0.0 = off
    alibi: bool
    varlen: bool = False  # packed ragged batch: seqlen_q/seqlen_k are then the totals (upper bounds per entry)

    @property
    def causal(self) -> bool:
        return self.mask == "causal"

    @property
    def empty(self) -> bool:
        """Nothing to compute: the output is empty or every row sees zero keys."""
        return self.seqlen_q == 0 or self.seqlen_k == 0


def derive_mask(
    causal: bool, window_size: tuple[int, int], seqlen_q: int, seqlen_k: int
) -> tuple[str, tuple[int, int]]:
    """Mask kind and normalized window, with flash_attn's bottom-right alignment.

    Query i sees key j iff j <= i + seqlen_k - seqlen_q + right (when right >= 0) and
    j >= i + seqlen_k - seqlen_q - left (when left >= 0). causal=True forces right = 0.
    A bound is dropped (set to -1) only when it cannot hide any key for these sequence lengths, which keeps the
    result exact (flash_attn's own rule `right >= seqlen_k -> -1` is not exact when seqlen_q > seqlen_k).
    Then (-1, -1) is "none", (-1, 0) is "causal" (also when reached via causal=False), anything else "local".
    """
    left, right = window_size
    if causal:
        right = 0
    # The lowest bound any query puts on j is (seqlen_k - 1) - left, at the last query row.
    if left >= max(seqlen_k - 1, 0):
        left = -1
    # The highest bound any query puts on j is seqlen_k - seqlen_q + right, at the first query row.
    if right >= max(seqlen_q - 1, 0):
        right = -1
    if (left, right) == (-1, -1):
        return "none", (-1, -1)
    if (left, right) == (-1, 0):
        return "causal", (-1, 0)
    return "local", (left, right)


def check_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    return_attn_probs: bool = False,
) -> FwdArgs:
    """Every forward check except the device one (see `check_device`); works on CPU and meta tensors.

    With cu_seqlens_q/k the batch is packed (flash_attn_varlen_func): q (total_q, nheads, head_dim), k/v
    (total_k, nheads_k, head_dim), and the returned seqlen_q/seqlen_k are the totals. With a block_table (batch,
    pages per entry; int32) as well, k/v are a paged cache (num_blocks, page_size, nheads_k, head_dim) whose
    entry b holds its cu_seqlens_k[b+1] - cu_seqlens_k[b] keys in its pages; seqlen_k is then pages x page_size.
    Raises TypeError, ValueError or NotImplementedError naming the argument; returns the normalized `FwdArgs`.
    """
    check_dropout_p(dropout_p)
    _check_bool("return_attn_probs", return_attn_probs)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if block_table is not None and not varlen:
        raise ValueError("block_table: a paged K/V cache here needs cu_seqlens_q/k (or use flash_attn_with_kvcache)")
    dims, layout = (3, "(total, nheads, head_dim)") if varlen else (4, "(batch, seqlen, nheads, head_dim)")
    kv_dims, kv_layout = (4, "(num_blocks, page_size, nheads_k, head_dim)") if block_table is not None else (
        dims, layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require_tensor(name, t)
        want, shape = (dims, layout) if name == "q" else (kv_dims, kv_layout)
        if t.dim() != want:
            raise ValueError(f"{name}: expected {want} dims {shape}, got shape {tuple(t.shape)}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"q: dtype must be torch.float16 or torch.bfloat16, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from q's dtype {q.dtype}")

    *_, seqlen_q, nheads, head_dim = q.shape
    *_, seqlen_k, nheads_k, _ = k.shape
    if varlen:
        batch = _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k)
        if block_table is not None:
            _check_index("block_table", block_table, 2)
            _check_dim(block_table, "block_table", 0, "batch", batch, "cu_seqlens_q's")
            seqlen_k = block_table.shape[1] * k.shape[1]  # the rows an entry can hold
    else:
        batch = q.shape[0]
        if batch < 1:
            raise ValueError(f"q: batch must be >= 1, got shape {tuple(q.shape)}")
        _check_dim(k, "k", 0, "batch", batch, "q")
    if nheads < 1:
        raise ValueError(f"q: nheads must be >= 1, got shape {tuple(q.shape)}")
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim must be a multiple of 8 in [8, {MAX_HEAD_DIM}], got {head_dim}")
    _check_dim(k, "k", -1, "head_dim", head_dim, "q")
    if nheads_k < 1 or nheads % nheads_k:
        raise ValueError(f"k: nheads_k={nheads_k} must be >= 1 and divide q's nheads={nheads}")
    for axis, what in enumerate(("batch", "seqlen_k", "nheads_k", "head_dim")[4 - kv_dims :]):
        _check_dim(v, "v", axis, what, k.shape[axis], "k")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_layout(name, t)
    if block_table is not None:
        for name, t in (("k", k), ("v", v)):
            _check_paged(name, t)

    alibi = _check_alibi(alibi_slopes, batch, nheads)
    # Varlen: the totals bound every entry's lengths, so a bound dropped for them hides no key of any entry.
    mask, window = derive_mask(_check_bool("causal", causal), _check_window(window_size), seqlen_q, seqlen_k)
    return FwdArgs(
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        nheads=nheads,
        nheads_k=nheads_k,
        head_dim=head_dim,
        dtype=_DTYPES[q.dtype],
        softmax_scale=head_dim**-0.5 if softmax_scale is None else _check_positive("softmax_scale", softmax_scale),
        mask=mask,
        window_size=window,
        softcap=_check_softcap(softcap),
        alibi=alibi,
        varlen=varlen,
    )


def check_device(q: torch.Tensor, **others: torch.Tensor | None) -> None:
    """q and every other given tensor must live on one CUDA device. Raises ValueError naming the first tensor
    that does not."""
    if q.device.type != "cuda":
        raise ValueError(f"q: flash_gen needs CUDA tensors, got a tensor on {q.device}")
    for name, t in others.items():
        if t is not None and t.device != q.device:
            raise ValueError(f"{name}: flash_gen needs CUDA tensors on q's device {q.device}, got {t.device}")


def validate_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> FwdArgs:
    """`check_fwd` (same keyword arguments) then `check_device`; under FLASH_GEN_DEBUG=1 also the cu_seqlens
    values (a device-to-host copy). The full contract of the forward API."""
    args = check_fwd(q, k, v, **kwargs)
    tensors = {name: kwargs.get(name) for name in ("cu_seqlens_q", "cu_seqlens_k", "block_table", "alibi_slopes")}
    check_device(q, k=k, v=v, **tensors)
    if args.varlen and settings.debug():
        check_cu_seqlens_values("cu_seqlens_q", kwargs["cu_seqlens_q"], args.seqlen_q)
        check_cu_seqlens_values("cu_seqlens_k", kwargs["cu_seqlens_k"], args.seqlen_k)
    return args


def check_cu_seqlens_values(name: str, cu: torch.Tensor, total: int) -> None:
    """cu_seqlens must start at 0, never decrease and end within the packed tensor. Needs the values on the
    host (a sync), so it runs only under FLASH_GEN_DEBUG=1; without it the kernels clamp every offset to the
    tensor, so bad values give wrong rows but never an access outside it."""
    values = cu.tolist()
    if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])) or values[-1] > total:
        raise ValueError(f"{name}: must start at 0, never decrease and end at most at {total} (the packed "
                         f"rows), got {values}")


def _check_cu_seqlens(cu_q: object, cu_k: object, total_q: int, total_k: int) -> int:
    """Shapes and dtypes of a packed batch's row offsets; returns the batch size."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if cu is None:
            raise ValueError(f"{name}: a packed batch needs both cu_seqlens_q and cu_seqlens_k")
        _require_tensor(name, cu)
        if cu.dtype != torch.int32:
            raise TypeError(f"{name}: dtype must be torch.int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() < 2 or cu.stride(0) != 1:
            raise ValueError(f"{name}: expected a contiguous 1-D tensor of batch + 1 >= 2 offsets, got shape "
                             f"{tuple(cu.shape)} strides {cu.stride()}")
    if cu_k.numel() != cu_q.numel():
        raise ValueError(f"cu_seqlens_k: {cu_k.numel()} offsets do not match cu_seqlens_q's {cu_q.numel()} "
                         "(both are batch + 1)")
    return cu_q.numel() - 1


def check_attn_args(
    dropout_p: float,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    return_attn_probs: bool,
) -> tuple:
    """The public functions' non-tensor arguments, checked (errors name them) and flattened into the trailing
    arguments of flash_gen.ops: (softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
    deterministic, dropout_p); the op's last argument, the dropout seed, comes from flash_gen.ops.dropout_seed.
    Pure Python on plain values, so torch.compile traces it without a graph break."""
    dropout_p = check_dropout_p(dropout_p)
    _check_bool("return_attn_probs", return_attn_probs)  # (out, softmax_lse, None): see flash_gen.api._outputs
    if softmax_scale is not None:
        softmax_scale = _check_positive("softmax_scale", softmax_scale)
    left, right = _check_window(window_size)
    return (softmax_scale, _check_bool("causal", causal), left, right, _check_softcap(softcap), alibi_slopes,
            _check_bool("deterministic", deterministic), dropout_p)


@dataclass(frozen=True)
class KvCacheArgs:
    """Checked flash_attn_with_kvcache arguments beyond the attention's: what the host steps and the runtime's
    KvCache need."""

    attn: FwdArgs  # seqlen_k is the cache capacity (rows an entry can hold)
    new_rows: int  # keys appended per entry (0 without k/v)
    rotary: bool
    num_splits: int


def check_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None,
    cache_seqlens: torch.Tensor | int | None,
    cache_batch_idx: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    block_table: torch.Tensor | None,
    *,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    num_splits: int,
    rotary_interleaved: bool = True,
) -> KvCacheArgs:
    """flash_attn_with_kvcache's contract (shapes, dtypes, layouts, devices, and under FLASH_GEN_DEBUG=1 the
    index values). Raises TypeError / ValueError / NotImplementedError naming the argument."""
    _require_tensor("q", q)
    if q.dim() != 4:
        raise ValueError(f"q: expected 4 dims (batch, seqlen_q, nheads, head_dim), got shape {tuple(q.shape)}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"q: dtype must be torch.float16 or torch.bfloat16, got {q.dtype}")
    batch, seqlen_q, nheads, head_dim = q.shape
    if batch < 1 or nheads < 1:
        raise ValueError(f"q: batch and nheads must be >= 1, got shape {tuple(q.shape)}")
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim must be a multiple of 8 in [8, {MAX_HEAD_DIM}], got {head_dim}")
    layout = "(num_blocks, page_size" if block_table is not None else "(batch_cache, seqlen_cache"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _require_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims {layout}, nheads_k, head_dim), got shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from q's dtype {q.dtype}")
    entries, rows, nheads_k, _ = k_cache.shape
    _check_dim(k_cache, "k_cache", 3, "head_dim", head_dim, "q")
    if nheads_k < 1 or nheads % nheads_k:
        raise ValueError(f"k_cache: nheads_k={nheads_k} must be >= 1 and divide q's nheads={nheads}")
    for axis, what in enumerate(("batch", "seqlen", "nheads_k", "head_dim")):
        _check_dim(v_cache, "v_cache", axis, what, k_cache.shape[axis], "k_cache")
    if entries < 1 or rows < 1:
        raise ValueError(f"k_cache: needs at least one entry and one row, got shape {tuple(k_cache.shape)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_layout(name, t)

    if block_table is not None:
        _check_index("block_table", block_table, 2)
        _check_dim(block_table, "block_table", 0, "batch", batch, "q")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            _check_paged(name, t)
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx: not supported with a paged cache (block_table picks the pages)")
        capacity = block_table.shape[1] * rows
    else:
        capacity = rows
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is not None:
            _check_index(name, t, 1)
            _check_dim(t, name, 0, "batch", batch, "q")
    if cache_batch_idx is None and block_table is None and entries < batch:
        raise ValueError(f"k_cache: {entries} cache entries for a batch of {batch} (pass cache_batch_idx?)")

    new_rows = 0
    if (k is None) != (v is None):
        raise ValueError(f"{'v' if k is not None else 'k'}: k and v are appended together; pass both or neither")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            _require_tensor(name, t)
            if t.dim() != 4 or t.shape[0] != batch or tuple(t.shape[2:]) != (nheads_k, head_dim):
                raise ValueError(f"{name}: expected shape ({batch}, seqlen_new, {nheads_k}, {head_dim}), got "
                                 f"{tuple(t.shape)}")
            if t.dtype != q.dtype:
                raise TypeError(f"{name}: dtype {t.dtype} differs from q's dtype {q.dtype}")
        _check_dim(v, "v", 1, "seqlen_new", k.shape[1], "k")
        new_rows = k.shape[1]
        if cache_seqlens is None:
            raise ValueError("cache_seqlens: needed to append k and v (the row where each entry's new keys go)")
    if isinstance(cache_seqlens, torch.Tensor):
        _check_index("cache_seqlens", cache_seqlens, 1)
        _check_dim(cache_seqlens, "cache_seqlens", 0, "batch", batch, "q")
    elif cache_seqlens is not None:
        if not isinstance(cache_seqlens, numbers.Integral) or isinstance(cache_seqlens, bool) or cache_seqlens < 0:
            raise TypeError(f"cache_seqlens: expected an int32 tensor or an int >= 0, got {cache_seqlens!r}")
        if cache_seqlens + new_rows > capacity:
            raise ValueError(f"cache_seqlens: {cache_seqlens} + {new_rows} new rows exceed the cache's {capacity}")

    rotary = rotary_cos is not None or rotary_sin is not None
    if rotary:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            _require_tensor(name, t)
            if t.dim() != 2 or not t.is_floating_point() or 2 * t.shape[1] > head_dim or t.shape[1] < 1:
                raise ValueError(f"{name}: expected a float (seqlen_ro, rotary_dim / 2) tensor with rotary_dim <= "
                                 f"head_dim={head_dim}, got {tuple(t.shape)} {t.dtype}")
        if not rotary_interleaved and rotary_cos.shape[1] % 8:
            raise ValueError(f"rotary_cos: non-interleaved (GPT-NeoX) rotary needs rotary_dim a multiple of 16, "
                             f"got {2 * rotary_cos.shape[1]}")
        if rotary_sin.shape != rotary_cos.shape:
            raise ValueError(f"rotary_sin: shape {tuple(rotary_sin.shape)} differs from rotary_cos's "
                             f"{tuple(rotary_cos.shape)}")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens: needed with rotary_cos/rotary_sin (the rotary positions start there)")
    if not isinstance(num_splits, numbers.Integral) or isinstance(num_splits, bool) or num_splits < 0:
        raise TypeError(f"num_splits: expected an int >= 0 (0 = heuristic), got {num_splits!r}")

    alibi = _check_alibi(alibi_slopes, batch, nheads)
    mask, window = derive_mask(_check_bool("causal", causal), _check_window(window_size), seqlen_q, capacity)
    attn = FwdArgs(batch=batch, seqlen_q=seqlen_q, seqlen_k=capacity, nheads=nheads, nheads_k=nheads_k,
                   head_dim=head_dim, dtype=_DTYPES[q.dtype],
                   softmax_scale=head_dim**-0.5 if softmax_scale is None else _check_positive("softmax_scale",
                                                                                              softmax_scale),
                   mask=mask, window_size=window, softcap=_check_softcap(softcap), alibi=alibi)
    return KvCacheArgs(attn=attn, new_rows=new_rows, rotary=rotary, num_splits=int(num_splits))


def validate_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k, v, rotary_cos, rotary_sin,
                     cache_seqlens, cache_batch_idx, cache_leftpad, block_table, **kwargs: Any) -> KvCacheArgs:
    """`check_kvcache` (same arguments), then every tensor on q's CUDA device, and under FLASH_GEN_DEBUG=1 the
    index values (a device-to-host copy): the full contract of flash_attn_with_kvcache."""
    tensors = dict(k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                   cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                   block_table=block_table)
    checked = check_kvcache(q, *tensors.values(), **kwargs)
    others = {name: t for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    check_device(q, alibi_slopes=kwargs.get("alibi_slopes"), **others)
    if settings.debug():
        capacity = checked.attn.seqlen_k
        _check_kvcache_values(cache_seqlens, checked.new_rows, capacity, cache_batch_idx, k_cache.shape[0],
                              block_table)
    return checked


def _check_kvcache_values(cache_seqlens, new_rows: int, capacity: int, cache_batch_idx, entries: int,
                          block_table) -> None:
    """FLASH_GEN_DEBUG=1: the index values, which need a device-to-host copy."""
    if isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.numel():
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        if lo < 0 or hi + new_rows > capacity:
            raise ValueError(f"cache_seqlens: values in [{lo}, {hi}] plus {new_rows} new rows must stay within the "
                             f"cache's {capacity} rows")
    for name, t, limit in (("cache_batch_idx", cache_batch_idx, entries), ("block_table", block_table, entries)):
        if t is not None and t.numel() and (int(t.min()) < 0 or int(t.max()) >= limit):
            raise ValueError(f"{name}: values must be in [0, {limit}), got [{int(t.min())}, {int(t.max())}]")


def _check_index(name: str, t: object, dims: int) -> None:
    _require_tensor(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name}: dtype must be torch.int32, got {t.dtype}")
    if t.dim() != dims or t.stride(-1) != 1:
        raise ValueError(f"{name}: expected a {dims}-D int32 tensor with a contiguous last dim, got shape "
                         f"{tuple(t.shape)} strides {t.stride()}")


def check_varlen_args(max_seqlen_q: object, max_seqlen_k: object) -> None:
    """The varlen functions' extra plain arguments: max_seqlen_* may be an int >= 0, a tensor or None (they are
    never needed)."""
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is None or isinstance(value, torch.Tensor):
            continue
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
            raise TypeError(f"{name}: expected an int >= 0, a tensor or None, got {value!r}")


def check_packed(name: str, t: object, parts: int, varlen: bool) -> None:
    """A packed tensor is (batch, seqlen, parts, nheads, head_dim), or (total, parts, nheads, head_dim) for a
    ragged batch: kv has 2 parts, qkv 3."""
    _require_tensor(name, t)
    rows = "total" if varlen else "batch, seqlen"
    if t.dim() != 4 + (not varlen) or t.shape[-3] != parts:
        raise ValueError(f"{name}: expected shape ({rows}, {parts}, nheads, head_dim), got {tuple(t.shape)}")


def check_bwd(
    dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, deterministic: bool, varlen: bool
) -> torch.Tensor:
    """Checks of the backward's extra inputs (q, k, v pass `check_fwd`). Returns dout with a dense, aligned
    last dim (a copy only when the incoming gradient is not, e.g. the expanded gradient of a sum)."""
    _require_tensor("dout", dout)
    if dout.dtype != q.dtype:
        raise TypeError(f"dout: dtype {dout.dtype} differs from q's dtype {q.dtype}")
    if dout.shape != q.shape:
        raise ValueError(f"dout: shape {tuple(dout.shape)} differs from q's shape {tuple(q.shape)}")
    if dout.device != q.device:
        raise ValueError(f"dout: device {dout.device} differs from q's device {q.device}")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out: expected the forward output, shape {tuple(q.shape)} {q.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    expected = lse_shape(q, varlen)
    if lse.shape != expected or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"softmax_lse: expected the forward's contiguous {expected} float32, got "
                         f"{tuple(lse.shape)} {lse.dtype} strides {lse.stride()}")
    _check_bool("deterministic", deterministic)
    try:
        _check_layout("dout", dout)
    except ValueError:
        dout = dout.contiguous()
    return dout


def lse_shape(q: torch.Tensor, varlen: bool) -> tuple[int, ...]:
    """softmax_lse's shape, as flash_attn returns it: (batch, nheads, seqlen_q), or (nheads, total_q)."""
    if varlen:
        return (q.shape[1], q.shape[0])
    b, s, h, _ = q.shape
    return (b, h, s)


def check_dropout_p(dropout_p: object) -> float:
    """dropout_p as a float in [0, 1) (1 would drop every probability and scale the rest by infinity)."""
    if not _is_real(dropout_p):
        raise TypeError(f"dropout_p: expected a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: must be in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def check_rng_state(dropout_p: float, rng_state: torch.Tensor | None, q: torch.Tensor) -> None:
    """A dropout call's seed (flash_gen.ops.dropout_seed): an int64 tensor on q's device, seed in element 0."""
    check_dropout_p(dropout_p)
    if dropout_p == 0:
        return
    _require_tensor("rng_state", rng_state)
    if rng_state.dtype != torch.int64 or rng_state.numel() < 1 or rng_state.device != q.device:
        raise ValueError(f"rng_state: expected an int64 tensor of at least one element on {q.device}, got "
                         f"{rng_state.dtype} {tuple(rng_state.shape)} on {rng_state.device}")


def _require_tensor(name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def _check_dim(t: torch.Tensor, name: str, axis: int, what: str, expected: int, ref: str) -> None:
    if t.shape[axis] != expected:
        raise ValueError(f"{name}: {what}={t.shape[axis]} does not match {ref}'s {what}={expected}")


def _check_paged(name: str, t: torch.Tensor) -> None:
    """A paged K/V cache (num_blocks, page_size, nheads_k, head_dim): at least one page, and element offsets of a
    page and of a row within its page below 2^32, as the kernels compute them in 32 bits."""
    if t.shape[0] < 1 or t.shape[1] < 1:
        raise ValueError(f"{name}: a paged cache needs at least one block of at least one row, got shape "
                         f"{tuple(t.shape)}")
    if t.stride(0) >= 2**32 or (t.shape[1] - 1) * t.stride(1) >= 2**32:
        raise ValueError(f"{name}: page and row strides must keep a page's offset below 2^32 elements, got strides "
                         f"{t.stride()}")


def _check_layout(name: str, t: torch.Tensor) -> None:
    """Only the head dim must be dense; batch/seqlen/head strides are free (views of packed tensors work)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must be contiguous (stride 1), got strides {t.stride()}")
    elems = VECTOR_BYTES // t.element_size()
    misaligned = [s for n, s in zip(t.shape[:-1], t.stride()[:-1]) if n > 1 and s % elems]
    if misaligned or t.data_ptr() % VECTOR_BYTES:
        raise ValueError(
            f"{name}: base address and strides must be {VECTOR_BYTES}-byte aligned (strides multiples of "
            f"{elems} elements), got strides {t.stride()} at address offset {t.data_ptr() % VECTOR_BYTES}"
        )


def _check_alibi(alibi_slopes: torch.Tensor | None, batch: int, nheads: int) -> bool:
    if alibi_slopes is None:
        return False
    _require_tensor("alibi_slopes", alibi_slopes)
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes: dtype must be torch.float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(
            f"alibi_slopes: shape must be (nheads,)=({nheads},) or (batch, nheads)=({batch}, {nheads}), "
            f"got {tuple(alibi_slopes.shape)}"
        )
    if not alibi_slopes.is_contiguous():
        raise ValueError(f"alibi_slopes: must be contiguous, got strides {alibi_slopes.stride()}")
    return True


def _check_window(window_size: object) -> tuple[int, int]:
    if not isinstance(window_size, (tuple, list)):
        raise TypeError(f"window_size: expected a (left, right) pair of ints, got {type(window_size).__name__}")
    if len(window_size) != 2:
        raise ValueError(f"window_size: expected a (left, right) pair, got {len(window_size)} values")
    for side in window_size:
        if type(side) is not int and (not isinstance(side, numbers.Integral) or isinstance(side, bool)):
            raise TypeError(f"window_size: entries must be ints, got {window_size!r}")
        if side < -1:
            raise ValueError(f"window_size: entries must be -1 (unbounded) or >= 0, got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _check_softcap(softcap: object) -> float:
    if not _is_real(softcap):
        raise TypeError(f"softcap: expected a float, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap: must be finite and >= 0 (0 = off), got {softcap!r}")
    return float(softcap)


def _check_positive(name: str, x: object) -> float:
    if not _is_real(x):
        raise TypeError(f"{name}: expected a float, got {type(x).__name__}")
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name}: must be a positive finite float, got {x!r}")
    return float(x)


def check_flag(name: str, x: object) -> bool:
    """A bool argument, by name (TypeError otherwise)."""
    return _check_bool(name, x)


def _check_bool(name: str, x: object) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__}")
    return x


def _is_real(x: object) -> bool:
    # Exact float/int first: isinstance against the numbers ABCs is slow, and this runs on every call.
    return type(x) is float or type(x) is int or (isinstance(x, numbers.Real) and not isinstance(x, bool))
