"""The typed errors flash_gen raises, so callers can tell a bad config from a compiler failure from a driver
failure. Each keeps its fields as attributes and survives pickling (tuning workers raise them across
processes).

Must not import torch, cuda or anything else in flash_gen.
"""

from __future__ import annotations

LOG_TAIL_LINES = 40


class CompileError(RuntimeError):
    """NVRTC or nvJitLink rejected a kernel. `log` is the full compiler log; `source_path` is where the failing source
    was written so it can be inspected or recompiled by hand."""

    def __init__(self, entry: str, arch: str, log: str, source_path: str | None) -> None:
        self.entry, self.arch, self.log, self.source_path = entry, arch, log, source_path
        tail = "\n".join(log.rstrip().splitlines()[-LOG_TAIL_LINES:])
        where = f"; source written to {source_path}" if source_path else ""
        super().__init__(f"failed to compile {entry} for {arch}{where}\n--- log (last lines) ---\n{tail}")

    def __reduce__(self):
        return type(self), (self.entry, self.arch, self.log, self.source_path)


class InfeasibleConfig(ValueError):
    """A config that cannot be built for its key (too much shared memory, bad tile shape, ...)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)

    def __reduce__(self):
        return type(self), (self.reason,)


class KernelNotAvailable(RuntimeError):
    """FLASH_GEN_NO_JIT is set and the requested variant is not in the cache."""

    def __init__(self, variant: str, cache_dir: str) -> None:
        self.variant, self.cache_dir = variant, cache_dir
        super().__init__(
            f"kernel {variant} is not in the cache at {cache_dir} and FLASH_GEN_NO_JIT is set; "
            "build it ahead of time or unset FLASH_GEN_NO_JIT"
        )

    def __reduce__(self):
        return type(self), (self.variant, self.cache_dir)


class CudaError(RuntimeError):
    """A CUDA driver call returned an error."""

    def __init__(self, call: str, code: int, name: str) -> None:
        self.call, self.code, self.name = call, code, name
        super().__init__(f"{call} failed: {name} ({code})")

    def __reduce__(self):
        return type(self), (self.call, self.code, self.name)
