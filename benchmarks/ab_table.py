"""A/B table from `flash-gen bench --json` records of two trees timed alternately (scripts/ab_bench.sh): per cell
and flash_gen column (flash_gen, fg:NAME), each run's TFLOP/s, the change of their mean, and the change of TFLOP/s
per SM MHz (at the H200's power limit the clock moves with temperature, so runs minutes apart can differ by a few
percent at the same work per cycle). Runs anywhere (no GPU).

    python3 benchmarks/ab_table.py ab_base_1.json ab_base_2.json --new ab_new_1.json ab_new_2.json
"""

from __future__ import annotations

import argparse
import json
import statistics


def _ours(impl: str) -> bool:
    return impl == "flash_gen" or impl.startswith("fg:")


def _cells(record: dict) -> dict:
    return {(r["hdim"], r["causal"], r["seqlen"]): r for r in record["results"]}


def _per_mhz(row: dict, impl: str) -> float | None:
    """TFLOP/s per SM MHz of one record's cell, from the median clock its timings ran at (None without clocks)."""
    mhz = [m for m in row.get("samples_sm_mhz", {}).get(impl, []) if m]
    tflops = row["tflops"].get(impl)
    return tflops / statistics.median(mhz) if mhz and tflops else None


def ab_rows(base: list[dict], new: list[dict]) -> list[dict]:
    """One row per (cell, flash_gen column) present in every record: the TFLOP/s of each run and the relative
    change of the means (new over base - 1), overall and per SM MHz (None where a record lacks clocks)."""
    base_cells, new_cells = [_cells(r) for r in base], [_cells(r) for r in new]
    rows = []
    for cell in sorted(set.intersection(*(set(c) for c in base_cells + new_cells))):
        b_rows, n_rows = [c[cell] for c in base_cells], [c[cell] for c in new_cells]
        for impl in (i for i in b_rows[0]["tflops"] if _ours(i)):
            b = [r["tflops"].get(impl) for r in b_rows]
            n = [r["tflops"].get(impl) for r in n_rows]
            if None in b or None in n:
                continue
            bc, nc = [_per_mhz(r, impl) for r in b_rows], [_per_mhz(r, impl) for r in n_rows]
            per_clock = None if None in bc or None in nc else statistics.mean(nc) / statistics.mean(bc) - 1
            rows.append({"cell": cell, "impl": impl, "base": b, "new": n,
                         "change": statistics.mean(n) / statistics.mean(b) - 1, "per_clock": per_clock})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| hdim | causal | S | column | base | new | change | per SM MHz |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        hdim, causal, seqlen = r["cell"]
        runs = [" / ".join(f"{x:.0f}" for x in r[side]) for side in ("base", "new")]
        per_clock = "n/a" if r["per_clock"] is None else f"{r['per_clock'] * 100:+.1f}%"
        lines.append(f"| {hdim} | {'yes' if causal else 'no'} | {seqlen} | {r['impl']} | {runs[0]} | {runs[1]} | "
                     f"{r['change'] * 100:+.1f}% | {per_clock} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", nargs="+", help="the base tree's records")
    parser.add_argument("--new", nargs="+", required=True, help="the changed tree's records")
    args = parser.parse_args()
    load = lambda paths: [json.load(open(p)) for p in paths]  # noqa: E731
    print(table(ab_rows(load(args.base), load(args.new))))


if __name__ == "__main__":
    main()
