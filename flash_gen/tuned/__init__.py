"""The tuning database: per kernel key and sequence-length bucket, the fastest config found, its time, the
default's time and where it was measured. One human-readable JSON file per arch (flash_gen/tuned/<arch>.json),
written by `flash-gen tune` with sorted keys so it diffs cleanly, read here when the runtime picks a tiling.
Must not import torch or optuna.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from flash_gen import bwd_tilings, fwd_tilings, spec, spec_bwd, spec_bwd_sm90, spec_sm90

FORMAT = 1
TUNED_DIR = Path(__file__).resolve().parent  # <arch>.json files sit next to this reader


@dataclass(frozen=True)
class Entry:
    config: str  # FwdConfig / BwdConfig name
    ms: float  # total over the bucket's shapes
    default_config: str
    default_ms: float
    gpu: str
    driver: str
    date: str  # ISO 8601, UTC
    trials: int

    @property
    def speedup(self) -> float:
        return self.default_ms / self.ms if self.ms > 0 else 1.0


class TunedDb:
    """In-memory view of one arch's database file."""

    def __init__(self, arch: str, entries: dict[str, dict[str, Entry]] | None = None) -> None:
        self.arch = arch
        self.entries: dict[str, dict[str, Entry]] = entries or {}

    def lookup(self, key_name: str, bucket: str) -> Entry | None:
        return self.entries.get(key_name, {}).get(bucket)

    def live_config(self, key, bucket: str):
        """The config of `key`'s entry in `bucket`, or None where there is none or it is stale (_live)."""
        entry = self.lookup(key.name, bucket)
        return None if entry is None else _live(key, entry)

    def record(self, key_name: str, bucket: str, entry: Entry) -> None:
        self.entries.setdefault(key_name, {})[bucket] = entry

    def to_json(self) -> str:
        body = {
            "format": FORMAT,
            "arch": self.arch,
            "entries": {
                key: {b: {**asdict(e), "speedup": round(e.speedup, 4)} for b, e in sorted(buckets.items())}
                for key, buckets in sorted(self.entries.items())
            },
        }
        return json.dumps(body, indent=1, sort_keys=True) + "\n"

    def save(self, path: Path | None = None) -> Path:
        path = path or TUNED_DIR / f"{self.arch}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)  # atomic: a reader never sees half a file
        return path


def load(arch: str, path: Path | None = None) -> TunedDb:
    """The database for `arch` (empty when the file does not exist). Raises ValueError on a file of another
    format or arch."""
    path = path or TUNED_DIR / f"{arch}.json"
    if not path.exists():
        return TunedDb(arch)
    raw = json.loads(path.read_text())
    if raw.get("format") != FORMAT or raw.get("arch") != arch:
        raise ValueError(f"{path}: not a format-{FORMAT} tuning database for {arch}")
    fields = set(Entry.__dataclass_fields__)
    entries = {key: {b: Entry(**{k: v for k, v in e.items() if k in fields}) for b, e in buckets.items()}
               for key, buckets in raw["entries"].items()}
    return TunedDb(arch, entries)


@functools.lru_cache(maxsize=None)
def shipped(arch: str) -> TunedDb:
    """The database that ships with flash_gen for `arch` (read once per process)."""
    return load(arch)


def tuned_config(key, bucket: str):
    """The tuned config for `key` in `bucket` (flash_gen.spec.bucket_name), or None: the first of tuned_configs."""
    configs = tuned_configs(key, bucket)
    return configs[0] if configs else None


def tuned_configs(key, bucket: str) -> tuple:
    """`key`'s own entry in `bucket` alone, else derived_configs (the runtime takes the first without spills)."""
    own = shipped(key.arch).live_config(key, bucket)
    return (own,) if own is not None else derived_configs(key, bucket)


def derived_configs(key, bucket: str) -> tuple:
    """For a key without an entry of its own in `bucket`: the tilings it may take from the entry of the head dim its
    kernel computes (spec_sm90.sm90_head_dim), preferred first; () where there is none or the key cannot run it.
    88 runs 128's GEMMs, so 128's tiling, with aligned rows (spec_sm90.aligned_if_misaligned), then as is: no tuner
    compiled them for this head dim, so the runtime takes the first that compiles without spills (the aligned 192-row
    max-free tiling of 128 spills 4 B at 120 causal). Keys whose rows sit differently in memory can differ more: 72
    (as 80) has entries of its own. A Hopper backward key likewise takes those of the head dim whose kernels it
    shares (spec_bwd_sm90.sm90_bwd_tuned_key: 72-88 96's, 104-120 128's, 136-184 192's, 200-248 256's)."""
    computed = computed_key(key)
    cfg = None if computed is None else shipped(key.arch).live_config(computed, bucket)
    tilings = bwd_tilings if isinstance(key, spec_bwd.BwdKey) else fwd_tilings
    if cfg is None or tilings.infeasible_reason(key, cfg) is not None:
        return ()  # never one the key itself cannot run (the runtime would raise)
    if isinstance(cfg, spec_sm90.Sm90FwdConfig):
        aligned = spec_sm90.aligned_if_misaligned(key, cfg)
        return (aligned, cfg) if aligned != cfg else (cfg,)
    return (cfg,)


def computed_key(key):
    """The key whose entries a Hopper key without its own takes (tuned_config), where that is another; else None."""
    if key.arch != "sm90":
        return None
    computed = spec_sm90.sm90_computed_key(key) if isinstance(key, spec.FwdKey) else \
        spec_bwd_sm90.sm90_bwd_tuned_key(key)
    return computed if computed != key else None


def live_configs(arch: str) -> Iterator[tuple]:
    """(key, config) of every entry of the shipped database that tuned_config would return."""
    for name, buckets in shipped(arch).entries.items():
        key = spec_bwd.bwd_key_from_name(name) if name.startswith("bwd") else spec.key_from_name(name)
        for entry in buckets.values():
            cfg = _live(key, entry)
            if cfg is not None:
                yield key, cfg


def _live(key, entry: Entry):
    """The entry's config, or None where it is stale: tuned against another default than today's (a faster
    kernel family or tiling has become the default since), or rejected by the current feasibility rules."""
    if isinstance(key, spec_bwd.BwdKey):
        defaults, cfg = (bwd_tilings.default_config(key),), bwd_tilings.config_from_name(entry.config)
        feasible = bwd_tilings.infeasible_reason(key, cfg) is None
    else:
        defaults, cfg = fwd_tilings.measured_defaults(key), fwd_tilings.config_from_name(entry.config)
        feasible = fwd_tilings.infeasible_reason(key, cfg) is None
    return cfg if feasible and entry.default_config in {d.name for d in defaults} else None
