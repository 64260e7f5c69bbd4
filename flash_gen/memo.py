"""Host-side memos of the eager call path: what a call's argument layout fixes (checks, plans, parameter
templates, TMA maps) is worked out once per layout, so a repeated call only patches in its addresses."""

from __future__ import annotations

from typing import Hashable, TypeVar

import torch

V = TypeVar("V")


class BoundedMemo(dict):
    """A dict emptied when it reaches `limit` entries: keys that never repeat (shapes, addresses) cannot grow it
    without bound, and a steady workload's few keys are hits again after one miss each. Lookups are dict.get."""

    __slots__ = ("limit",)

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key: Hashable, value: V) -> V:
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value


def layout(t: torch.Tensor | None) -> tuple | None:
    """What checks and plans read of a tensor besides its address: shape, strides, dtype and device (get_device:
    an int, cheaper to get and hash than a torch.device; -1 off CUDA)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device())
