"""CPU tests of the backward kernel identities (flash_gen.spec_bwd)."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest

from flash_gen import spec_bwd
from flash_gen.gen.render import entry_name, render_bwd, render_bwd_aux
from flash_gen.spec_bwd import BWD_CONFIG_SPACE, BwdConfig, BwdKey

C_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ALL_KEYS = list(spec_bwd.enumerate_bwd_keys())
ALL_CONFIGS = [BwdConfig(*values) for values in itertools.product(*BWD_CONFIG_SPACE.values())]


def test_names_are_unique_c_identifiers():
    for names in ([k.name for k in ALL_KEYS], [c.name for c in ALL_CONFIGS]):
        assert len(set(names)) == len(names)
        assert all(C_IDENT.fullmatch(n) for n in names)


def test_key_names_extend_the_forward_names():
    key = BwdKey("sm90", "bf16", 128, "causal", softcap=True, deterministic=True)
    assert key.name == "bwd_sm90_bf16_hd128_causal_softcap_det"
    assert key.fwd.name == "fwd_sm90_bf16_hd128_causal_softcap"


def test_config_names_round_trip():
    assert set(BWD_CONFIG_SPACE) == {f.name for f in dataclasses.fields(BwdConfig)}
    for cfg in ALL_CONFIGS:
        assert spec_bwd.bwd_config_from_name(cfg.name) == cfg
    with pytest.raises(ValueError):
        spec_bwd.bwd_config_from_name("m128n64w4s2")


def test_key_rejects_values_outside_the_space():
    with pytest.raises(ValueError, match="head_dim"):
        BwdKey("sm90", "bf16", 60)


def test_every_key_has_a_feasible_default_that_renders():
    for key in ALL_KEYS:
        cfg = spec_bwd.default_bwd_config(key)
        assert spec_bwd.bwd_infeasible_reason(key, cfg) is None, (key.name, cfg.name)
        d = spec_bwd.bwd_head_dim_mma(key, cfg)
        assert d % 16 == 0 and key.head_dim <= d
    # rendering is per (dtype, head dim, mask, feature) text substitution: one arch suffices
    for key in (k for k in ALL_KEYS if k.arch == "sm90"):
        cfg = spec_bwd.default_bwd_config(key)
        source = render_bwd(key, cfg)
        assert f"{entry_name(key, cfg)}(const __grid_constant__ flash_gen::BwdParams" in source
        assert f"Traits0::kSmemBytes == {spec_bwd.bwd_smem_bytes(key, cfg)}" in source


def test_head_dim_padding_is_minimal_for_common_dims():
    for hd in (64, 96, 128, 192, 256):
        key = BwdKey("sm90", "bf16", hd)
        assert spec_bwd.bwd_head_dim_mma(key, spec_bwd.default_bwd_config(key)) == hd


@pytest.mark.parametrize(
    "cfg,reason",
    [
        (BwdConfig(64, 128, 8, 3, 4, 2, 2), "warps_m_sdp"),
        (BwdConfig(64, 64, 8, 8, 4, 2, 1), "block_m"),
        (BwdConfig(128, 128, 8, 2, 4, 4, 2), "shared memory"),
        (BwdConfig(64, 64, 4, 2, 4, 4, 1), "register"),
    ],
)
def test_infeasible_reason_explains_rejections(cfg, reason):
    why = spec_bwd.bwd_infeasible_reason(BwdKey("sm80", "bf16", 256), cfg)
    assert why is not None and reason in why


def test_aux_kernels_render_without_cute():
    source = render_bwd_aux("sm90", "fp16")
    assert "flash_gen_bwd_aux_sm90_fp16_preprocess" in source and "flash_gen_bwd_aux_sm90_fp16_convert_dq" in source
    assert "cute" not in source
