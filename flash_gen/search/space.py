"""What one tune covers: a family (direction, arch, dtype, head dim, mask), its sequence-length buckets with
their representative shapes, and the search space of the family's template.

The axes and their constraints are the template's own declaration, next to the config dataclasses the templates
are rendered from: flash_gen.spec_sm90.SM90_CONFIG_SPACE (forward keys the Hopper kernel runs: the default's
family is searched), flash_gen.spec.CONFIG_SPACE (other forward and decoding keys) and
flash_gen.spec_bwd_sm90.SM90_BWD_CONFIG_SPACE and flash_gen.spec_bwd.BWD_CONFIG_SPACE (backward: the default's family
again), each pruned by its infeasible_reason. Must not import torch or
optuna.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable, Iterator

from flash_gen import bwd_tilings, fwd_tilings, spec, spec_bwd, spec_bwd_sm90, spec_sm90

DIRECTIONS = ("fwd", "bwd", "decode")


@dataclass(frozen=True)
class Shape:
    """One timed call: batch, query and key lengths, query and KV heads."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int


@dataclass(frozen=True)
class Bucket:
    """A range of sequence lengths tuned as one: the best config minimises the total time over `shapes`."""

    name: str  # also the database key, e.g. "s<=1k"
    max_seqlen: int  # inclusive upper bound of the seqlen_k this bucket serves (0: unbounded)
    shapes: tuple[Shape, ...]


@dataclass(frozen=True)
class Family:
    """One tune: every config of one kernel key, per bucket."""

    direction: str  # fwd | bwd | decode
    arch: str
    dtype: str
    head_dim: int
    mask: str
    dropout: float = 0.0  # > 0: the dropout keys, measured at this dropout_p (training directions only)

    @property
    def key(self) -> spec.FwdKey | spec_bwd.BwdKey:
        if self.direction == "bwd":
            return spec_bwd.BwdKey(self.arch, self.dtype, self.head_dim, self.mask, dropout=self.dropout > 0)
        if self.direction == "decode":  # a contiguous cache with pack-GQA, as decoding steps run
            return spec.FwdKey(self.arch, self.dtype, self.head_dim, self.mask, kv="cache", pack_gqa=True)
        return spec.FwdKey(self.arch, self.dtype, self.head_dim, self.mask, dropout=self.dropout > 0)

    @property
    def name(self) -> str:
        return f"{self.direction}:{self.key.name}"

    @property
    def kernel_keys(self) -> tuple:
        """Every kernel a config of this family runs: decoding also launches its split-KV form."""
        key = self.key
        return (key, dataclasses.replace(key, split=True)) if self.direction == "decode" else (key,)


def buckets(family: Family) -> tuple[Bucket, ...]:
    """flash_gen.spec.BUCKETS with representative shapes: shared/ANCHORS.md's convention for training (total
    tokens 32k, 2048 / head dim heads); GQA 32/8 heads, one query row per entry, for decoding."""
    heads = max(1, 2048 // family.head_dim)

    def train(seqlen: int) -> Shape:
        return Shape(max(1, 32768 // seqlen), seqlen, seqlen, heads, heads)

    def dec(batch: int, cache: int) -> Shape:
        return Shape(batch, 1, cache, 32, 8)

    shapes = {
        "s<=1k": (train(512), train(1024)),
        "s<=4k": (train(2048), train(4096)),
        "s>4k": (train(8192), train(16384)),
        "cache<=8k": (dec(1, 8192), dec(32, 4096), dec(128, 2048)),
        "cache>8k": (dec(1, 65536), dec(8, 32768), dec(32, 16384)),
    }
    return tuple(Bucket(name, limit, shapes[name]) for name, limit in spec.BUCKETS[family.direction])


def bucket_for(family_buckets: tuple[Bucket, ...], seqlen_k: int) -> Bucket:
    """The bucket that serves calls with this key length."""
    for b in family_buckets:
        if b.max_seqlen == 0 or seqlen_k <= b.max_seqlen:
            return b
    return family_buckets[-1]


def _hopper(family: Family) -> bool:
    """Whether the family's default is a Hopper (wgmma) kernel, whose template's space is then searched."""
    if family.direction == "bwd":
        return isinstance(bwd_tilings.default_config(family.key), spec_bwd_sm90.Sm90BwdConfig)
    return family.direction == "fwd" and spec_sm90.default_sm90_config(family.key) is not None


def axes(family: Family) -> dict[str, tuple]:
    """The template's tunable axes for this family."""
    if family.direction == "bwd":
        return dict(spec_bwd_sm90.SM90_BWD_CONFIG_SPACE if _hopper(family) else spec_bwd.BWD_CONFIG_SPACE)
    return dict(spec_sm90.SM90_CONFIG_SPACE if _hopper(family) else spec.CONFIG_SPACE)


def make_config(family: Family, params: dict) -> fwd_tilings.FwdTiling | bwd_tilings.BwdTiling:
    if family.direction == "bwd":
        return spec_bwd_sm90.Sm90BwdConfig(**params) if _hopper(family) else spec_bwd.BwdConfig(**params)
    return spec_sm90.Sm90FwdConfig(**params) if _hopper(family) else spec.FwdConfig(**params)


def infeasible(family: Family, cfg) -> str | None:
    """The static model's verdict (shared memory, registers, divisibility) before anything compiles."""
    if family.direction == "bwd":
        return bwd_tilings.infeasible_reason(family.key, cfg)
    return fwd_tilings.infeasible_reason(family.key, cfg)


def default_config(family: Family):
    """The tiling a family's candidates are measured against: decoding steps run the portable kernel's
    (fwd_tilings.cache_chunk_runs_hopper)."""
    key = family.key
    if family.direction == "bwd":
        return bwd_tilings.default_config(key)
    return fwd_tilings.portable_config(key) if family.direction == "decode" else fwd_tilings.default_config(key)


def feasible_configs(family: Family) -> Iterator:
    """Every point of the space that passes the static model."""
    names = list(axes(family))
    for values in itertools.product(*axes(family).values()):
        cfg = make_config(family, dict(zip(names, values)))
        if infeasible(family, cfg) is None:
            yield cfg


def families(archs, dtypes, head_dims, masks, directions, dropout: float = 0.0) -> list[Family]:
    """Every (direction, arch, dtype, head dim, mask) family; with `dropout` > 0 the training directions' dropout
    keys (decoding has no dropout)."""
    if dropout and "decode" in directions:
        raise ValueError("dropout: the training directions (fwd, bwd) only; decoding has no dropout")
    return [Family(d, a, t, h, m, dropout)
            for d, a, t, h, m in itertools.product(directions, archs, dtypes, head_dims, masks)]


def space_size(family: Family) -> tuple[int, int]:
    """(points in the product of the axes, points the static model keeps): what --dry-run prints."""
    total = 1
    for values in axes(family).values():
        total *= len(values)
    return total, sum(1 for _ in feasible_configs(family))


Suggest = Callable[[str, list], object]  # optuna's trial.suggest_categorical(name, choices)


def suggest_config(family: Family, suggest: Suggest):
    """One point of the space, drawn axis by axis through `suggest` (the sampler sees the axes, so TPE can
    learn from each); the caller rejects it with `infeasible` before compiling."""
    return make_config(family, {name: suggest(name, list(values)) for name, values in axes(family).items()})
