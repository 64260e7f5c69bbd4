"""Plot a `flash-gen bench --json` file: TFLOP/s against sequence length, one line per implementation, one panel
per (head dim, causal) cell group; forced tilings (fg:NAME columns) only with --tilings. Runs anywhere matplotlib is
installed (no GPU).

    python3 benchmarks/plot_bench.py bench_fwd.json docs/fwd_sm90.png [--tilings] [--title "..."]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

LABELS = {"flash_gen": "flash-gen", "flash": "FA2 (SDPA FLASH)", "cudnn": "cuDNN (SDPA CUDNN)", "fa4": "FA4"}


def plot(data: dict, out: Path, title: str | None, tilings: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in data["results"]:
        for impl, tflops in r["tflops"].items():
            if impl.startswith("fg:") and not tilings:
                continue
            panels[(r["hdim"], r["causal"])][impl].append((r["seqlen"], tflops))
    cells = sorted(panels)
    cols = len({hdim for hdim, _ in cells})
    rows = -(-len(cells) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False, sharey=True)
    for ax, (hdim, causal) in zip(axes.T.flat, cells):  # a column per head dim: non-causal above causal
        for impl, points in sorted(panels[(hdim, causal)].items()):
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, marker="o", label=LABELS.get(impl, impl), linewidth=2.2 if impl == "flash_gen" else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_title(f"head dim {hdim}, {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("sequence length")
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("TFLOP/s")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title or f"{data['settings']['direction']} {data['settings']['dtype']}, {data['device']}, "
                 f"{data['date'][:10]}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("png", type=Path)
    parser.add_argument("--title")
    parser.add_argument("--tilings", action="store_true", help="also plot the forced tilings (fg:NAME)")
    args = parser.parse_args(argv)
    plot(json.loads(args.json.read_text()), args.png, args.title, args.tilings)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
