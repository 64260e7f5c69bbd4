"""Render CUDA C++ for a (key, config) from the Jinja templates in flash_gen/templates.

Templates stay thin (types, constants, one instantiation); the algorithm lives in the versioned headers under
templates/include, which the NVRTC include path points at. Must not import torch or cuda.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable, Sequence

import jinja2

from flash_gen.spec import FwdConfig, FwdKey, infeasible_reason, smem_bytes
from flash_gen.spec_bwd import BwdConfig, BwdKey, bwd_head_dim_mma, bwd_infeasible_reason, bwd_smem_bytes
from flash_gen.spec_bwd_sm90 import (
    Sm90BwdConfig,
    sm90_bwd_computed_key,
    sm90_bwd_head_dim,
    sm90_bwd_infeasible_reason,
    sm90_bwd_needs_extended_wgmma,
    sm90_bwd_smem_bytes,
)
from flash_gen.spec_sm90 import (
    Sm90FwdConfig,
    needs_extended_wgmma,
    sm90_computed_key,
    sm90_head_dim,
    sm90_infeasible_reason,
    sm90_o_in_v,
    sm90_smem_bytes,
    sm90_stream_k,
)

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "templates"
INCLUDE_DIR = TEMPLATE_DIR / "include"

_ELEMENT = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}
_MASK = {"none": "kNone", "causal": "kCausal", "local": "kLocal"}
_KV_LAYOUT = {"dense": "kDense", "cache": "kCache", "paged": "kPaged"}


@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def kernel_key(key: FwdKey | BwdKey, cfg: FwdConfig | BwdConfig) -> FwdKey | BwdKey:
    """The key whose kernel serves `key` under `cfg`: for the Hopper kernels, that of the head dim they compute
    (spec_sm90.sm90_computed_key, spec_bwd_sm90.sm90_bwd_computed_key), so the forward at 72 runs 80's kernel and
    the backward at 72, 80 or 96 runs 128's (or, narrow, 96's), from the library where it is there, rather than
    compiling a copy under their own names."""
    if isinstance(cfg, Sm90FwdConfig):
        return sm90_computed_key(key)
    return sm90_bwd_computed_key(key, cfg) if isinstance(cfg, Sm90BwdConfig) else key


def entry_name(key: FwdKey | BwdKey, cfg: FwdConfig | BwdConfig) -> str:
    """The kernel's extern "C" symbol: the kernel key's and config's names joined, unique per kernel."""
    return f"flash_gen_{kernel_key(key, cfg).name}__{cfg.name}"


def one_per_kernel(variants: Sequence[tuple]) -> list[tuple]:
    """`variants` ((key, config) pairs) with the first pair of each kernel kept and the keys sharing it dropped."""
    kernels: dict[str, tuple] = {}
    for key, cfg in variants:
        kernels.setdefault(entry_name(key, cfg), (key, cfg))
    return list(kernels.values())


def render_fwd(key: FwdKey, cfg: FwdConfig) -> str:
    """CUDA source of the portable forward kernel for `key` tiled by `cfg`.

    Raises ValueError (with the reason) for a config that cannot be built for this key.
    """
    return render_fwd_many([(key, cfg)])


def render_fwd_many(variants: Sequence[tuple[FwdKey, FwdConfig]]) -> str:
    """One translation unit holding every (key, config) in `variants`, each its own extern "C" kernel. Variants
    sharing a head dim and tiling share most template instantiations, so compiling them together costs little
    more than compiling one. Raises ValueError for an infeasible pair."""
    items = _items(variants, infeasible_reason, lambda key, cfg: {
        "smem_bytes": smem_bytes(key, cfg),
        "kv": _KV_LAYOUT[key.kv],
    })
    return _env().get_template("fwd_sm80.cu.j2").render(variants=items)


def render_fwd_sm90(key: FwdKey, cfg: Sm90FwdConfig) -> str:
    """CUDA source of the Hopper (wgmma) forward kernel for `key` tiled by `cfg`; ValueError if it cannot run."""
    return render_fwd_sm90_many([(key, cfg)])


def render_fwd_sm90_many(variants: Sequence[tuple[FwdKey, Sm90FwdConfig]]) -> str:
    """One translation unit holding the Hopper forward kernel of every (key, config) in `variants`."""
    items = _items(variants, sm90_infeasible_reason,
                   lambda key, cfg: {"smem_bytes": sm90_smem_bytes(key, cfg), "head_dim": sm90_head_dim(key),
                                     "o_in_v": sm90_o_in_v(key, cfg), "stream_k": sm90_stream_k(key, cfg)})
    extended = any(needs_extended_wgmma(key, cfg) for key, cfg in variants)
    return _env().get_template("fwd_sm90.cu.j2").render(variants=items, extended_wgmma=extended)


def render_bwd_many(variants: Sequence[tuple[BwdKey, BwdConfig]]) -> str:
    """One translation unit holding the main backward kernel of every (key, config) in `variants`. Raises
    ValueError for an infeasible pair."""
    items = _items(variants, bwd_infeasible_reason, lambda key, cfg: {
        "head_dim_mma": bwd_head_dim_mma(key, cfg),
        "smem_bytes": bwd_smem_bytes(key, cfg),
    })
    return _env().get_template("bwd_sm80.cu.j2").render(variants=items)


def render_bwd_sm90_many(variants: Sequence[tuple[BwdKey, Sm90BwdConfig]]) -> str:
    """One translation unit holding the Hopper backward kernel of every (key, config) in `variants`."""
    items = _items(variants, sm90_bwd_infeasible_reason, lambda key, cfg: {
        "smem_bytes": sm90_bwd_smem_bytes(key, cfg), "head_dim": sm90_bwd_head_dim(key, cfg)})
    extended = any(sm90_bwd_needs_extended_wgmma(key, cfg) for key, cfg in variants)
    return _env().get_template("bwd_sm90.cu.j2").render(variants=items, extended_wgmma=extended)


def _items(variants: Sequence[tuple], infeasible: Callable, extra: Callable) -> list[dict]:
    """Template values of each kernel of `variants` (keys sharing one, render.kernel_key, once; each key checked for
    itself): the fields every kernel template uses plus `extra(key, cfg)`."""
    for key, cfg in variants:
        why = infeasible(key, cfg)
        if why is not None:
            raise ValueError(f"{cfg.name} cannot be built for {key.name}: {why}")
    items = []
    for i, (key, cfg) in enumerate((kernel_key(k, c), c) for k, c in one_per_kernel(variants)):
        items.append({
            "key": key,
            "cfg": cfg,
            "traits": f"Traits{i}",
            "entry": entry_name(key, cfg),
            "element": _ELEMENT[key.dtype],
            "mask": _MASK[key.mask],
            **extra(key, cfg),
        })
    return items


def render_bwd(key: BwdKey, cfg: BwdConfig) -> str:
    return render_bwd_many([(key, cfg)])


def bwd_aux_prefix(arch: str, dtype: str) -> str:
    """Entry-name prefix of the head-dim-generic backward helpers (`<prefix>_preprocess`,
    `<prefix>_convert_dq`) for one arch and dtype."""
    return f"flash_gen_bwd_aux_{arch}_{dtype}"


def render_bwd_aux(arch: str, dtype: str) -> str:
    """The preprocess and dQ-convert kernels for `dtype` (no CuTe: they compile in seconds)."""
    return _env().get_template("bwd_aux.cu.j2").render(prefix=bwd_aux_prefix(arch, dtype), bf16=dtype == "bf16")


def combine_entry(arch: str, dtype: str) -> str:
    """Entry name of the head-dim-generic split-KV combine kernel for one arch and dtype."""
    return f"flash_gen_fwd_combine_{arch}_{dtype}"


def render_combine(arch: str, dtype: str) -> str:
    """The split-KV combine kernel for `dtype` (no CuTe: it compiles in seconds)."""
    return _env().get_template("fwd_combine.cu.j2").render(prefix=combine_entry(arch, dtype), bf16=dtype == "bf16")


def append_entry(arch: str, dtype: str) -> str:
    """Entry name of the head-dim-generic KV-cache append + rotary kernel for one arch and dtype."""
    return f"flash_gen_kv_append_{arch}_{dtype}"


def render_append(arch: str, dtype: str) -> str:
    """The KV-cache append + rotary kernel for `dtype` (no CuTe: it compiles in seconds)."""
    return _env().get_template("kv_append.cu.j2").render(prefix=append_entry(arch, dtype), bf16=dtype == "bf16")


def render_many(variants: Sequence[tuple]) -> str:
    """One translation unit for variants of one kernel family (portable forward, Hopper forward or backward)."""
    if isinstance(variants[0][1], Sm90BwdConfig):
        return render_bwd_sm90_many(variants)
    if isinstance(variants[0][0], BwdKey):
        return render_bwd_many(variants)
    if isinstance(variants[0][1], Sm90FwdConfig):
        return render_fwd_sm90_many(variants)
    return render_fwd_many(variants)
