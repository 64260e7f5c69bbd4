"""`flash-gen tune --verify`: re-measure what the tuning database claims, writing nothing. For each family and
bucket with a live entry (one the runtime would use), the entry's config and the family's default are compiled in
worker processes, as the tune does, then checked against the reference and timed on every shape of the bucket with
the tuner's own Measurer. The table gives the database's and today's totals, and the tuned config's speedup over
the default on each shape: the bar is that no tuned config is slower than the default on any tuned shape.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor

from flash_gen import tuned as database
from flash_gen.search import space
from flash_gen.search.tune import SHAPE_NOISE, compile_candidate


def _compile(item: tuple[space.Family, object]):
    return compile_candidate(*item)


def live_entries(db: database.TunedDb, families: list[space.Family]) -> list[tuple]:
    """(family, bucket, entry, tuned config, default config) of each entry the runtime would use."""
    rows = []
    for fam in families:
        for bucket in space.buckets(fam):
            entry = db.lookup(fam.key.name, bucket.name)
            cfg = None if entry is None else db.live_config(fam.key, bucket.name)
            if cfg is not None:
                rows.append((fam, bucket, entry, cfg, space.default_config(fam)))
    return rows


def verify(args: argparse.Namespace, families: list[space.Family]) -> int:
    """Exit status 1 when a tuned config is wrong or slower than the default beyond SHAPE_NOISE on some shape."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from flash_gen.search.measure import Measurer

    if not torch.cuda.is_available():
        print("flash-gen tune --verify measures on a GPU", file=sys.stderr)
        return 2
    rows = live_entries(database.load(families[0].arch, args.database), families) if families else []
    todo = list(dict.fromkeys((fam, c) for fam, _, _, cfg, default in rows for c in (cfg, default)))
    with ProcessPoolExecutor(max_workers=args.jobs or os.cpu_count() or 1) as pool:
        compiled = dict(zip(todo, pool.map(_compile, todo)))

    table = Table(title=f"flash-gen tune --verify: the database against {torch.cuda.get_device_name()}")
    for col in ("family", "bucket", "config", "db ms", "ms", "default", "db default ms", "default ms", "db speedup",
                "speedup per shape"):
        table.add_column(col, justify="left" if col in ("family", "bucket", "config", "default") else "right")
    failed = 0
    for fam, bucket, entry, cfg, default in rows:
        measure = Measurer(fam, bucket)
        problem = compiled[(fam, cfg)] or compiled[(fam, default)]
        problem = problem.reason if problem is not None else measure.check(cfg)
        if problem is not None:
            failed += 1
            table.add_row(fam.name, bucket.name, cfg.name, f"{entry.ms:.3f}", "-", default.name, "", "", "",
                          f"failed: {problem}")
            continue
        ms = [measure.time(cfg, s) for s in bucket.shapes]
        default_ms = ms if default == cfg else [measure.time(default, s) for s in bucket.shapes]
        speedups = [d / t for d, t in zip(default_ms, ms)]
        failed += min(speedups) < 1 - SHAPE_NOISE
        table.add_row(fam.name, bucket.name, cfg.name, f"{entry.ms:.3f}", f"{sum(ms):.3f}", default.name,
                      f"{entry.default_ms:.3f}", f"{sum(default_ms):.3f}", f"{entry.speedup:.3f}",
                      " ".join(f"{s:.3f}" for s in speedups))
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    print(f"{len(rows)} entries re-measured; {failed} wrong or slower than the default beyond {SHAPE_NOISE:.0%} "
          "on a shape")
    return 1 if failed else 0
