"""A cubin's SASS through cuobjdump, where one is installed, and what the compile check reads from it: how many
batches a kernel's HGMMAs form.

ptxas reports serialising a kernel's wgmmas (its C7515 notice, read by build/nvrtc.py) in most cases but not all:
with wgmmas in flight across a branch on the warpgroup (a decoupled backward tiling) it re-staged their register A
operands per k-block and waited after every one without a word (2026-12-04, docs/hopper_backward.md). The listing
shows it either way: most HGMMAs then close a batch of their own (marked gsb0, what WARPGROUP.DEPBAR waits on).
Without cuobjdump (and the nvdisasm it runs: a CPU machine without the CUDA toolkit or their wheels) nothing is
read. scripts/sass_report.py prints the same census by hand.

Must not import torch or anything under flash_gen.runtime.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# One instruction of a cuobjdump -sass listing: its opcode (group 1) and modifiers (group 2), after any predicate.
OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.x]+)?")
_FUNCTION = re.compile(r"^\s*Function : (\S+)", re.MULTILINE)


@functools.cache
def cuobjdump() -> str | None:
    """The cuobjdump to run: on PATH, else the nvidia-cuda-cuobjdump wheel's or Triton's copy; None without one."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    for root in sys.path:
        for relative in ("nvidia/cu13/bin/cuobjdump", "triton/backends/nvidia/bin/cuobjdump"):
            candidate = Path(root or ".") / relative
            if candidate.is_file():
                return str(candidate)
    return None


def functions(cubin: bytes) -> dict[str, str] | None:
    """Each kernel's listing in `cubin`, by name; None without cuobjdump or when it fails."""
    tool = cuobjdump()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        env = dict(os.environ)
        if (Path(tool).parent / "nvdisasm").is_file():  # a wheel's or Triton's pair, not on PATH
            env["NVDISASM_PATH"] = str(Path(tool).parent)
        try:
            run = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, timeout=120, env=env)
        except (OSError, subprocess.TimeoutExpired):
            return None
    if run.returncode:
        return None
    parts = _FUNCTION.split(run.stdout)  # [preamble, name, listing, name, listing, ...]
    return dict(zip(parts[1::2], parts[2::2]))


def hgmma_batches(listing: str) -> tuple[int, int]:
    """(HGMMAs, those that close a batch) of a listing."""
    hgmma = [line for line in listing.splitlines() if (m := OPCODE.match(line)) and m.group(1) == "HGMMA"]
    return len(hgmma), sum("gsb0" in line for line in hgmma)


def serialised(hgmmas: int, batches: int) -> bool:
    """Whether most HGMMAs close a batch of their own, each waited for before the next. The kernels' own batches
    hold 4-16 HGMMAs (none of 217 cached sm_90a kernels came near this, 2026-12-04)."""
    return hgmmas >= 8 and 2 * batches > hgmmas
