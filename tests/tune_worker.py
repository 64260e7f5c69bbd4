"""A stand-in tune worker for the CPU tests of the search loop: flash_gen.search.study.search on a real family's
space and a real Optuna storage, with a fake compile step and a synthetic objective instead of the GPU.

    python tests/tune_worker.py STORAGE_URL STUDY TRIALS SECONDS_PER_TRIAL
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

from flash_gen.search import space
from flash_gen.search.study import open_study, search

FAMILY = space.Family("fwd", "sm80", "bf16", 96, "causal")  # a portable-kernel family


def objective(cfg) -> list[float]:
    """One stand-in shape's time, deterministic per config, so repeated measurements agree."""
    return [cfg.block_m / 64 + cfg.block_n / 32 + cfg.num_warps + 0.5 * cfg.kv_stages + 0.25 * cfg.q_in_regs]


def main(storage: str, study_name: str, trials: int, seconds: float) -> int:
    def prepare(family, cfg):
        time.sleep(seconds)
        return None

    with ThreadPoolExecutor(max_workers=2) as pool:
        search(open_study(study_name, storage), FAMILY, prepare=prepare, measure=objective, pool=pool, workers=2,
               trials=trials)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
