"""GPU end-to-end test of `flash-gen tune`: a tiny tune (two trials per bucket) measures the default, searches,
writes a database entry per bucket that is never slower than the default, and the runtime then picks the tuned
tiling for calls in that bucket."""

from __future__ import annotations

import pytest

from flash_gen import cli, tuned
from flash_gen.fwd_tilings import config_from_name, default_config
from flash_gen.spec import FwdKey

pytestmark = pytest.mark.gpu


def test_tiny_tune_writes_the_database(tmp_path, monkeypatch):
    db_path = tmp_path / "sm90.json"
    rc = cli.main(["tune", "--arch", "sm90", "--hdim", "64", "--dtype", "bf16", "--mask", "none", "--direction",
                   "fwd", "--trials", "2", "--storage", f"sqlite:///{tmp_path / 'tune.sqlite3'}", "--database",
                   str(db_path), "--seed", "0", "-j", "4"])
    assert rc == 0
    db = tuned.load("sm90", db_path)
    key = FwdKey("sm90", "bf16", 64, "none")
    for bucket in ("s<=1k", "s<=4k", "s>4k"):
        entry = db.lookup(key.name, bucket)
        assert entry is not None and entry.ms <= entry.default_ms and entry.default_config == default_config(key).name
        assert entry.gpu and entry.trials >= 1
    monkeypatch.setattr(tuned, "shipped", lambda arch: db)  # the runtime reads this database
    assert tuned.tuned_config(key, "s<=4k") == config_from_name(db.lookup(key.name, "s<=4k").config)
