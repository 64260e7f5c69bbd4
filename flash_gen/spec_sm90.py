"""Hopper forward kernel (templates/include/flash_gen/fwd_sm90.cuh) identities: its tiling and what it supports.

Work in progress for issue 7: a TMA producer warpgroup and two wgmma consumer warpgroups with intra-warpgroup
overlap and optional ping-pong. Keys are the forward's FwdKey; only dense, unpacked keys without
softcap/ALiBi/varlen on sm90 are supported so far. Must not import torch or cuda.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flash_gen.spec import MAX_SMEM_PER_BLOCK, FwdKey

BLOCK_M = 128  # two consumer warpgroups x the wgmma M of 64
NUM_THREADS = 384  # a TMA producer warpgroup and two consumer warpgroups
CONSUMER_REGISTERS = 240  # setmaxnreg of the consumers (the producer keeps 24)
MAX_TILE_REGISTERS = 200  # S (fp32), P (16-bit pairs) and O (fp32) per consumer thread, leaving room for addressing
BARRIER_BYTES = 8  # one mbarrier


@dataclass(frozen=True)
class Sm90FwdConfig:
    block_n: int = 128  # keys per step (the S wgmma's N)
    stages: int = 2  # K/V shared-memory buffers in the TMA ring
    pingpong: bool = True  # the consumer warpgroups take turns issuing GEMMs (one's softmax under the other's GEMMs)

    @property
    def name(self) -> str:
        return f"wgm{BLOCK_M}n{self.block_n}s{self.stages}" + ("p" if self.pingpong else "")

    @property
    def num_threads(self) -> int:
        return NUM_THREADS

    @property
    def block_m(self) -> int:
        return BLOCK_M


def sm90_config_from_name(name: str) -> Sm90FwdConfig | None:
    """Inverse of Sm90FwdConfig.name ("wgm128n128s2p"), or None for a name of another kernel family."""
    m = re.fullmatch(rf"wgm{BLOCK_M}n(\d+)s(\d+)(p?)", name)
    return Sm90FwdConfig(int(m.group(1)), int(m.group(2)), bool(m.group(3))) if m else None


def sm90_smem_bytes(key: FwdKey, cfg: Sm90FwdConfig) -> int:
    """Q plus `stages` K and V tiles (2-byte elements), then the mbarriers: Q full, K/V full and empty per stage."""
    return 2 * key.head_dim * (BLOCK_M + 2 * cfg.stages * cfg.block_n) + BARRIER_BYTES * (1 + 4 * cfg.stages)


def sm90_infeasible_reason(key: FwdKey, cfg: Sm90FwdConfig) -> str | None:
    """Why the Hopper kernel cannot run `key` with `cfg` (None when it can)."""
    if key.arch != "sm90":
        return f"wgmma kernels are built for sm90, not {key.arch}"
    unsupported = [f for f in ("softcap", "alibi", "varlen", "split", "pack_gqa") if getattr(key, f)]
    if unsupported or key.kv != "dense":
        return f"not supported yet: {', '.join(unsupported) or key.kv}"
    if key.head_dim % 64:
        return f"head_dim {key.head_dim} is not a multiple of 64 (128-byte swizzled rows)"
    if cfg.block_n % 16 or not 16 <= cfg.block_n <= 256:
        return f"block_n {cfg.block_n} must be a multiple of 16 in [16, 256] (the wgmma N)"
    if cfg.stages < 1:
        return "stages must be at least 1"
    regs = (cfg.block_n // 2 + cfg.block_n // 4 + key.head_dim // 2)  # 64 rows over 128 threads: S, P, O
    if regs > MAX_TILE_REGISTERS:
        return f"{regs} tile registers per consumer thread (S, P, O) exceed {MAX_TILE_REGISTERS}"
    smem = sm90_smem_bytes(key, cfg)
    if smem > MAX_SMEM_PER_BLOCK[key.arch]:
        return f"shared memory {smem} B exceeds the {key.arch} limit of {MAX_SMEM_PER_BLOCK[key.arch]} B"
    return None
