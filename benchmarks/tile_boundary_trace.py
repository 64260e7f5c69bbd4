"""Clock trace of the Hopper forward's tile boundary. `patch` edits a copy of the tree so that CTA 0's producer thread
and the first thread of each consumer warpgroup stamp %clock at fixed points of each of their first 16 rounds and
write the stamps over lse at exit; `run` (on the GPU, in that copy) calls the kernel and prints the median of each
segment over the rounds, first and last left out, and how far each warpgroup's tiles start after warpgroup 0's.
Persistent tilings with two or three consumer warpgroups and intra-warpgroup overlap (the stamps sit in that key loop,
and lse's first words hold three warpgroups' stamps, then the producer's); the patched kernel's lse is garbage, and
its local arrays cost it a little time.

    here:  mkdir -p .ab/trace && git archive HEAD flash_gen setup.py pyproject.toml | tar -x -C .ab/trace
           python3 benchmarks/tile_boundary_trace.py patch .ab/trace
           (cd .ab/trace && FLASH_GEN_CACHE_DIR=$PWD/../../.kernels_trace PYTHONPATH=$PWD python3 -m flash_gen.cli \\
            compile --arch sm90 --hdim 256 --dtype bf16 --mask none --configs wgm128n64s2_persist --out /tmp/trace)
    there: (carry .ab/trace and .kernels_trace) cd .ab/trace && FLASH_GEN_CACHE_DIR=$PWD/../../.kernels_trace \\
           FLASH_GEN_FWD_CONFIG=wgm128n64s2_persist PYTHONPATH=$PWD python3 ../../benchmarks/tile_boundary_trace.py \\
           run --hdim 256 --seqlen 2048
    (run takes the consumer warpgroups' count from --consumers, else from FLASH_GEN_FWD_CONFIG's tiling, else 2.)

(docs/hopper_forward.md, "Head dim 256's tile boundary, clock by clock".)
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

ROUNDS = 16
# Stamp i of a round: CONSUMER[i] (each consumer warpgroup's first thread), PRODUCER[i] (the producer thread).
CONSUMER = ("Q landed", "first S done", "Q released", "last P V done", "O's staging buffer free", "epilogue done",
            "first V landed")
PRODUCER = ("Q issued", "first K issued", "first V issued")
MAX_CONSUMERS = 3
PRODUCER_AT = MAX_CONSUMERS * ROUNDS * len(CONSUMER)  # lse word of the producer's first stamp

_N, _P = len(CONSUMER), len(PRODUCER)
_PRODUCER_STAMP = (f"#define FG_PSTAMP(i) do {{ if (blockIdx.x == 0 && round < {ROUNDS}) fg_ptrace[round * {_P} + (i)] = "
                   "unsigned(clock()); } while (0)")
_CONSUMER_STAMP = (f"#define FG_STAMP(i) do {{ if (blockIdx.x == 0 && tidx % 128 == 0 && round < {ROUNDS}) "
                   f"fg_trace[round * {_N} + (i)] = unsigned(clock()); }} while (0)")
# (text of fwd_sm90.cuh, its replacement): each text must occur exactly once.
_EDITS = (
    # producer: stamp array, Q issued, first K and V issued, stamps written out after the round loop
    ("  int it = 0;\n  for (int round = 0;; ++round) {\n    const Sm90Work work = sm90_work_of_round<T>(params, round);\n",
     f"  int it = 0, fg_rounds = 0;\n  unsigned fg_ptrace[{ROUNDS * _P}];\n{_PRODUCER_STAMP}\n"
     "  for (int round = 0;; ++round) {\n    const Sm90Work work = sm90_work_of_round<T>(params, round);\n"
     "    fg_rounds = round;\n"),
    ("    bars.q_empty.wait((round & 1) ^ 1);\n", "    bars.q_empty.wait((round & 1) ^ 1);\n    FG_PSTAMP(0);\n"),
    ("      load(params.tma_k, bars.k_full[stage], bars.k_empty[stage], smem_k, qk_shift);\n",
     "      load(params.tma_k, bars.k_full[stage], bars.k_empty[stage], smem_k, qk_shift);\n"
     "      if (n == tile.n_min) FG_PSTAMP(1);\n"),
    ("      load(params.tma_v, bars.v_full[stage], bars.v_empty[stage], smem_v, v_shift);\n    }\n  }\n",
     "      if (n == tile.n_min) FG_PSTAMP(2);\n"
     "      load(params.tma_v, bars.v_full[stage], bars.v_empty[stage], smem_v, v_shift);\n    }\n  }\n"
     "  if (blockIdx.x == 0) {\n    unsigned* out = reinterpret_cast<unsigned*>(params.base.lse);\n"
     f"    for (int i = 0; i < {ROUNDS * _P}; ++i) out[{PRODUCER_AT} + i] = i < {_P} * fg_rounds ? fg_ptrace[i] : 0u;\n"
     "  }\n"),
    # consumers
    ("  int it = 0;  // key steps over all tiles, as the producer counts them\n",
     f"  int it = 0;  // key steps over all tiles, as the producer counts them\n  unsigned fg_trace[{ROUNDS * _N}];\n"
     f"{_CONSUMER_STAMP}\n"),
    ("    bars.q_full.wait(round & 1);\n", "    bars.q_full.wait(round & 1);\n    FG_STAMP(0);\n"),
    ("      s_alone(tile.n_min, stage);\n", "      s_alone(tile.n_min, stage);\n      FG_STAMP(1);\n"),
    ("      if (n + 1 == tile.n_max) release_q();\n",
     "      if (n + 1 == tile.n_max) {\n        FG_STAMP(2);\n        release_q();\n      }\n"),
    ("      release_kv(bars.v_empty[stage]);\n      ++it;\n",
     "      release_kv(bars.v_empty[stage]);\n      ++it;\n      FG_STAMP(3);\n"),
    ("    if constexpr (T::kOInV) named_barrier_sync(T::kConsumersBarrierId, T::kConsumerThreads);\n",
     "    if constexpr (T::kOInV) named_barrier_sync(T::kConsumersBarrierId, T::kConsumerThreads);\n    FG_STAMP(4);\n"),
    ("idle warpgroups too: the count is per warpgroup\n      }\n    }\n",
     "idle warpgroups too: the count is per warpgroup\n      }\n    }\n    FG_STAMP(5);\n"),
    ("        bars.v_full[prev].wait(prev_phase);\n",
     "        bars.v_full[prev].wait(prev_phase);\n        if (n == tile.n_min + 1) FG_STAMP(6);\n"),
    ("  if (T::kSeparateO && tidx % 128 == 0) bulk_wait_read();",
     "  if (blockIdx.x == 0 && tidx % 128 == 0) {\n    unsigned* out = reinterpret_cast<unsigned*>(p.lse);\n"
     f"    for (int i = 0; i < {ROUNDS * _N}; ++i) out[wg * {ROUNDS * _N} + i] = fg_trace[i];\n  }}\n"
     "  if (T::kSeparateO && tidx % 128 == 0) bulk_wait_read();"),
)


def patch_header(src: str) -> str:
    """fwd_sm90.cuh's text with the stamps in (ValueError quoting the text the header no longer holds once)."""
    for old, new in _EDITS:
        if src.count(old) != 1:
            raise ValueError(f"fwd_sm90.cuh: expected one {old.strip()[:70]!r}, found {src.count(old)}")
        src = src.replace(old, new)
    return src


def segments(stamps: list[int], consumers: int = 2) -> dict[str, list[int]]:
    """Cycles per boundary segment, one value per round (and warpgroup) from stamps read back from lse, for a kernel
    of `consumers` consumer warpgroups."""
    n = _N
    prod = [stamps[PRODUCER_AT + _P * r: PRODUCER_AT + _P * (r + 1)] for r in range(ROUNDS)]
    rounds = sum(1 for p in prod if p[0])
    cons = [[stamps[w * ROUNDS * n + n * r: w * ROUNDS * n + n * (r + 1)] for r in range(rounds)]
            for w in range(consumers)]

    def d(a: int, b: int) -> int:
        return (b - a) & 0xFFFFFFFF

    def signed(a: int, b: int) -> int:  # b - a where b may come first
        return (d(a, b) + 2**31) % 2**32 - 2**31

    def later(a: int, b: int) -> int:
        return b if d(a, b) < 2**31 else a

    out: dict[str, list[int]] = {}
    for r in range(1, rounds - 1):
        for w in range(consumers):
            c, prev = cons[w][r], cons[w][r - 1]
            for name, value in (("whole tile", d(prev[0], c[0])),
                                ("previous epilogue done -> Q landed", d(prev[5], c[0])),
                                ("Q landed -> first S done", d(c[0], c[1])),
                                ("first S done -> first V landed", d(c[1], c[6])),
                                ("Q released -> last P V done", d(c[2], c[3])),
                                ("last P V -> O's buffer free", d(c[3], c[4])),
                                ("O's buffer free -> epilogue done", d(c[4], c[5]))):
                out.setdefault(name, []).append(value)
        for w in range(1, consumers):  # whether the warpgroups' tile boundaries coincide
            lag = signed(cons[0][r][0], cons[w][r][0])
            out.setdefault(f"warpgroup {w}'s Q landed after warpgroup 0's", []).append(lag)
        released = cons[0][r - 1][2]
        for w in range(1, consumers):
            released = later(released, cons[w][r - 1][2])
        for name, value in (("producer: last Q release -> Q issued", d(released, prod[r][0])),
                            ("producer: Q issued -> warpgroup 0 past Q", d(prod[r][0], cons[0][r][0])),
                            ("producer: Q issued -> first K issued", d(prod[r][0], prod[r][1])),
                            ("producer: first K -> first V issued", d(prod[r][1], prod[r][2])),
                            ("producer: first V issued -> warpgroup 0 past it", d(prod[r][2], cons[0][r][6]))):
            out.setdefault(name, []).append(value)
    return out


def report(stamps: list[int], consumers: int = 2) -> str:
    rows = segments(stamps, consumers)
    return "\n".join(f"{name:50s} {statistics.median(v):8.0f}  (min {min(v)}, max {max(v)})" for name, v in rows.items())


def _run(hdim: int, seqlen: int, consumers: int, causal: bool) -> str:
    import torch

    import flash_gen

    shape = (32768 // seqlen, seqlen, 2048 // hdim, hdim)  # the main table's shapes
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):
        _, lse, _ = flash_gen.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    torch.cuda.synchronize()
    words = PRODUCER_AT + _P * ROUNDS
    stamps = [x & 0xFFFFFFFF for x in lse.flatten()[:words].contiguous().view(torch.int32).cpu().tolist()]
    mask = "causal" if causal else "no mask"
    return f"hdim {hdim} seqlen {seqlen} {mask}, CTA 0, cycles:\n" + report(stamps, consumers)


def _consumers_of_forced_tiling() -> int:
    """The consumer warpgroups of the tiling FLASH_GEN_FWD_CONFIG forces (2 without one)."""
    name = os.environ.get("FLASH_GEN_FWD_CONFIG")
    if not name:
        return 2
    from flash_gen.fwd_tilings import config_from_name

    return config_from_name(name).consumers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("patch", help="put the stamps into TREE/flash_gen/.../fwd_sm90.cuh")
    p.add_argument("tree", type=Path)
    r = sub.add_parser("run", help="trace one call (GPU; in the patched tree)")
    r.add_argument("--hdim", type=int, default=256)
    r.add_argument("--seqlen", type=int, default=2048)
    r.add_argument("--causal", action="store_true", help="(tiles of different lengths: read the lags, not the medians)")
    r.add_argument("--consumers", type=int, default=None, help="consumer warpgroups (default: FLASH_GEN_FWD_CONFIG's)")
    args = ap.parse_args()
    if args.cmd == "patch":
        header = args.tree / "flash_gen/templates/include/flash_gen/fwd_sm90.cuh"
        header.write_text(patch_header(header.read_text()))
        print(f"stamps written into {header}")
    else:
        print(_run(args.hdim, args.seqlen, args.consumers or _consumers_of_forced_tiling(), args.causal))


if __name__ == "__main__":
    main()
