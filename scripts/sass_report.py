"""Opcode census of compiled kernels' SASS, read from the kernel cache: what to look at before guessing why a
kernel is slow (how the 2026-11-30 Hopper forward work found per-element F2FP/PRMT packing and N = 16 wgmmas).

    python3 scripts/sass_report.py 'fwd_sm90_bf16_hd128_none__wgm' [--cache .kernels] [--top 25]

For every cached kernel whose entry name matches the regular expression: the most frequent opcodes (static
counts over the whole kernel), the wgmma shapes (HGMMA.MxNxK), local-memory traffic (LDL/STL: spills) and the
wgmma waits (WARPGROUP.DEPBAR), and how many batches the HGMMAs form (most HGMMAs each a batch of its own:
serialised, which ptxas does not always report). With --spans, also the code between synchronisation points (wgmma
waits and arrives, block barriers, mbarrier waits), in address order, with each span's length and commonest opcodes:
where a step's instructions go (2026-12-02: 90 of the backward's 352 between the S^T wait and the dK/dV wgmmas were dS
stores through generic addresses). Needs `cuobjdump` (and `nvdisasm`) on PATH, or the `nvidia-cuda-cuobjdump` (and
`nvidia-cuda-nvdisasm`) wheels or Triton's wheel installed where Python imports from (flash_gen.build.sass).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from pathlib import Path

from flash_gen.build.sass import OPCODE as _OPCODE, cuobjdump, functions, hgmma_batches, serialised


def census(sass: str) -> tuple[collections.Counter, collections.Counter]:
    """(opcode counts, HGMMA shape counts) of a cuobjdump -sass listing."""
    ops, shapes = collections.Counter(), collections.Counter()
    for line in sass.splitlines():
        m = _OPCODE.match(line)
        if m:
            ops[m.group(1)] += 1
            if m.group(1) == "HGMMA":
                shapes[(m.group(2) or "").split(".")[1]] += 1
    return ops, shapes


_SYNC_POINTS = ("WARPGROUP", "BAR", "SYNCS")  # wgmma arrive/wait, named and block barriers, mbarrier waits
_ADDRESS = re.compile(r"^\s*/\*([0-9a-f]+)\*/")


def spans(sass: str, min_len: int = 1) -> list[tuple[int, str, int, collections.Counter]]:
    """The listing cut before every synchronisation point: (address, the opcode that opens the span, instruction
    count, opcode counts) of each span of at least `min_len` instructions."""
    out, current = [], None
    for line in sass.splitlines():
        m = _OPCODE.match(line)
        if not m:
            continue
        op = m.group(1)
        if current is None or op in _SYNC_POINTS:
            if current is not None and current[2] >= min_len:
                out.append(current)
            current = [int(_ADDRESS.match(line).group(1), 16), op + (m.group(2) or ""), 0, collections.Counter()]
        current[2] += 1
        current[3][op] += 1
    if current is not None and current[2] >= min_len:
        out.append(current)
    return [tuple(s) for s in out]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pattern", help="regular expression matched against kernel entry names")
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("FLASH_GEN_CACHE_DIR", ".kernels")))
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--spans", type=int, default=0, metavar="N",
                        help="also list the spans between synchronisation points of at least N instructions")
    args = parser.parse_args()
    if cuobjdump() is None:
        raise SystemExit("cuobjdump not found: see this script's docstring")
    found = 0
    listings: dict[Path, dict[str, str]] = {}  # by cubin: kernels of one batch share it
    for meta_path in sorted(args.cache.glob("*/*/*.json")):
        meta = json.loads(meta_path.read_text())
        entry = meta.get("entry", "")
        if not re.search(args.pattern, entry):
            continue
        found += 1
        cubin = args.cache / meta.get("cubin_file", meta_path.with_suffix(".cubin").relative_to(args.cache))
        if cubin not in listings:
            listings[cubin] = functions(cubin.read_bytes()) or {}
        if entry not in listings[cubin]:
            raise SystemExit(f"cuobjdump gave no listing of {entry} in {cubin}")
        listing = listings[cubin][entry]
        ops, shapes = census(listing)
        print(f"{entry}: {sum(ops.values())} instructions, {meta.get('registers')} registers, "
              f"spill stores {meta.get('spill_stores')} B")
        print("  " + "  ".join(f"{op} {n}" for op, n in ops.most_common(args.top)))
        hgmmas, batches = hgmma_batches(listing)
        print(f"  HGMMA shapes: {dict(shapes) or '-'}, in {batches} batches"
              f"{' (SERIALISED: most HGMMAs wait for the one before)' if serialised(hgmmas, batches) else ''}; "
              f"LDL {ops['LDL']}, STL {ops['STL']}; WARPGROUP.DEPBAR/ARRIVE {ops['WARPGROUP']}")
        for address, opener, count, span_ops in spans(listing, args.spans) if args.spans else ():
            print(f"  {address:#07x} {opener:28s} {count:4d}: " + "  ".join(
                f"{op} {n}" for op, n in span_ops.most_common(6)))
    if not found:
        print(f"no cached kernel matches {args.pattern!r} in {args.cache}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
