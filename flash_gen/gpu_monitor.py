"""The GPU's SM clock and power draw, sampled by nvidia-smi in the background while a benchmark runs.

A timing is only comparable to another taken at the same clock: on the H200 one kernel, timed twice in one cell,
read up to 8% apart (2026-12-02). The benchmark records, for each timing, the clock and power the card ran at.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
from datetime import datetime

QUERY = "timestamp,clocks.sm,power.draw"
TIMESTAMP_FORMAT = "%Y/%m/%d %H:%M:%S.%f"  # nvidia-smi's, in the machine's local time


def parse_samples(text: str) -> list[tuple[datetime, float, float]]:
    """(local time, SM MHz, watts) per line of `nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits`;
    lines that do not parse ("[N/A]" power, a truncated last line) are left out."""
    samples = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3:
            continue
        try:
            samples.append((datetime.strptime(fields[0], TIMESTAMP_FORMAT), float(fields[1]), float(fields[2])))
        except ValueError:
            continue
    return samples


class GpuMonitor:
    """Context manager: nvidia-smi samples one GPU (`gpu`: nvidia-smi's --id, an index or "GPU-<uuid>") every
    `period_ms` until exit. Without nvidia-smi it records nothing and `window` answers None, so a benchmark runs
    the same with or without it."""

    def __init__(self, gpu: str, period_ms: int = 50) -> None:
        self.gpu, self.period_ms = gpu, period_ms
        self.samples: list[tuple[datetime, float, float]] = []
        self._proc: subprocess.Popen | None = None
        self._log = None

    def __enter__(self) -> GpuMonitor:
        exe = shutil.which("nvidia-smi")
        if exe:
            # A file, not a pipe: a long run would fill a pipe nobody reads and stall nvidia-smi.
            self._log = tempfile.TemporaryFile(mode="w+")
            self._proc = subprocess.Popen(
                [exe, f"--id={self.gpu}", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                 f"-lms={self.period_ms}"],
                stdout=self._log, stderr=subprocess.DEVNULL, text=True,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.seek(0)
        self.samples = parse_samples(self._log.read())
        self._log.close()

    def window(self, start: datetime, end: datetime) -> dict | None:
        """Median SM clock (MHz) and power (W) of the samples taken between two local times, or None if none."""
        inside = [(mhz, watts) for t, mhz, watts in self.samples if start <= t <= end]
        if not inside:
            return None
        return {"sm_mhz": statistics.median(m for m, _ in inside), "power_w": statistics.median(w for _, w in inside)}
