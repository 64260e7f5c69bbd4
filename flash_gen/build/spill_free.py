"""No default kernel spills registers: each kernel key has a chain of default tilings, fastest first
(flash_gen.fwd_tilings.default_configs, flash_gen.bwd_tilings.default_configs), and the tiling that runs is the
first of the chain whose ptxas report shows no spill stores or loads. Which tiling spills depends on the arch, the
features and NVRTC's version (at backward head dim 128, ALiBi or a packed batch tips a 255-register kernel over
on sm80), so it is decided by compiling, not by a table.

Three callers walk a chain the same way: the runtime one tiling at a time through the library / cache / JIT
(`choose`), `flash-gen compile` and the GPU-test prebuild in parallel rounds (`compile_resolved`), and
`flash-gen build` against its manifest. Tuned and forced tilings are not replaced: the tuner rejects spilling
candidates itself, and a forced one is the user's choice. Must not import torch.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Callable, Iterable, Sequence, Union

from flash_gen import bwd_tilings, fwd_tilings, settings
from flash_gen.build.batches import Compiled, compile_batch, plan_batches
from flash_gen.spec import FwdKey
from flash_gen.spec_bwd import BwdKey

Key = Union[FwdKey, BwdKey]
Tiling = Union[fwd_tilings.FwdTiling, bwd_tilings.BwdTiling]


def chain(key: Key) -> tuple[Tiling, ...]:
    """`key`'s default tilings, fastest first."""
    return bwd_tilings.default_configs(key) if isinstance(key, BwdKey) else fwd_tilings.default_configs(key)


def fallback(key: Key, cfg: Tiling) -> Tiling | None:
    """The tiling to try after `cfg` spilled for `key`: the next in `key`'s chain, or None when `cfg` is the
    chain's last or not in it."""
    tilings = chain(key)
    i = tilings.index(cfg) + 1 if cfg in tilings else len(tilings)
    return tilings[i] if i < len(tilings) else None


def fallbacks(spilled: Iterable[tuple[Key, Tiling]]) -> list[tuple[Key, Tiling]]:
    """The next round of a chain walk: (key, next tiling) for each (key, tiling) that spilled and has a next."""
    return [(k, nxt) for k, c in spilled if (nxt := fallback(k, c)) is not None]


def choose(key: Key, spill_bytes: Callable[[Tiling], int], start: Tiling | None = None) -> Tiling:
    """The first tiling of `key`'s chain, from `start` (default: its head) on, for which `spill_bytes(tiling)`
    (which compiles it, or finds it compiled) is 0; `start`, logged, when every one spills."""
    head = start or chain(key)[0]
    cfg = head
    while cfg is not None:
        if spill_bytes(cfg) == 0:
            return cfg
        cfg = fallback(key, cfg)
    settings.logger().warning("every default tiling of %s spills registers; running %s", key.name, head.name)
    return head


def compile_resolved(variants: Sequence[tuple], jobs: int, pool: Executor,
                     on_batch: Callable[[list[Compiled]], None] = lambda batch: None) -> list[Compiled]:
    """Compile (key, tiling) pairs in parallel batches (flash_gen.build.batches), then, in further rounds, the
    fallback of each one that spilled, until no default spills or its chain is exhausted. Returns every compile
    in the order done; for each key the last of its compiles is the one the runtime will run."""
    done: list[Compiled] = []
    pending = list(variants)
    while pending:
        rnd = []
        for batch in pool.map(compile_batch, plan_batches(pending, jobs)):
            on_batch(batch)
            rnd += batch
        done += rnd
        pending = fallbacks((c.key, c.cfg) for c in rnd if c.result is not None and c.result.spills)
    return done
