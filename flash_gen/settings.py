"""Every FLASH_GEN_* environment setting, typed, in one place.

Each setting is a function that reads the environment when called, never at import, so a test's
monkeypatch.setenv (or a user's os.environ change) takes effect at once. The "flash_gen" logger's
verbosity, which FLASH_GEN_VERBOSE controls, lives here too.

Settings:
  FLASH_GEN_CACHE_DIR  where compiled kernels are kept (default ~/.cache/flash_gen)
  FLASH_GEN_DEBUG      compile with device-side asserts on (no -DNDEBUG)
  FLASH_GEN_VERBOSE    log every compile to stderr
  FLASH_GEN_NO_JIT     never compile: a kernel missing from the cache raises KernelNotAvailable
  FLASH_GEN_LINEINFO   compile with -lineinfo (source lines in ncu/sanitizer reports; cubins about 3x larger)
  FLASH_GEN_LIBRARY    a prebuilt kernel library folder (`flash-gen build --out DIR`) to load kernels from
                       before the cache
  FLASH_GEN_FWD_CONFIG force one forward tiling (a FwdConfig name, e.g. m128n64w4s2) where it is feasible:
                       for benchmarking configs by hand
  FLASH_GEN_BWD_CONFIG the same for the backward (a BwdConfig name, e.g. m64n128w8a242s2_dqbulk)
  FLASH_GEN_NO_STREAM_K, FLASH_GEN_SECTION_PAIRS  A/B switches of the persistent Hopper forward's schedule

Must not import torch, cuda or anything else in flash_gen.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _flag(name: str) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r} is not a boolean; use one of {_TRUE + _FALSE[1:]}")


def cache_dir() -> Path:
    """Root of the on-disk kernel cache (FLASH_GEN_CACHE_DIR, default ~/.cache/flash_gen)."""
    raw = os.environ.get("FLASH_GEN_CACHE_DIR", "").strip()
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "flash_gen"


def library_dir() -> Path | None:
    """FLASH_GEN_LIBRARY: a prebuilt library folder (manifest.json + cubins), or None."""
    raw = os.environ.get("FLASH_GEN_LIBRARY", "").strip()
    return Path(raw).expanduser() if raw else None


def debug() -> bool:
    """FLASH_GEN_DEBUG: build kernels with device asserts enabled (a different cache entry than release)."""
    return _flag("FLASH_GEN_DEBUG")


def lineinfo() -> bool:
    """FLASH_GEN_LINEINFO: keep source-line tables in cubins, for profilers (a different cache entry)."""
    return _flag("FLASH_GEN_LINEINFO")


def verbose() -> bool:
    """FLASH_GEN_VERBOSE: print a line to stderr for every kernel compiled."""
    return _flag("FLASH_GEN_VERBOSE")


def no_jit() -> bool:
    """FLASH_GEN_NO_JIT: raise KernelNotAvailable instead of compiling a kernel missing from the cache."""
    return _flag("FLASH_GEN_NO_JIT")


def no_stream_k() -> bool:
    """FLASH_GEN_NO_STREAM_K: persistent Hopper forwards run whole tiles in their last round too (for A/B runs;
    read when a call's shapes are first planned)."""
    return _flag("FLASH_GEN_NO_STREAM_K")


def section_pairs() -> int | None:
    """FLASH_GEN_SECTION_PAIRS: the width, in (batch, head) pairs, of the sections in which persistent Hopper
    forwards under causal or local masks take their tiles by length. Unset or `model`: None, the width
    runtime/section_schedule.py picks per shape; 0: the kernel's own rule; N: N pairs (A/B runs of the order's L2
    working set against its balance, benchmarks/persistent_balance.py). Read when a call's shapes are first
    planned."""
    raw = os.environ.get("FLASH_GEN_SECTION_PAIRS", "").strip()
    if raw in ("", "model"):
        return None
    if not raw.isdigit():
        raise ValueError(f"FLASH_GEN_SECTION_PAIRS={raw!r} is neither `model` nor a whole number of (batch, head) "
                         f"pairs")
    return int(raw)


def fwd_config() -> str | None:
    """FLASH_GEN_FWD_CONFIG: a forward config name to use instead of the default, or None."""
    return os.environ.get("FLASH_GEN_FWD_CONFIG", "").strip() or None


def bwd_config() -> str | None:
    """FLASH_GEN_BWD_CONFIG: a backward config name to use where it is feasible, or None."""
    return os.environ.get("FLASH_GEN_BWD_CONFIG", "").strip() or None


def logger() -> logging.Logger:
    """The "flash_gen" logger. Under FLASH_GEN_VERBOSE it passes INFO records, and when the application has
    configured no logging at all it gets a stderr handler of its own (once), so the lines are seen."""
    log = logging.getLogger("flash_gen")
    if verbose():
        log.setLevel(logging.INFO)
        if not log.hasHandlers():
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[flash_gen] %(message)s"))
            log.addHandler(handler)
    return log
