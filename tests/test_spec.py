"""CPU tests of the kernel identities in flash_gen.spec: names are unique C identifiers that encode every field,
and the pruning rules accept every default config and explain every rejection."""

from __future__ import annotations

import dataclasses
import itertools
import keyword
import re

import pytest

from flash_gen import spec
from flash_gen.spec import CONFIG_SPACE, FwdConfig, FwdKey

C_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ALL_KEYS = list(spec.enumerate_keys())
ALL_CONFIGS = [FwdConfig(**dict(zip(CONFIG_SPACE, values))) for values in itertools.product(*CONFIG_SPACE.values())]

# Every value each field can take, to flip one field at a time.
KEY_VALUES = {
    "arch": spec.ARCHS,
    "dtype": spec.DTYPES,
    "head_dim": spec.HEAD_DIMS,
    "mask": spec.MASKS,
    "softcap": (False, True),
    "alibi": (False, True),
    "varlen": (False, True),
    "kv": spec.KV_LAYOUTS,
    "split": (False, True),
    "pack_gqa": (False, True),
    "dropout": (False, True),
}


def test_key_value_table_covers_every_field():
    assert set(KEY_VALUES) == {f.name for f in dataclasses.fields(FwdKey)}
    assert set(CONFIG_SPACE) == {f.name for f in dataclasses.fields(FwdConfig)}


def _valid_keys_of_product() -> int:
    count = 0
    for values in itertools.product(*KEY_VALUES.values()):
        try:
            FwdKey(**dict(zip(KEY_VALUES, values)))
        except ValueError:  # combinations the key forbids (e.g. split-KV without a KV cache)
            continue
        count += 1
    return count


def test_key_space_is_every_valid_combination():
    assert len(ALL_KEYS) == len(set(ALL_KEYS)) == _valid_keys_of_product()


@pytest.mark.parametrize("names", [[k.name for k in ALL_KEYS], [c.name for c in ALL_CONFIGS]], ids=["key", "config"])
def test_names_are_unique_c_identifiers(names):
    assert len(set(names)) == len(names)
    for name in names:
        assert C_IDENT.fullmatch(name) and not keyword.iskeyword(name), name


def test_key_names_round_trip():
    for key in ALL_KEYS:
        assert spec.key_from_name(key.name) == key


@pytest.mark.parametrize("bad", ["", "bwd_sm80_fp16_hd64_none", "fwd_sm80_fp16_64_none", "fwd_sm80_fp16_hd64_none_rope"])
def test_key_from_name_rejects_garbage(bad):
    with pytest.raises(ValueError):
        spec.key_from_name(bad)


@pytest.mark.parametrize("field", list(KEY_VALUES))
def test_changing_any_key_field_changes_the_name(field):
    base = FwdKey("sm90", "bf16", 128, kv="dense" if field in ("kv", "varlen", "dropout") else "cache")
    for value in KEY_VALUES[field]:
        other = dataclasses.replace(base, **{field: value})
        assert (other.name == base.name) == (other == base)


@pytest.mark.parametrize("field", list(CONFIG_SPACE))
def test_changing_any_config_field_changes_the_name(field):
    base = FwdConfig()
    for value in CONFIG_SPACE[field]:
        other = dataclasses.replace(base, **{field: value})
        assert (other.name == base.name) == (other == base)


@pytest.mark.parametrize("bad", [dict(arch="sm75"), dict(dtype="fp32"), dict(head_dim=60), dict(head_dim=264), dict(mask="sliding")])
def test_key_rejects_values_outside_the_space(bad):
    with pytest.raises(ValueError):
        FwdKey(**{"arch": "sm80", "dtype": "fp16", "head_dim": 64, **bad})


def test_default_config_is_feasible_and_in_the_search_space():
    for key in ALL_KEYS:
        cfg = spec.default_config(key)
        assert spec.infeasible_reason(key, cfg) is None, (key.name, cfg.name)
        assert cfg in set(spec.enumerate_configs(key)), (key.name, cfg.name)


@pytest.mark.parametrize(
    "head_dim,cfg,reason",
    [
        (256, FwdConfig(block_m=128, block_n=128, kv_stages=2), "shared memory"),
        (256, FwdConfig(block_m=128, block_n=64, num_warps=4), "register"),
        (64, FwdConfig(block_m=64, num_warps=8), "block_m"),
        (64, FwdConfig(block_n=40), "block_n"),
    ],
)
def test_infeasible_reason_explains_rejections(head_dim, cfg, reason):
    key = FwdKey("sm80", "fp16", head_dim)
    why = spec.infeasible_reason(key, cfg)
    assert why is not None and reason in why
    assert cfg not in set(spec.enumerate_configs(key))


def test_smem_limit_depends_on_arch():
    """A config can fit Hopper's 227 KiB but not Ampere's 163 KiB."""
    cfg = FwdConfig(block_m=128, block_n=128, num_warps=8, kv_stages=2)
    hd = 160
    assert spec.MAX_SMEM_PER_BLOCK["sm80"] < spec.smem_bytes(FwdKey("sm80", "fp16", hd), cfg)
    assert "shared memory" in spec.infeasible_reason(FwdKey("sm80", "fp16", hd), cfg)
    assert spec.smem_bytes(FwdKey("sm90", "fp16", hd), cfg) <= spec.MAX_SMEM_PER_BLOCK["sm90"]
