"""A `flash-gen bench --json` file as the Markdown table docs/benchmarks.md uses: a row per cell, TFLOP/s per
implementation, flash_gen's ratio to each peer, and optionally each implementation's median SM clock and power
over its timings (--clocks) and the ratios of another run of the same cells (--against). Runs anywhere (no GPU).

    python3 benchmarks/table_bench.py docs/bench_sm90_fwd_2026-12-02c.json --clocks --against docs/bench_sm90_fwd_2026-12-02b.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

PEERS = {"flash": "FA2", "cudnn": "cuDNN", "fa4": "FA4"}


def _cell(row: dict) -> tuple:
    return row["hdim"], row["causal"], row["seqlen"]


def _ratios(row: dict, peers: list[str]) -> list[float | None]:
    mine = row["tflops"].get("flash_gen")
    return [mine / row["tflops"][p] if mine and row["tflops"].get(p) else None for p in peers]


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def table(data: dict, clocks: bool = False, against: dict | None = None) -> str:
    """The Markdown table of one bench record; `against`: another record whose cells' ratios get a column each."""
    results = data["results"]
    impls = list(results[0]["tflops"])
    peers = [p for p in PEERS if p in impls]
    other = {_cell(r): r for r in against["results"]} if against else {}
    head = ["hdim", "causal", "S", *(PEERS.get(i, i) for i in impls), *(f"fg/{PEERS[p]}" for p in peers)]
    if clocks:
        head += ["SM MHz", "W"]
    if against:
        head += [f"fg/{PEERS[p]}, {against['date'][11:16]}" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results:
        cells = [str(row["hdim"]), "yes" if row["causal"] else "no", str(row["seqlen"])]
        cells += [_fmt(row["tflops"][i], ".0f") for i in impls]
        cells += [_fmt(r, ".2f") for r in _ratios(row, peers)]
        if clocks:
            for field, spec in (("samples_sm_mhz", ".0f"), ("samples_power_w", ".0f")):
                per_impl = row.get(field, {})
                cells.append(", ".join(_fmt(_median(per_impl.get(i, [])), spec) for i in impls))
        if against:
            prev = other.get(_cell(row))
            cells += [_fmt(r, ".2f") for r in (_ratios(prev, peers) if prev else [None] * len(peers))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", help="a flash-gen bench --json file")
    parser.add_argument("--clocks", action="store_true", help="median SM clock and power per implementation")
    parser.add_argument("--against", help="another bench JSON of the same cells: its ratios as extra columns")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    against = None
    if args.against:
        with open(args.against) as f:
            against = json.load(f)
    print(table(data, args.clocks, against))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
