"""The persistent Hopper forward's causal tile order, and a model of how its CTAs run it (no GPU), to weigh section
widths: the (batch, head) pairs whose query tiles the kernel orders by length together (Sm90Tile in
templates/include/flash_gen/fwd_sm90.cuh, Sm90FwdParams::section_pairs).

A tile costs its key steps plus one (prologue and epilogue). Each CTA takes one tile per round of `ctas` tiles,
snaking, and runs its tiles back to back; the CTAs then drift apart over the rounds. Two figures rank a width:
the balance (the busiest CTA's work over the mean: 1.0 is even) and the K/V of the tiles running at once, averaged
over the launch (the set L2 has to hold; past it the reads go to DRAM). benchmarks/persistent_balance.py prints
them; docs/benchmarks.md ("The section-width switch on the GPU") measures them against the H100.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

L2_SECTION_BYTES = 24 << 20  # the kernel's kL2SectionBytes


class CausalLaunch(NamedTuple):
    """A dense causal persistent launch as the tile order sees it (seqlen_q = seqlen_k; the ragged tile first)."""
    seqlen: int
    pairs: int  # (batch, head) pairs (pack-GQA: (batch, KV head))
    block_m: int  # query positions a tile
    block_n: int  # keys a step
    ctas: int  # persistent CTAs
    kv_row_bytes: int  # one key's K and V bytes: 2 x head dim x element bytes
    group: int = 1  # consecutive pairs that read the same K/V (GQA, unpacked)
    wg_rows: int = 64  # query positions a consumer warpgroup covers: the ragged tile idles whole warpgroups

    @property
    def m_blocks(self) -> int:
        return -(-self.seqlen // self.block_m)

    def kernel_width(self) -> int:
        """The kernel's own section width: the pairs whose K/V fit L2_SECTION_BYTES, but at least a round."""
        fit = L2_SECTION_BYTES // (self.seqlen * self.kv_row_bytes)
        return max(1, min(self.pairs, max(fit, -(-self.ctas // self.m_blocks))))


class Schedule(NamedTuple):
    """A launch's tiles laid out (rounds, ctas): the tile CTA c runs in round k at [k, c] (cost 0 past the last
    tile), with the key range and pair of each."""
    cost: torch.Tensor
    pair: torch.Tensor  # whose K/V it reads: the pair, or (GQA) its group
    keys: torch.Tensor


def schedule(launch: CausalLaunch, section_pairs: int = 0) -> Schedule:
    """The tiles in the kernel's order, dealt to the CTAs in snaking rounds; section_pairs > 0 replaces the kernel's
    width."""
    m_blocks, pairs, ctas = launch.m_blocks, launch.pairs, launch.ctas
    section = min(section_pairs, pairs) if section_pairs > 0 else launch.kernel_width()
    sections = -(-pairs // section)
    t = torch.arange(m_blocks * pairs)
    sec = t // (section * m_blocks)
    width = (pairs - sec * section).clamp(max=section)
    r = t - sec * section * m_blocks
    level = r // width  # 0: the section's longest tiles
    m_block = torch.where((sections - 1 - sec) % 2 == 1, level, m_blocks - 1 - level)
    shift = (m_blocks * launch.block_m - launch.seqlen) // launch.wg_rows * launch.wg_rows
    keys = ((m_block + 1) * launch.block_m - shift).clamp(max=launch.seqlen)
    rounds = -(-len(t) // ctas)
    # Snaking: CTA c takes tile round * ctas + c, or + ctas - 1 - c in odd rounds.
    rnd, pos = t // ctas, t % ctas
    slot = rnd * ctas + torch.where(rnd % 2 == 1, ctas - 1 - pos, pos)
    laid = []
    for values in ((keys - 1) // launch.block_n + 2, (sec * section + r % width) // launch.group, keys):
        grid = torch.zeros(rounds * ctas, dtype=torch.int64)
        grid[slot] = values
        laid.append(grid.view(rounds, ctas))
    return Schedule(*laid)


def balance(plan: Schedule) -> float:
    """The busiest CTA's work over the mean."""
    work = plan.cost.sum(0)
    return work.max().item() * len(work) / work.sum().item()


def running_kv_bytes(plan: Schedule, kv_row_bytes: int, samples: int = 256) -> torch.Tensor:
    """The K and V bytes of the tiles running at `samples` evenly spaced moments (each pair once, at its longest
    key range), each CTA running its tiles back to back, a tile's cost in time units."""
    end = plan.cost.cumsum(0).T.contiguous()  # (ctas, rounds)
    now = torch.arange(samples, dtype=torch.float64) * (end[:, -1].max().item() / samples)
    # The tile each CTA runs at each moment: its first one ending later (none once the CTA is done).
    idx = torch.searchsorted(end.double(), now.expand(len(end), samples).contiguous(), right=True)
    running = idx < end.shape[1]
    idx = idx.clamp(max=end.shape[1] - 1)
    return kv_bytes(plan.pair.T.gather(1, idx).T, (plan.keys.T.gather(1, idx) * running).T, kv_row_bytes)


def figures(launch: CausalLaunch, section_pairs: int = 0) -> tuple[float, float]:
    """A width's two figures: the balance and the mean K/V bytes running at once (section_pairs 0: the kernel's
    rule)."""
    plan = schedule(launch, section_pairs)
    return balance(plan), running_kv_bytes(plan, launch.kv_row_bytes).double().mean().item()


def kv_bytes(pair: torch.Tensor, keys: torch.Tensor, kv_row_bytes: int) -> torch.Tensor:
    """Per row of tiles (pair, keys: 2-D, alike), the K and V bytes they read, each pair once at its longest key
    range."""
    longest = torch.zeros(pair.shape[0], int(pair.max()) + 1, dtype=torch.int64)
    longest.scatter_reduce_(1, pair, keys, "amax")
    return longest.sum(1) * kv_row_bytes


# choose_section_pairs' rule, from the model's figures for the widths measured on the H100.
# Narrowing (docs/benchmarks.md, "The section-width switch on the GPU"): it picks the one measured gain (one pair at
# head dim 256 causal 2k) and none of the measured losses; on the anchor shapes its picks gained 2-5% at 2k and were
# level elsewhere, at 1500-3500 keys they gained up to 3.6% or tied (docs/benchmarks.md, "The model's section width"
# and "... off the anchor lengths").
# Balancing (docs/benchmarks.md, "Section widths for the balance"): at 16k tokens the kernel's sections leave the
# busiest CTA 4-23% over the mean, and balanced widths measured up to 13% faster. A least-squares fit of 35 such
# timings (H100, nine shapes at head dims 128 and 256) gives the modelled time below: a point of balance costs 0.6 of
# a point of time (the idle CTAs' share of the power limit lifts the clock of the rest) and, at head dim 256, each
# MiB of running K/V past 32 costs 0.2% (head dim 128 showed none).
BALANCE_SLACK = 0.012  # narrowing: how much busier the busiest CTA may get than under the kernel's rule
MIN_KV_CUT = 0.10  # narrowing: the least share of the running K/V a width must save to replace the kernel's rule
IMBALANCE_COST = 0.6  # modelled time: the share of the busiest CTA's excess work that the launch takes longer
KV_FREE_MIB, KV_COST_PER_MIB = 32, 0.002  # modelled time: running K/V that costs nothing, and the cost past it
MIN_GAIN = 0.02  # balancing: the modelled time a width must save over the narrowing pick (a 32k-token cell the
#                   model gave 1.2% measured 2% slower)
MODELLED_TILES = 16384  # the model covers the pairs whose tiles this holds (cost ~linear: about 1 ms a width);
#                        past 124 rounds the last round's unevenness weighs little
WIDTHS_TRIED = 64  # the widths tried (the picks measured are 1-27): bounds the cost


def modelled_time(balance_: float, running_kv: float) -> float:
    """A width's launch time relative to a perfectly balanced one within KV_FREE_MIB of running K/V (bytes)."""
    return 1 + IMBALANCE_COST * (balance_ - 1) + KV_COST_PER_MIB * max(0.0, running_kv / 2**20 - KV_FREE_MIB)


@functools.lru_cache(maxsize=1024)
def choose_section_pairs(launch: CausalLaunch) -> int:
    """The section width to launch with. Narrowing: 0 (the kernel's own rule) unless a narrower width keeps the
    balance within BALANCE_SLACK of the kernel rule's and cuts the mean K/V running at once by MIN_KV_CUT or more;
    then the width that cuts it most. Balancing: the width of least modelled_time instead where it saves MIN_GAIN
    or more. About a ms per width tried (at most WIDTHS_TRIED), once per launch shape."""
    if launch.m_blocks * launch.pairs <= launch.ctas:
        return 0  # one round: every tile starts at once, in any order
    model = launch._replace(pairs=min(launch.pairs, max(1, MODELLED_TILES // launch.m_blocks)))
    balances = {width: balance(schedule(model, width)) for width in range(min(model.pairs, WIDTHS_TRIED) + 1)}
    kv = functools.cache(lambda width: figures(model, width)[1])  # the schedule again: not all 65 held at once
    pick = 0
    # Narrowing reads less from DRAM only where one pair's K/V for every CTA would not fit L2.
    if launch.ctas * launch.seqlen * launch.kv_row_bytes > L2_SECTION_BYTES:
        least = (1 - MIN_KV_CUT) * kv(0)
        for width in range(1, min(model.kernel_width(), WIDTHS_TRIED + 1)):
            if balances[width] <= balances[0] + BALANCE_SLACK and kv(width) < least:
                pick, least = width, kv(width)
    best, least = pick, modelled_time(balances[pick], kv(pick)) - MIN_GAIN
    for width, bal in balances.items():
        # The K/V figure only for widths whose balance alone could win.
        if modelled_time(bal, 0) < least and (time := modelled_time(bal, kv(width))) < least:
            best, least = width, time
    return best
