"""How evenly the Hopper forward's persistent CTAs share a causal launch: a model of its static schedule, no GPU.

The kernel (templates/include/flash_gen/fwd_sm90.cuh) orders the query tiles by length within sections of
(batch, head) pairs whose K/V fit in kL2SectionBytes but hold at least a round of tiles, the sections alternately
longest-first and shortest-first, the last longest-first (Sm90Tile); each CTA takes one tile per round of gridDim.x
tiles, snaking (sm90_tile_of_round). Here a tile costs its key steps plus one (its prologue and epilogue), for
seqlen_q = seqlen_k on shared/ANCHORS.md's shapes; the ratio printed is the busiest CTA's work over the mean, so
1.0 is a perfect balance. `--greedy` adds, for comparison, the same tile order handed to whichever CTA is free
first (what one CTA per tile gets from the hardware's block scheduler). Each line also gives the K/V a round of
tiles reads (per (batch, head) pair the longest key range of its tiles in the round), largest and mean over the
rounds: the L2 working set the order asks for; and the K/V of the tiles running at once when each CTA runs its
tiles back to back (the CTAs drift apart over the rounds, so this is the set L2 has to hold). `--section-pairs N,...`
replaces the kernel's section width (pairs) by each N in turn (0: the kernel's rule), to weigh other widths.

    python3 benchmarks/persistent_balance.py --hdim 256 --block-m 128 --block-n 64 --seqlen 2048,8192 \
        --section-pairs 0,1,4
"""

from __future__ import annotations

import argparse
import heapq
import itertools

from flash_gen.runtime.section_schedule import CausalLaunch, balance, kv_bytes, running_kv_bytes, schedule


def greedy(costs: list[int], ctas: int) -> list[int]:
    """Each CTA's work when the next tile goes to the CTA that is free first."""
    heap = [0] * ctas
    for cost in costs:
        heapq.heapreplace(heap, heap[0] + cost)
    return heap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hdim", type=int, required=True)
    parser.add_argument("--block-m", type=int, required=True)
    parser.add_argument("--block-n", type=int, required=True)
    parser.add_argument("--seqlen", default="2048,4096,8192,16384", help="comma list")
    parser.add_argument("--ctas", type=int, default=132, help="persistent CTAs (the H200's SMs)")
    parser.add_argument("--total-tokens", type=int, default=32768)
    parser.add_argument("--model-dim", type=int, default=2048)
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--section-pairs", default="0",
                        help="comma list of section widths in pairs (0: the kernel's own rule)")
    args = parser.parse_args()
    widths = [int(w) for w in args.section_pairs.split(",")]
    for seqlen, width in itertools.product((int(s) for s in args.seqlen.split(",")), widths):
        launch = CausalLaunch(seqlen, (args.model_dim // args.hdim) * max(1, args.total_tokens // seqlen),
                              args.block_m, args.block_n, args.ctas, 2 * args.hdim * 2)
        plan = schedule(launch, width)
        line = (f"hdim {args.hdim} m{args.block_m} n{args.block_n} S {seqlen} width {width or 'kernel'}: "
                f"{int((plan.cost > 0).sum())} tiles, persistent max/mean {balance(plan):.3f}")
        if args.greedy:
            # In tile order: round by round, odd rounds reversed (undoing the snake).
            costs = [c for row, rnd in zip(plan.cost.tolist(), itertools.count())
                     for c in (row[::-1] if rnd % 2 else row) if c]
            work = greedy(costs, args.ctas)
            line += f", greedy max/mean {max(work) * len(work) / sum(work):.3f}"
        kv = (kv_bytes(plan.pair, plan.keys, launch.kv_row_bytes).double() / 2**20).tolist()  # per round
        line += f", K/V a round max {max(kv):.0f} MiB mean {sum(kv) / len(kv):.0f} MiB"
        kv = (running_kv_bytes(plan, launch.kv_row_bytes).double() / 2**20).tolist()
        line += f", running at once max {max(kv):.0f} MiB mean {sum(kv) / len(kv):.0f} MiB"
        print(line)


if __name__ == "__main__":
    main()
