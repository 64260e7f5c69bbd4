"""Rendering: key + config -> CUDA C++ source from the Jinja templates. Must not import torch."""

