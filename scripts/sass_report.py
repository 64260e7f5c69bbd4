"""Opcode census of compiled kernels' SASS, read from the kernel cache: what to look at before guessing why a
kernel is slow (how the 2026-11-30 Hopper forward work found per-element F2FP/PRMT packing and N = 16 wgmmas).

    python3 scripts/sass_report.py 'fwd_sm90_bf16_hd128_none__wgm' [--cache .kernels] [--top 25]

For every cached kernel whose entry name matches the regular expression: the most frequent opcodes (static
counts over the whole kernel), the wgmma shapes (HGMMA.MxNxK), local-memory traffic (LDL/STL: spills) and the
wgmma waits (WARPGROUP.DEPBAR). Needs `cuobjdump`: on PATH, or the copy Triton's wheel carries
(`pip install --target /tmp/tp --no-deps triton` puts it under /tmp/tp/triton/backends/nvidia/bin).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

_OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.x]+)?")


def _cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    for root in [*sys.path, "/tmp/tp"]:
        candidate = Path(root) / "triton" / "backends" / "nvidia" / "bin" / "cuobjdump"
        if candidate.exists():
            return str(candidate)
    raise SystemExit("cuobjdump not found: see this script's docstring")


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pattern", help="regular expression matched against kernel entry names")
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("FLASH_GEN_CACHE_DIR", ".kernels")))
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    tool = _cuobjdump()
    found = 0
    for meta_path in sorted(args.cache.glob("*/*/*.json")):
        meta = json.loads(meta_path.read_text())
        entry = meta.get("entry", "")
        if not re.search(args.pattern, entry):
            continue
        found += 1
        cubin = args.cache / meta.get("cubin_file", meta_path.with_suffix(".cubin").relative_to(args.cache))
        listing = subprocess.run([tool, "-sass", "-fun", entry, str(cubin)], capture_output=True, text=True,
                                 check=True).stdout
        ops, shapes = census(listing)
        print(f"{entry}: {sum(ops.values())} instructions, {meta.get('registers')} registers, "
              f"spill stores {meta.get('spill_stores')} B")
        print("  " + "  ".join(f"{op} {n}" for op, n in ops.most_common(args.top)))
        print(f"  HGMMA shapes: {dict(shapes) or '-'}; LDL {ops['LDL']}, STL {ops['STL']}; "
              f"WARPGROUP.DEPBAR/ARRIVE {ops['WARPGROUP']}")
    if not found:
        print(f"no cached kernel matches {args.pattern!r} in {args.cache}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
