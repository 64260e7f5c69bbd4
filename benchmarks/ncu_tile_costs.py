"""Where a short kernel run loses time against a long one of the same kernel: ncu's per-SASS-instruction warp stall
samples of both, each instruction classed by how its execution count grows from the short run to the long one
(by the key-length ratio: once per key step; by about 1: once per tile, or per CTA), and the short run's samples set
against the long run's scaled down by that ratio. Runs anywhere (no GPU); the inputs come from a GPU machine:

    FLASH_GEN_FWD_CONFIG=wgm128n64s2_persist ncu --clock-control none -k regex:fwd_sm90 -s 1 -c 1 \\
        --section SourceCounters -o short python3 benchmarks/profile_fwd_sm90.py none --hdim 256 --seqlen 2048
    (the same with --seqlen 16384 -o long)
    ncu -i short.ncu-rep --page source --csv --print-source sass > short.csv   (and long.csv)
    python3 benchmarks/ncu_tile_costs.py short.csv long.csv --ratio 8

Both runs must launch the same number of tiles (docs/hopper_forward.md, "Head dim 256 non-causal, 2k against 16k").
"""

from __future__ import annotations

import argparse
import csv
import sys
from typing import NamedTuple

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


class Instr(NamedTuple):
    sass: str
    samples: int
    executed: int
    stalls: dict[str, int]


def read(path: str) -> list[Instr]:
    """The instructions of ncu's `--page source --csv --print-source sass` export, in address order."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = next(i for i, r in enumerate(rows) if "Source" in r and SAMPLES in r)
    names = rows[header]
    col = {n: names.index(n) for n in ("Source", SAMPLES, EXECUTED)}
    stall_cols = {n[len("stall_"):]: i for i, n in enumerate(names) if n.startswith("stall_") and "Not Issued" not in n}
    count = lambda r, i: int(r[i] or 0)  # noqa: E731
    return [Instr(r[col["Source"]].strip(), count(r, col[SAMPLES]), count(r, col[EXECUTED]),
                  {k: count(r, i) for k, i in stall_cols.items()})
            for r in rows[header + 1:] if len(r) == len(names)]


def kind(short: Instr, long: Instr, ratio: float) -> str:
    """'step' where the execution count grows by about `ratio`, 'tile' where it stays, else 'other' or 'never'."""
    if short.executed == 0:
        return "never"
    grows = long.executed / short.executed
    if grows > ratio * 0.75:
        return "step"
    return "tile" if 0.8 < grows < 1.25 else "other"


def report(short: list[Instr], long: list[Instr], ratio: float, top: int = 10) -> str:
    if len(short) != len(long) or any(a.sass.split()[:1] != b.sass.split()[:1] for a, b in zip(short, long)):
        raise ValueError("the two exports are not of the same kernel (instruction lists differ)")
    kinds = [kind(a, b, ratio) for a, b in zip(short, long)]
    lines = ["| instructions | samples, short | long / ratio | short's extra |", "|---|---|---|---|"]
    for k in ("step", "tile", "other", "never"):
        pairs = [(a, b) for a, b, kk in zip(short, long, kinds) if kk == k]
        if pairs:
            mine, theirs = sum(a.samples for a, _ in pairs), sum(b.samples for _, b in pairs) / ratio
            lines.append(f"| {k} ({len(pairs)}) | {mine:,} | {theirs:,.0f} | {mine - theirs:+,.0f} |")
    total, scaled = sum(a.samples for a in short), sum(b.samples for b in long) / ratio
    share = (total - scaled) / total
    lines.append(f"| all | {total:,} | {scaled:,.0f} | {total - scaled:+,.0f} ({share:.1%} of the short run's) |")
    extra = sorted(range(len(short)), key=lambda i: short[i].samples - long[i].samples / ratio, reverse=True)
    lines += ["", "| # | kind | samples, short | long / ratio | top stall | SASS |", "|---|---|---|---|---|---|"]
    for i in extra[:top]:
        reason = max(short[i].stalls.items(), key=lambda kv: kv[1], default=("", 0))[0]
        lines.append(f"| {i} | {kinds[i]} | {short[i].samples:,} | {long[i].samples / ratio:,.1f} | {reason} | "
                     f"`{short[i].sass}` |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("short", help="source-page CSV export of the short run")
    ap.add_argument("long", help="the same of the long run")
    ap.add_argument("--ratio", type=float, required=True, help="key steps per tile, long over short (16k / 2k: 8)")
    ap.add_argument("--top", type=int, default=10, help="per-instruction rows, the largest extras first")
    args = ap.parse_args()
    print(report(read(args.short), read(args.long), args.ratio, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
