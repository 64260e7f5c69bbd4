"""CPU checks of the Hopper (TMA + wgmma) forward kernel (issue 7): its tiling identities, and that it renders and
compiles with NVRTC for sm_90a without spills, with TMA loads, wgmma for both GEMMs and setmaxnreg (the SASS,
which shows HGMMA and UTMALDG, is checked on the GPU machine in tests/test_fwd_sm90_gpu.py)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from flash_gen import bwd_tilings, fwd_tilings, tuned
from flash_gen.build import batches
from flash_gen.spec import FwdKey
from flash_gen.spec_sm90 import (
    STREAM_K_MIN_STEPS,
    Sm90FwdConfig,
    StreamKPlan,
    default_sm90_config,
    sm90_config_from_name,
    sm90_infeasible_reason,
    sm90_o_in_v,
    sm90_smem_bytes,
    sm90_stream_k,
    stream_k_plan,
)


def test_config_names_round_trip_and_other_names_are_not_sm90():
    for cfg in (Sm90FwdConfig(), Sm90FwdConfig(176, 2), Sm90FwdConfig(64, 3, pingpong=False, block_m=192),
                Sm90FwdConfig(128, 2, persistent=True), Sm90FwdConfig(64, 2, p_in_smem=True, cluster=2),
                Sm90FwdConfig(176, 3, overlap=False, cluster=2, persistent=True),
                Sm90FwdConfig(112, 2, block_m=192, p_in_smem=True, align=True, cluster=2, persistent=True),
                Sm90FwdConfig(128, 2, persistent=True, max_free=True),
                Sm90FwdConfig(64, 3, block_m=192, p_in_smem=True, align=True, cluster=2, max_free=True)):  # name only
        assert sm90_config_from_name(cfg.name) == cfg
    assert sm90_config_from_name("m128n64w4s2") is None


@pytest.mark.parametrize("key,cfg,reason", [
    (FwdKey("sm80", "bf16", 128), Sm90FwdConfig(), "sm90"),
    (FwdKey("sm90", "bf16", 128, varlen=True), Sm90FwdConfig(persistent=True), "varlen"),
    (FwdKey("sm90", "bf16", 128, kv="paged"), Sm90FwdConfig(), "portable kernel"),
    (FwdKey("sm90", "bf16", 128, varlen=True, kv="cache"), Sm90FwdConfig(persistent=True), "one CTA each"),
    (FwdKey("sm90", "bf16", 128, kv="cache"), Sm90FwdConfig(persistent=True), "one CTA each"),
    (FwdKey("sm90", "bf16", 128, kv="cache"), Sm90FwdConfig(cluster=2), "one CTA each"),
    (FwdKey("sm90", "bf16", 128, kv="cache"), Sm90FwdConfig(96), "divide 128"),
    (FwdKey("sm90", "bf16", 256), Sm90FwdConfig(128), "tile registers"),
    (FwdKey("sm90", "bf16", 64), Sm90FwdConfig(24), "multiple of 16"),
    (FwdKey("sm90", "bf16", 128), Sm90FwdConfig(128, 4), "shared memory"),
    (FwdKey("sm90", "bf16", 256), Sm90FwdConfig(96, persistent=True), "shared memory"),  # O in the V ring
    (FwdKey("sm90", "bf16", 128), Sm90FwdConfig(128, block_m=192), "3 consumers"),
    (FwdKey("sm90", "bf16", 64), Sm90FwdConfig(block_m=256), "128 or 192"),
    (FwdKey("sm90", "bf16", 128, "causal"), Sm90FwdConfig(cluster=2), "unmasked dense"),
    (FwdKey("sm90", "bf16", 128, varlen=True), Sm90FwdConfig(cluster=2), "unmasked dense"),
    (FwdKey("sm90", "bf16", 128), Sm90FwdConfig(cluster=4), "1 or 2"),
    (FwdKey("sm90", "bf16", 80), Sm90FwdConfig(112, block_m=192, align=True), "8 padding columns"),
    (FwdKey("sm90", "bf16", 128), Sm90FwdConfig(align=True), "8 padding columns"),
    (FwdKey("sm90", "bf16", 72, varlen=True, kv="cache"), Sm90FwdConfig(64, block_m=192, align=True), "dense K/V"),
    (FwdKey("sm90", "bf16", 72, split=True), Sm90FwdConfig(112, block_m=192, align=True), "dense K/V"),
    (FwdKey("sm90", "bf16", 128), Sm90FwdConfig(overlap=False, max_free=True), "overlapped"),
    (FwdKey("sm90", "bf16", 256), Sm90FwdConfig(64, max_free=True), "above 128"),
    (FwdKey("sm90", "bf16", 64, softcap=True), Sm90FwdConfig(block_m=192, max_free=True), "softcap, ALiBi"),
])
def test_infeasible_reason_explains_rejections(key, cfg, reason):
    why = sm90_infeasible_reason(key, cfg)
    assert why is not None and reason in why


def test_stream_k_shares_a_partial_last_round_by_key_steps():
    # a batch-1 prefill, 9 heads of 2048 queries at head dim 128: 144 tiles of 16 key steps over 132 CTAs would
    # take two rounds for 12 tiles; each CTA takes ceil(12 x 16 / 132) steps of those (at least STREAM_K_MIN_STEPS)
    assert stream_k_plan(144, 132, 16) == StreamKPlan(132, 1, 12, 16, STREAM_K_MIN_STEPS)
    assert stream_k_plan(288, 132, 36) == StreamKPlan(132, 2, 24, 36, 7)
    assert stream_k_plan(100, 132, 16) == StreamKPlan(132, 0, 100, 16, 13)  # fewer tiles than CTAs: all launched
    # whole tiles: rounds that come out even, too many rounds for the last to matter (head dim 128 at 2k in the
    # benchmark's batches: 4096 tiles), a nearly full last round, tiles too short to share, or not allowed
    assert stream_k_plan(264, 132, 16) == StreamKPlan(132, 2, 0, 16, 0)
    assert stream_k_plan(4096, 132, 16) == StreamKPlan(132, 31, 4, 16, 0)
    assert stream_k_plan(260, 132, 16) == StreamKPlan(132, 1, 128, 16, 0)
    assert stream_k_plan(140, 132, 4) == StreamKPlan(132, 1, 8, 4, 0)
    assert stream_k_plan(144, 132, 16, allow=False) == StreamKPlan(132, 1, 12, 16, 0)
    assert stream_k_plan(100, 132, 16, allow=False) == StreamKPlan(100, 1, 0, 16, 0)
    # which kernels share: persistent, no cluster, unmasked dense keys without dropout
    persistent = Sm90FwdConfig(persistent=True)
    assert sm90_stream_k(FwdKey("sm90", "bf16", 128), persistent)
    assert sm90_stream_k(FwdKey("sm90", "fp16", 256), persistent)
    assert not sm90_stream_k(FwdKey("sm90", "bf16", 128), Sm90FwdConfig())
    assert not sm90_stream_k(FwdKey("sm90", "bf16", 128, softcap=True), persistent)
    assert not sm90_stream_k(FwdKey("sm90", "bf16", 128, pack_gqa=True), persistent)
    assert not sm90_stream_k(FwdKey("sm90", "bf16", 216), Sm90FwdConfig(96, persistent=True, align=True))
    assert not sm90_stream_k(FwdKey("sm90", "bf16", 128), Sm90FwdConfig(persistent=True, cluster=2))
    assert not sm90_stream_k(FwdKey("sm90", "bf16", 128, "causal"), persistent)
    assert not sm90_stream_k(FwdKey("sm90", "bf16", 128, dropout=True), persistent)


def test_varlen_defaults_run_one_cta_per_tile():
    for d in (64, 96, 128, 256):
        for mask in ("causal", "local"):
            dense, packed = (default_sm90_config(FwdKey("sm90", "bf16", d, mask, varlen=v)) for v in (False, True))
            assert packed is not None and not packed.persistent
            if d == 128 and mask == "causal":  # packed batches measured faster on 192 x 80 tiles
                assert packed == Sm90FwdConfig(80, 3, pingpong=False, block_m=192)
            else:
                assert dataclasses.replace(packed, persistent=dense.persistent) == dense


def test_kv_cache_keys_run_the_hopper_kernel_one_cta_per_tile_with_one_more_barrier():
    for d in (64, 128, 256):
        dense, cache = (FwdKey("sm90", "bf16", d, "causal", kv=kv) for kv in ("dense", "cache"))
        cfg = default_sm90_config(cache)
        assert cfg is not None and not cfg.persistent and 128 % cfg.block_n == 0
        assert dataclasses.replace(cfg, persistent=default_sm90_config(dense).persistent) == default_sm90_config(dense)
        assert sm90_smem_bytes(cache, cfg) == sm90_smem_bytes(dense, cfg) + 8
    # decoding steps keep the portable kernel: its default is where the chain leaves the Hopper tilings
    key = FwdKey("sm90", "bf16", 128, kv="cache", pack_gqa=True)
    chain = fwd_tilings.default_configs(key)
    assert isinstance(chain[0], Sm90FwdConfig) and fwd_tilings.portable_config(key) in chain
    assert fwd_tilings.measured_defaults(key) == (chain[0], fwd_tilings.portable_config(key))
    # from one consumer warpgroup's 64 rows per KV head (positions x packed heads), groups of at most 64
    runs = fwd_tilings.cache_chunk_runs_hopper
    assert [runs("cache", sq, 4, True) for sq in (1, 15, 16, 1000)] == [False, False, True, True]
    assert [runs("cache", sq, 4, False) for sq in (16, 63, 64)] == [False, False, True]  # ALiBi: unpacked
    assert not runs("paged", 1000, 4, True) and not runs("cache", 1000, 128, True)


def test_a_persistent_default_falls_back_to_one_cta_per_tile_before_the_portable_kernel():
    """Head dim 256 non-causal with softcap or ALiBi: the persistent head spills (NVRTC 13.0) where its one CTA per
    tile form does not, and that runs 1.8x the portable kernel (H200, 2026-12-03)."""
    key = FwdKey("sm90", "bf16", 256, "none", softcap=True)
    chain = fwd_tilings.default_configs(key)
    assert chain[0].persistent and chain[1] == dataclasses.replace(chain[0], persistent=False)
    assert all(isinstance(c, Sm90FwdConfig) for c in chain[:2]) and not isinstance(chain[-1], Sm90FwdConfig)


def test_persistent_ctas_stage_o_in_the_v_ring_where_a_buffer_of_its_own_does_not_fit():
    key256, key128 = FwdKey("sm90", "bf16", 256), FwdKey("sm90", "bf16", 128)
    persist = Sm90FwdConfig(80, pingpong=False, persistent=True)
    assert sm90_o_in_v(key256, persist) and sm90_infeasible_reason(key256, persist) is None
    # Q and two stages of 80 K and V rows, 512 bytes each, 12 mbarriers (two for the O stores) and the tile slot
    assert sm90_smem_bytes(key256, persist) == 512 * (128 + 4 * 80) + 8 * 12 + 64
    assert not sm90_o_in_v(key128, persist)  # an O buffer of its own fits beside Q and the ring
    for cfg in (Sm90FwdConfig(80, pingpong=False), dataclasses.replace(persist, cluster=2)):
        assert not sm90_o_in_v(key256, cfg)  # one tile per CTA (O through Q); peers multicast into the ring
    assert "shared memory" in sm90_infeasible_reason(key256, dataclasses.replace(persist, cluster=2))


def test_head_dims_compute_exactly_in_multiples_of_32_and_at_16_48_80(monkeypatch):
    from flash_gen.spec_sm90 import needs_extended_wgmma, sm90_box_cols, sm90_head_dim

    dims = (8, 16, 40, 48, 64, 72, 80, 88, 96, 112, 128, 144, 160, 200, 208, 224, 232, 256)
    computed = [sm90_head_dim(FwdKey("sm90", "bf16", d)) for d in dims]
    assert computed == [64, 16, 64, 48, 64, 80, 80, 128, 96, 128, 128, 192, 160, 224, 224, 224, 256, 256]
    assert [sm90_box_cols(d) for d in computed] == [64, 16, 64, 16, 64, 16, 16, 64, 32, 64, 64, 64, 32, 32, 32, 32,
                                                    64, 64]
    # a key without tuned entries of its own takes those of the head dim it computes
    db = tuned.TunedDb("sm90")
    monkeypatch.setattr(tuned, "shipped", lambda arch: db)
    key72, key80, key88, key128 = (FwdKey("sm90", "bf16", d) for d in (72, 80, 88, 128))
    for key, name in ((key128, "wgm192n80s3"), (key80, "wgm128n128s2p_persist"), (key72, "wgm192n112s3_persist")):
        default = fwd_tilings.default_config(key).name
        db.record(key.name, "s>4k", tuned.Entry(name, 1.0, default, 1.1, "gpu", "drv", "now", 3))
    # with aligned rows: 88's odd heads start mid-sector (176-byte rows)
    assert tuned.tuned_config(key88, "s>4k").name == "wgm192n80s3_al" and tuned.tuned_config(key88, "s<=4k") is None
    assert tuned.tuned_config(key72, "s>4k").name == "wgm192n112s3_persist"  # its own entry first
    # the aligned form, then the entry as is (the runtime takes the first without spills)
    assert [c.name for c in tuned.derived_configs(key88, "s>4k")] == ["wgm192n80s3_al", "wgm192n80s3"]
    assert tuned.derived_configs(key88, "s<=4k") == ()
    from flash_gen.runtime import loader

    spilled = []
    monkeypatch.setattr(loader, "_spill_bytes", lambda key, cfg: spilled.append(cfg.name) or 4 * cfg.align)
    assert loader.tuned_config(key88, "s>4k").name == "wgm192n80s3" and spilled == ["wgm192n80s3_al", "wgm192n80s3"]
    assert loader.tuned_config(key72, "s>4k").name == "wgm192n112s3_persist" and len(spilled) == 2  # tuned as is
    # the defaults of head dims 8 mod 16 align their rows where the key can shift columns; the unaligned head follows
    # (aligning costs registers) and still counts as the default a tuned entry was measured against
    chain = fwd_tilings.default_configs(key88)
    assert chain[0].name == "wgm128n128s2_al_persist" and chain[1].name == "wgm128n128s2_persist"
    assert [c.name for c in fwd_tilings.measured_defaults(key72)] == ["wgm192n112s2p_al", "wgm192n112s2p"]
    assert fwd_tilings.default_config(FwdKey("sm90", "bf16", 88, varlen=True)).name == "wgm192n80s3_al"
    for key in (key80, key128, FwdKey("sm90", "bf16", 88, split=True), FwdKey("sm90", "bf16", 120, kv="cache")):
        assert not fwd_tilings.default_config(key).align, key.name
    # Q's 128 rows and two stages of 128 K and V rows, 160 bytes each, then 10 mbarriers
    assert sm90_smem_bytes(FwdKey("sm90", "bf16", 80), Sm90FwdConfig()) == 640 * 160 + 10 * 8
    assert sm90_infeasible_reason(FwdKey("sm90", "bf16", 80), Sm90FwdConfig()) is None
    # the P V GEMM's N is the head dim: 80 is outside CuTe's basic wgmma set, 96 inside
    assert needs_extended_wgmma(FwdKey("sm90", "bf16", 80), Sm90FwdConfig())
    assert not needs_extended_wgmma(FwdKey("sm90", "bf16", 96), Sm90FwdConfig())


def test_head_dims_computed_as_another_run_that_head_dims_kernel():
    from flash_gen.gen import render

    cfg = sm90_config_from_name("wgm192n112s2p")
    key72, key80 = FwdKey("sm90", "bf16", 72, "causal"), FwdKey("sm90", "bf16", 80, "causal")
    # the same source and symbol, so the library's (or the cache's) head dim 80 kernel serves head dim 72
    assert render.entry_name(key72, cfg) == render.entry_name(key80, cfg) == f"flash_gen_{key80.name}__{cfg.name}"
    assert render.render_many([(key72, cfg)]) == render.render_many([(key80, cfg)])
    assert render.kernel_key(FwdKey("sm90", "fp16", 112), Sm90FwdConfig()) == FwdKey("sm90", "fp16", 128)
    # one kernel per translation unit and batch, however many keys share it
    both = [(key72, cfg), (key80, cfg)]
    assert render.render_many(both).count(f"{render.entry_name(key80, cfg)}(") == 1
    assert batches.plan_batches(both, jobs=2) == [[(key72, cfg)]]
    # the Hopper backward takes the tensors' head dim at run time: 72-128 share 128's kernel, 8-64 64's
    from flash_gen.spec_bwd import BwdKey
    from flash_gen.spec_bwd_sm90 import sm90_bwd_config_from_name

    steps = sm90_bwd_config_from_name("wgbm64n128ob")
    narrow = sm90_bwd_config_from_name("wgbm64n128ob_h96")  # head dims 72-96 computed as 96
    for hd, computed, cfg in ((72, 128, steps), (96, 128, steps), (40, 64, steps), (72, 96, narrow), (88, 96, narrow)):
        key, kernel = BwdKey("sm90", "bf16", hd, "none"), BwdKey("sm90", "bf16", computed, "none")
        assert render.entry_name(key, cfg) == render.entry_name(kernel, cfg)
        assert render.render_many([(key, cfg)]) == render.render_many([(kernel, cfg)])
    split = sm90_bwd_config_from_name("wgbm64n64ob")  # 136-248 computed as 256, the warpgroups splitting it
    assert render.entry_name(BwdKey("sm90", "bf16", 192), split) == render.entry_name(BwdKey("sm90", "bf16", 256), split)
    with pytest.raises(ValueError, match="narrow"):  # a key its kernel's own cannot stand in for
        render.render_many([(BwdKey("sm90", "bf16", 224), sm90_bwd_config_from_name("wgbm64n64ob_h96"))])
    # the portable kernels specialise every head dim exactly
    portable = fwd_tilings.default_config(FwdKey("sm80", "bf16", 72))
    assert render.entry_name(FwdKey("sm80", "bf16", 72), portable) != render.entry_name(FwdKey("sm80", "bf16", 80),
                                                                                         portable)


def test_renders_and_compiles_without_spills_on_wgmma(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH_GEN_CACHE_DIR", str(tmp_path))
    variants = [(FwdKey("sm90", "bf16", 128, "causal"), Sm90FwdConfig()),
                (FwdKey("sm90", "fp16", 64), Sm90FwdConfig(block_m=192)),  # three consumer warpgroups
                (FwdKey("sm90", "fp16", 64, "local", softcap=True, alibi=True), Sm90FwdConfig()),
                # an N outside CuTe's basic set; a cluster of two CTAs multicasting K/V
                (FwdKey("sm90", "bf16", 128), Sm90FwdConfig(176, pingpong=False, cluster=2)),
                (FwdKey("sm90", "bf16", 128, "causal"), Sm90FwdConfig(pingpong=False, persistent=True)),
                # packed batch; block_n 96: a warpgroup's last P V GEMM over half the keys in three k-steps
                (FwdKey("sm90", "bf16", 64, "causal", varlen=True), Sm90FwdConfig(96, block_m=192)),
                (FwdKey("sm90", "bf16", 128, "causal", pack_gqa=True), Sm90FwdConfig(pingpong=False, persistent=True)),
                # head dim 80 exactly: 16-column boxes in a 32-byte swizzle, P V's N = 80 an extended shape
                (FwdKey("sm90", "bf16", 80, "causal"), Sm90FwdConfig(112, block_m=192)),
                # head dim 256's default where no mask bounds the keys: persistent, O staged in the V ring, stream-K
                (FwdKey("sm90", "bf16", 256), Sm90FwdConfig(80, pingpong=False, persistent=True)),
                # head dim 72 in 80's boxes with aligned rows: box columns shifted per KV head
                (FwdKey("sm90", "bf16", 72, "causal"), Sm90FwdConfig(112, block_m=192, align=True))]
    assert all(sm90_infeasible_reason(k, c) is None for k, c in variants)
    assert sm90_smem_bytes(*variants[0]) == 2 * 128 * (128 + 2 * 2 * 128) + 8 * (2 + 4 * 2)
    compiled = batches.compile_batch(variants)
    for c in compiled:
        assert c.error is None, c.error
        r = c.result
        assert (r.spill_stores, r.spill_loads, r.stack_frame) == (0, 0, 0), f"{c.entry} spills"
        assert not r.wgmma_serialized, f"{c.entry}: ptxas serialised its wgmmas (C7515)"
        # ptxas allocates __launch_bounds__' cap: the CTA's register pool, which setmaxnreg only rebalances (an inc
        # waits for registers the CTA's own decs freed), so the producer's and consumers' budgets must fit it
        assert r.registers == min(255, 65536 // (c.cfg.ctas_per_sm * c.cfg.num_threads)) // 8 * 8, c.entry
        assert "wgmma.mma_async.sync.aligned.m64n128k16.f32" in r.ptx  # S = QK^T and O += PV
        assert "cp.async.bulk.tensor.4d" in r.ptx and "mbarrier.try_wait.parity" in r.ptx  # TMA ring
        assert "cp.async.bulk.tensor.5d" in r.ptx  # Q and O: (head_dim, group's heads, seqlen, groups, batch)
        assert "setmaxnreg.inc.sync.aligned.u32 240" in r.ptx and "bar.arrive" in r.ptx  # consumers, ping-pong
        # 176 keys per step (and head dim 80's P V) in one wgmma per k-step, not N = 16 ones (CuTe's extended shapes)
        assert "m64n176k16" in r.ptx and "m64n80k16" in r.ptx and "m64n16k16" not in r.ptx
    # the cluster's kernel alone: K/V multicast, launched in clusters of two (compile-time cluster dims). The batch
    # is one translation unit, so each kernel's part of the PTX is its .entry section.
    sections = dict(part.split("(", 1) for part in compiled[0].result.ptx.split(".visible .entry ")[1:])
    for c in compiled:
        body = sections[c.entry]
        assert (".multicast::cluster" in body) == (".reqnctapercluster 2, 1, 1" in body) == (c.cfg.cluster == 2)
        # aligned rows stage O in 8-column stmatrix blocks (rotated back per KV head), the others in 16-column ones
        assert ("stmatrix.sync.aligned.x2." in body) == c.cfg.align, c.entry
        # stream-K: a partial's writers arrive on their flag
        assert ("red.release.gpu.global.add.u32" in body) == sm90_stream_k(c.key, c.cfg), c.entry


def test_pack_gqa_pays_where_few_query_positions_leave_tiles_empty():
    from flash_gen.fwd_tilings import pack_gqa_pays

    key = FwdKey("sm90", "bf16", 128, "causal")  # 128-row tiles; packed, 2 x 64 // group positions
    assert pack_gqa_pays(key, 1, 8) and pack_gqa_pays(key, 100, 8) and pack_gqa_pays(key, 1, 64)
    assert pack_gqa_pays(key, 2048, 8)  # as many tiles, each K/V tile read once per group
    assert not pack_gqa_pays(key, 2048, 3)  # 63 of a warpgroup's 64 rows used: one tile more per KV head
    assert not pack_gqa_pays(key, 1, 1) and not pack_gqa_pays(key, 1, 65)  # no group; over a warpgroup's rows
    assert not pack_gqa_pays(dataclasses.replace(key, alibi=True), 1, 8)  # a slope per head
    assert not pack_gqa_pays(dataclasses.replace(key, varlen=True), 1, 8)
    assert pack_gqa_pays(FwdKey("sm80", "bf16", 128), 1, 128)  # the portable kernel stacks any group


def test_cli_compile_accepts_hopper_config_names():
    from flash_gen import cli

    assert cli._config_name("wgm128n192s2p") == "wgm128n192s2p"
    args = argparse.Namespace(
        arch=("sm80", "sm90"), dtype=("bf16",), hdim=(128,), mask=("none",), softcap=False, alibi=False, varlen=False,
        kv="dense", split=False, pack_gqa=False, direction=("fwd",), deterministic=False, configs=("wgm128n128s2p",))
    assert [(k.arch, c.name) for k, c in cli._variants(args)] == [("sm90", "wgm128n128s2p")]  # sm80: infeasible


def test_hopper_backward_is_the_sm90_default_where_it_fits():
    """bwd_tilings.default_config: the Hopper backward for sm90 head dims up to 128 (computed as 64, 96 or 128)
    and 136-256 (computed as 192 or 256, the head dim split over 64-key tiles), softcap, ALiBi or not, dense or
    packed, deterministic or not; the portable backward everywhere else."""
    from flash_gen import spec, spec_bwd
    from flash_gen.spec_bwd import BwdKey
    from flash_gen.spec_bwd_sm90 import default_sm90_bwd_config

    hopper = [BwdKey("sm90", dt, hd, m) for dt in ("bf16", "fp16") for hd in (64, 96, 128, 256) for m in spec.MASKS]
    hopper += [BwdKey("sm90", "bf16", hd, "causal") for hd in (8, 40, 72, 120)]
    hopper += [BwdKey("sm90", "bf16", hd, "causal", varlen=True) for hd in (64, 128, 256)]
    hopper += [BwdKey("sm90", "bf16", hd, "none", deterministic=True) for hd in (64, 72, 128, 256)]
    hopper += [BwdKey("sm90", "bf16", hd, m, varlen=True, deterministic=True) for hd in (64, 96, 128) for m in ("none", "local")]
    hopper += [BwdKey("sm90", dt, hd, "none", varlen=True) for dt in ("bf16", "fp16") for hd in (64, 96, 128)]
    hopper += [BwdKey("sm90", "bf16", hd, m, alibi=True) for hd in (64, 96, 128, 256) for m in spec.MASKS]
    hopper += [BwdKey("sm90", "bf16", 64, "none", softcap=True), BwdKey("sm90", "bf16", 128, "causal", softcap=True,
                                                                         alibi=True)]
    hopper += [BwdKey("sm90", dt, hd, m, dropout=True) for dt in ("bf16", "fp16") for hd in (64, 128, 256)
               for m in ("none", "causal")]
    hopper += [BwdKey("sm90", "bf16", 160, "none"), BwdKey("sm90", "bf16", 192, "causal", alibi=True),
               BwdKey("sm90", "bf16", 176, "none", deterministic=True),
               BwdKey("sm90", "bf16", 144, "causal", varlen=True),
               BwdKey("sm90", "fp16", 224, "local", dropout=True),  # 136-192 computed as 192, 200-248 as 256
               BwdKey("sm90", "bf16", 192, "causal", softcap=True), BwdKey("sm90", "bf16", 256, "none", softcap=True),
               BwdKey("sm90", "bf16", 176, "causal", softcap=True, dropout=True)]
    portable = [BwdKey("sm80", "bf16", 128, "none"), BwdKey("sm100", "bf16", 64, "causal")]
    assert all(bwd_tilings.default_config(k) == default_sm90_bwd_config(k) for k in hopper)
    # head dims 72-96 compute as 96 and 136-192 as 192 (narrow), with bulk dQ without the overlap; ordered dQ
    # overlaps on dense unmasked batches as the wide tilings do
    narrow = [k for k in hopper if 64 < k.head_dim <= 96 or 128 < k.head_dim <= 192]
    assert {default_sm90_bwd_config(k).name for k in narrow if not k.deterministic} == {"wgbm64n128b_h96",
                                                                                       "wgbm64n64b_h96"}
    assert {default_sm90_bwd_config(k).name for k in narrow if k.deterministic} == {"wgbm64n128o_h96", "wgbm64n64o_h96",
                                                                                   "wgbm64n128_h96"}
    assert all(default_sm90_bwd_config(k).overlap == (k.mask == "none" and not k.varlen)
               for k in narrow if k.deterministic)
    assert all(default_sm90_bwd_config(k).block_n == (64 if k.head_dim > 128 else 128) for k in narrow)
    assert default_sm90_bwd_config(BwdKey("sm90", "bf16", 160, "causal", dropout=True)).name == "wgbm64n64b_h96"
    hopper = [k for k in hopper if k not in narrow]
    assert {default_sm90_bwd_config(k).name for k in hopper} == {
        "wgbm64n128", "wgbm64n128o", "wgbm64n128ob", "wgbm128n128ob", "wgbm80n128b", "wgbm64n64o", "wgbm64n64ob"}
    # bulk dQ with the overlap at every head dim and mask, dense or packed, unless deterministic; with 128-query
    # steps at head dims up to 64 without ALiBi, and 80-query steps without the overlap on dense unmasked batches
    # at 72-128 without ALiBi, whose chains then fall back to 64-query steps before the portable kernel; dropout
    # keeps 64-query steps (the wider ones spill 100-416 B)
    bulk = [k for k in hopper if not k.deterministic]
    wide = [k for k in bulk if not k.alibi and not k.dropout and (
        k.head_dim <= 64 or (k.head_dim <= 128 and k.mask == "none" and not k.varlen))]
    assert all(default_sm90_bwd_config(k).dq_bulk == (k in bulk) for k in hopper)
    assert all(default_sm90_bwd_config(k).block_m == ((128 if k.head_dim <= 64 else 80) if k in wide else 64)
               for k in hopper)
    # each bulk tiling with the overlap is followed by its decoupled form (which keeps the overlap where the
    # coupled one spills), then by the same without the overlap
    chain = [c.name for c in bwd_tilings.default_configs(BwdKey("sm90", "bf16", 64, "causal"))]
    assert chain[:6] == ["wgbm128n128ob", "wgbm128n128obd", "wgbm128n128b", "wgbm64n128ob", "wgbm64n128obd",
                         "wgbm64n128b"]
    chain = [c.name for c in bwd_tilings.default_configs(BwdKey("sm90", "bf16", 120, "none"))]
    assert chain[:4] == ["wgbm80n128b", "wgbm64n128ob", "wgbm64n128obd", "wgbm64n128b"]
    # a narrow head, should it spill, is followed by the 128-wide chain
    chain = [c.name for c in bwd_tilings.default_configs(BwdKey("sm90", "bf16", 96, "none"))]
    assert chain[:6] == ["wgbm64n128b_h96", "wgbm80n128b", "wgbm64n128ob", "wgbm64n128obd", "wgbm64n128b",
                         "wgbm64n128_h96"]
    # after the bulk-dQ tilings, the same ones adding dQ by reductions (fewer registers), before the portable kernel
    chain = [c.name for c in bwd_tilings.default_configs(BwdKey("sm90", "bf16", 128, "causal", varlen=True))]
    assert chain[:6] == ["wgbm64n128ob", "wgbm64n128obd", "wgbm64n128b", "wgbm64n128o", "wgbm64n128",
                         "m64n128w8a422s2"]
    chain = [c.name for c in bwd_tilings.default_configs(BwdKey("sm90", "bf16", 120, "none"))]
    assert chain[4:6] == ["wgbm64n128o", "wgbm64n128"] and not chain[6].startswith("wgbm")  # 80: bulk dQ only
    # the split head dim has no decoupled form
    chain = [c.name for c in bwd_tilings.default_configs(BwdKey("sm90", "bf16", 256, "causal"))]
    assert chain[:2] == ["wgbm64n64ob", "wgbm64n64b"]
    # the dK/dV overlap where it measured ahead: head dim 64 (computed), unmasked dense batches, and with bulk dQ;
    # not with 80-query steps (48 B of spills)
    assert all(default_sm90_bwd_config(k).overlap == (default_sm90_bwd_config(k).block_m != 80 and (
        k.head_dim <= 64 or (k.mask == "none" and not k.varlen) or k in bulk)) for k in hopper)
    assert all(bwd_tilings.default_config(k) == spec_bwd.default_bwd_config(k) for k in portable)


def test_hopper_backward_compiles_on_wgmma(tmp_path, monkeypatch):
    """The Hopper backward: five wgmma GEMMs, S^T and dP^T from shared memory, dK/dV with P^T and dS^T from
    registers, no serialised wgmmas, no spills at head dim 64."""
    from flash_gen.spec_bwd import BwdKey
    from flash_gen.spec_bwd_sm90 import Sm90BwdConfig, sm90_bwd_infeasible_reason

    monkeypatch.setenv("FLASH_GEN_CACHE_DIR", str(tmp_path))
    key, cfg = BwdKey("sm90", "bf16", 64, "causal"), Sm90BwdConfig()
    assert sm90_bwd_infeasible_reason(key, cfg) is None
    assert sm90_bwd_infeasible_reason(BwdKey("sm90", "bf16", 64, "causal", softcap=True), cfg) is None
    split_softcap = BwdKey("sm90", "bf16", 256, "causal", softcap=True)
    assert sm90_bwd_infeasible_reason(split_softcap, Sm90BwdConfig(64, 64)) is None
    (c,) = batches.compile_batch([(key, cfg)])
    assert c.error is None, c.error
    assert c.ok, f"{c.entry}: spills or serialised wgmmas"
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in c.result.ptx  # S^T, dP^T, dK, dV
    assert "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16" in c.result.ptx  # dQ, head dim split in two


def test_hopper_backward_draws_dropout(tmp_path, monkeypatch):
    """Dropout keys run on the Hopper backward (keep bits drawn for S^T's layout, templates/include/flash_gen/
    dropout_transposed.cuh); the split head dim keeps a second, signed P^T (8 KB at 64 x 64)."""
    from flash_gen.spec_bwd import BwdKey
    from flash_gen.spec_bwd_sm90 import Sm90BwdConfig, sm90_bwd_infeasible_reason, sm90_bwd_smem_bytes

    monkeypatch.setenv("FLASH_GEN_CACHE_DIR", str(tmp_path))
    split = Sm90BwdConfig(64, 64, overlap=True, dq_bulk=True)
    plain, drop = BwdKey("sm90", "bf16", 256, "causal"), BwdKey("sm90", "bf16", 256, "causal", dropout=True)
    assert sm90_bwd_infeasible_reason(drop, split) is None
    assert sm90_bwd_smem_bytes(drop, split) == sm90_bwd_smem_bytes(plain, split) + 2 * 64 * 64
    key, cfg = BwdKey("sm90", "bf16", 64, "none", dropout=True), Sm90BwdConfig(64, 128, overlap=True, dq_bulk=True)
    assert sm90_bwd_infeasible_reason(key, cfg) is None
    (c,) = batches.compile_batch([(key, cfg)])  # the kernel's static_assert checks the shared-memory model
    assert c.error is None, c.error
    assert c.ok, f"{c.entry}: spills or serialised wgmmas"
    assert "shfl.sync.bfly.b32" in c.result.ptx  # the halves of each Philox block passed between lanes


def test_hopper_backward_narrow_head_dims(tmp_path, monkeypatch):
    """narrow ("_h96"): head dims 72-96 computed as 96, not 128, in 64-byte swizzled Q/dO boxes, 32-byte K/V rows
    and 16-column dQ boxes; compiles without spills, each warpgroup's dQ one N = 48 wgmma per k-step. 136-192
    computed as 192 rather than 256, split into 96-column halves in 64-byte swizzled rows."""
    from flash_gen.spec_bwd import BwdKey
    from flash_gen.spec_bwd_sm90 import (Sm90BwdConfig, sm90_bwd_box_cols, sm90_bwd_config_from_name,
                                         sm90_bwd_dq_box_cols, sm90_bwd_head_dim, sm90_bwd_infeasible_reason,
                                         sm90_bwd_smem_bytes)

    monkeypatch.setenv("FLASH_GEN_CACHE_DIR", str(tmp_path))
    cfg = Sm90BwdConfig(64, 128, overlap=True, dq_bulk=True, narrow=True)
    assert cfg.name == "wgbm64n128ob_h96" and sm90_bwd_config_from_name(cfg.name) == cfg
    wide = Sm90BwdConfig(64, 128, overlap=True, dq_bulk=True)
    for hd in (72, 80, 88, 96):
        key = BwdKey("sm90", "bf16", hd, "causal")
        assert sm90_bwd_infeasible_reason(key, cfg) is None
        assert (sm90_bwd_head_dim(key, cfg), sm90_bwd_head_dim(key, wide), sm90_bwd_head_dim(key)) == (96, 128, 128)
        # 32 columns fewer of Q and dO (two buffers each), K and V in bf16 and of the fp32 dQ staging
        saved = 2 * 32 * (4 * 64 + 2 * 128) + 4 * 64 * 32
        assert sm90_bwd_smem_bytes(key, wide) - sm90_bwd_smem_bytes(key, cfg) == saved
    assert (sm90_bwd_dq_box_cols(96), sm90_bwd_dq_box_cols(128), sm90_bwd_dq_box_cols(192)) == (16, 32, 32)
    assert [sm90_bwd_box_cols(d) for d in (64, 96, 128, 192, 256)] == [64, 32, 64, 32, 64]
    for hd in (64, 104, 128):
        assert "narrow" in sm90_bwd_infeasible_reason(BwdKey("sm90", "bf16", hd), cfg)
    split = Sm90BwdConfig(64, 64, dq_bulk=True, narrow=True)  # 136-192 computed as 192
    assert "narrow" in sm90_bwd_infeasible_reason(BwdKey("sm90", "bf16", 200), split)
    assert [sm90_bwd_head_dim(BwdKey("sm90", "bf16", d), split) for d in (136, 192)] == [192, 192]
    assert sm90_bwd_infeasible_reason(BwdKey("sm90", "bf16", 160), split) is None
    assert "block_m" in sm90_bwd_infeasible_reason(BwdKey("sm90", "bf16", 96), Sm90BwdConfig(80, 128, dq_bulk=True,
                                                                                              narrow=True))
    # keys without tuned entries take those of the head dim whose kernels they share: 72-88 96's, 104-120 128's,
    # 136-184 192's, 200-248 256's
    db = tuned.TunedDb("sm90")
    monkeypatch.setattr(tuned, "shipped", lambda arch: db)
    key96 = BwdKey("sm90", "bf16", 96, "none")
    db.record(key96.name, "s>4k", tuned.Entry(cfg.name, 1.0, bwd_tilings.default_config(key96).name, 1.3, "gpu", "drv",
                                              "now", 3))
    for hd, want in ((72, cfg), (88, cfg), (96, cfg), (104, None), (64, None)):
        assert tuned.tuned_config(BwdKey("sm90", "bf16", hd, "none"), "s>4k") == want, hd
    assert tuned.computed_key(BwdKey("sm90", "bf16", 120)).head_dim == 128 and tuned.computed_key(key96) is None
    assert tuned.computed_key(BwdKey("sm90", "bf16", 160)).head_dim == 192  # narrow 192's, none shipped
    assert tuned.computed_key(BwdKey("sm90", "bf16", 200)).head_dim == 256
    (c,) = batches.compile_batch([(BwdKey("sm90", "bf16", 80, "none"), cfg)])
    assert c.error is None, c.error
    assert c.ok, f"{c.entry}: spills or serialised wgmmas"
    assert c.entry.startswith("flash_gen_bwd_sm90_bf16_hd96_none__")
    assert "m64n48k16" in c.result.ptx  # dQ: one wgmma per k-step, not three of N = 16


def test_hopper_backward_bulk_dq(tmp_path, monkeypatch):
    """dq_bulk ("b"): dQ leaves through shared memory as TMA tensor reductions, none element by element; not with
    deterministic dQ; with a split head dim (256) too. decoupled ("d") builds on it."""
    from flash_gen.spec_bwd import BwdKey
    from flash_gen.spec_bwd_sm90 import (Sm90BwdConfig, sm90_bwd_config_from_name, sm90_bwd_infeasible_reason,
                                         sm90_bwd_smem_bytes)

    monkeypatch.setenv("FLASH_GEN_CACHE_DIR", str(tmp_path))
    cfg = Sm90BwdConfig(64, 128, overlap=True, dq_bulk=True)
    assert cfg.name == "wgbm64n128ob" and sm90_bwd_config_from_name(cfg.name) == cfg
    key = BwdKey("sm90", "bf16", 64, "none")
    assert sm90_bwd_infeasible_reason(key, cfg) is None
    assert "deterministic" in sm90_bwd_infeasible_reason(BwdKey("sm90", "bf16", 64, "none", deterministic=True), cfg)
    split = Sm90BwdConfig(64, 64, dq_bulk=True)  # each half of dQ in turn through the dS and P^T buffers
    assert sm90_bwd_infeasible_reason(BwdKey("sm90", "bf16", 256, "none"), split) is None
    # decoupled ("d"): one barrier per step, a second dS tile; bulk dQ and an unsplit head dim only
    decoupled = Sm90BwdConfig(64, 128, overlap=True, dq_bulk=True, decoupled=True)
    assert decoupled.name == "wgbm64n128obd" and sm90_bwd_config_from_name(decoupled.name) == decoupled
    hd128 = BwdKey("sm90", "bf16", 128, "causal")
    assert sm90_bwd_infeasible_reason(hd128, decoupled) is None
    assert sm90_bwd_smem_bytes(hd128, decoupled) == sm90_bwd_smem_bytes(hd128, cfg) + 2 * 64 * 128
    hd256 = BwdKey("sm90", "bf16", 256, "none")
    no_bulk, on_split = Sm90BwdConfig(64, 128, decoupled=True), Sm90BwdConfig(64, 64, dq_bulk=True, decoupled=True)
    for k, c in ((hd128, no_bulk), (hd256, on_split)):
        assert "decoupled" in sm90_bwd_infeasible_reason(k, c)
    # 80-query steps: head dims 72-128 with bulk dQ (dQ^T staged transposed)
    steps80 = Sm90BwdConfig(80, 128, dq_bulk=True)
    assert sm90_bwd_config_from_name("wgbm80n128b") == steps80
    assert sm90_bwd_infeasible_reason(BwdKey("sm90", "bf16", 72, "none"), steps80) is None
    for k, c in ((hd128, Sm90BwdConfig(80, 128)), (key, steps80), (hd256, Sm90BwdConfig(80, 64, dq_bulk=True))):
        assert "block_m" in sm90_bwd_infeasible_reason(k, c)
    (c,) = batches.compile_batch([(key, cfg)])
    assert c.error is None, c.error
    assert c.ok, f"{c.entry}: spills or serialised wgmmas"
    assert "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group" in c.result.ptx
    assert "red.global.add" not in c.result.ptx
    # 80-query steps: one N = 80 wgmma per k-step for S^T, dP^T and dQ^T (CuTe's extended shapes), no spills
    (c,) = batches.compile_batch([(BwdKey("sm90", "bf16", 128, "none"), steps80)])
    assert c.error is None, c.error
    assert c.ok, f"{c.entry}: spills or serialised wgmmas"
    assert "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16" in c.result.ptx
    assert "m64n16k16" not in c.result.ptx
