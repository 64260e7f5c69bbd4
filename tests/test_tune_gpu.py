"""GPU end-to-end test of `flash-gen tune`: a tiny tune (two trials per bucket) measures the default, searches,
writes a database entry per bucket that is never slower than the default, the runtime then picks the tuned
tiling for calls in that bucket, and `--verify` re-measures every entry."""

from __future__ import annotations

import pytest

from flash_gen import cli, tuned
from flash_gen.fwd_tilings import config_from_name, default_config
from flash_gen.spec import FwdKey

pytestmark = pytest.mark.gpu


def test_tiny_tune_writes_the_database(tmp_path, monkeypatch, capsys):
    db_path = tmp_path / "sm90.json"
    family = ["tune", "--arch", "sm90", "--hdim", "64", "--dtype", "bf16", "--mask", "none", "--direction", "fwd",
              "--database", str(db_path), "-j", "4"]
    rc = cli.main([*family, "--trials", "2", "--storage", f"sqlite:///{tmp_path / 'tune.sqlite3'}", "--seed", "0"])
    assert rc == 0
    db = tuned.load("sm90", db_path)
    key = FwdKey("sm90", "bf16", 64, "none")
    for bucket in ("s<=1k", "s<=4k", "s>4k"):
        entry = db.lookup(key.name, bucket)
        assert entry is not None and entry.ms <= entry.default_ms and entry.default_config == default_config(key).name
        assert entry.gpu and entry.trials >= 1
    monkeypatch.setattr(tuned, "shipped", lambda arch: db)  # the runtime reads this database
    assert tuned.tuned_config(key, "s<=4k") == config_from_name(db.lookup(key.name, "s<=4k").config)
    capsys.readouterr()
    # A two-trial winner may lose to the default on one shape when re-timed (exit status 1); both are answers.
    assert cli.main([*family, "--verify"]) in (0, 1)
    assert "3 entries re-measured" in capsys.readouterr().out
