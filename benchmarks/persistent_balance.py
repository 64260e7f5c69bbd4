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
from typing import NamedTuple

L2_SECTION_BYTES = 24 << 20  # kL2SectionBytes


class Tile(NamedTuple):
    cost: int  # key steps plus one
    pair: int  # (batch, head) pair
    keys: int  # keys it reads: [0, keys)


def tile_order(seqlen: int, hdim: int, block_m: int, block_n: int, total_tokens: int, model_dim: int,
               ctas: int, section_pairs: int = 0) -> list[Tile]:
    """The tiles in the kernel's order (causal, seqlen_q = seqlen_k, the ragged tile first); section_pairs > 0
    replaces the kernel's section width."""
    pairs = (model_dim // hdim) * max(1, total_tokens // seqlen)
    m_blocks = -(-seqlen // block_m)
    section = section_pairs or max(1, min(pairs, max(L2_SECTION_BYTES // (2 * seqlen * hdim * 2),
                                                     -(-ctas // m_blocks))))
    sections = -(-pairs // section)
    shift = m_blocks * block_m - seqlen
    tiles = []
    for t in range(m_blocks * pairs):
        sec = t // (section * m_blocks)
        width = min(section, pairs - sec * section)
        r = t - sec * section * m_blocks
        level = r // width
        m_block = level if (sections - 1 - sec) & 1 else m_blocks - 1 - level
        last_row = min((m_block + 1) * block_m - shift, seqlen) - 1
        tiles.append(Tile(last_row // block_n + 2, sec * section + r % width, last_row + 1))
    return tiles


def round_kv_mib(tiles: list[Tile], ctas: int, hdim: int) -> list[float]:
    """Per round of `ctas` tiles, the K and V bytes (MiB, 16-bit) its tiles read, each pair counted once."""
    out = []
    for start in range(0, len(tiles), ctas):
        keys: dict[int, int] = {}
        for tile in tiles[start:start + ctas]:
            keys[tile.pair] = max(keys.get(tile.pair, 0), tile.keys)
        out.append(sum(2 * 2 * k * hdim for k in keys.values()) / 2**20)
    return out


def snaking_cta(t: int, ctas: int) -> int:
    """The CTA that takes tile t: CTA c takes tile round * ctas + c, or + ctas - 1 - c in odd rounds."""
    rnd, pos = divmod(t, ctas)
    return ctas - 1 - pos if rnd & 1 else pos


def snaking_rounds(costs: list[int], ctas: int) -> list[int]:
    """Each CTA's work under the snaking rounds."""
    work = [0] * ctas
    for t, cost in enumerate(costs):
        work[snaking_cta(t, ctas)] += cost
    return work


def running_kv_mib(tiles: list[Tile], ctas: int, hdim: int, samples: int = 256) -> list[float]:
    """The K and V bytes (MiB) of the tiles running at `samples` evenly spaced moments, each CTA running its
    snaking rounds' tiles back to back (a tile's cost in time units): the working set L2 has to hold once the CTAs
    have drifted apart, which the per-round figure misses where a section's tiles differ much in length."""
    clock = [0] * ctas
    spans = []  # (start, end, tile)
    for t, tile in enumerate(tiles):
        cta = snaking_cta(t, ctas)
        spans.append((clock[cta], clock[cta] + tile.cost, tile))
        clock[cta] += tile.cost
    spans.sort(key=lambda span: span[0])
    end, out, running, nxt = max(clock), [], [], 0
    for i in range(samples):
        now = end * i / samples
        while nxt < len(spans) and spans[nxt][0] <= now:
            running.append(spans[nxt])
            nxt += 1
        running = [span for span in running if span[1] > now]
        keys: dict[int, int] = {}
        for _, _, tile in running:
            keys[tile.pair] = max(keys.get(tile.pair, 0), tile.keys)
        out.append(sum(2 * 2 * k * hdim for k in keys.values()) / 2**20)
    return out


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
        tiles = tile_order(seqlen, args.hdim, args.block_m, args.block_n, args.total_tokens, args.model_dim,
                           args.ctas, width)
        costs = [tile.cost for tile in tiles]
        line = (f"hdim {args.hdim} m{args.block_m} n{args.block_n} S {seqlen} width {width or 'kernel'}: "
                f"{len(costs)} tiles")
        for name, schedule in (("persistent", snaking_rounds), ("greedy", greedy))[:2 if args.greedy else 1]:
            work = schedule(costs, args.ctas)
            line += f", {name} max/mean {max(work) * len(work) / sum(work):.3f}"
        kv = round_kv_mib(tiles, args.ctas, args.hdim)
        line += f", K/V a round max {max(kv):.0f} MiB mean {sum(kv) / len(kv):.0f} MiB"
        kv = running_kv_mib(tiles, args.ctas, args.hdim)
        line += f", running at once max {max(kv):.0f} MiB mean {sum(kv) / len(kv):.0f} MiB"
        print(line)


if __name__ == "__main__":
    main()
