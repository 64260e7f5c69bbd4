"""Compilation: NVRTC to PTX/cubin, the ptxas report, and the content-addressed cubin cache. No torch."""

