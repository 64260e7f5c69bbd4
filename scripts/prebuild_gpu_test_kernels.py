"""Compile, on a machine without a GPU, every kernel the GPU tests and the default benchmark will ask for, into
a kernel cache folder that a lent GPU machine then reads, so its minutes go to testing instead of NVRTC.

    python3 scripts/prebuild_gpu_test_kernels.py [--arch sm90] [--out .kernels]
        [--suites fwd,bwd,varlen,kvcache,bench,sm90,dropout]

(--suites bwd limits it to one test module's kernels.) Then carry the folder (device tool: carry [".whl", ".kernels"],
or with --archive .kernels.tar.xz carry [".whl", ".kernels.tar.xz"] when the folder is too big); scripts/device_check.sh points
FLASH_GEN_CACHE_DIR at it. Cache keys cover the NVRTC and header-wheel versions, so on a mismatch the device
simply compiles what it lacks. Kernels are compiled in batches (one translation unit per kernel family, arch and
head dim).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tarfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


DECODE_CONFIGS = ("m64n128w4s2", "m64n64w4s2", "m64n64w4s3")


# `flash-gen bench --configs` tilings of the Hopper kernel beside its defaults (docs/benchmarks.md, issue 7).
SM90_BENCH_CONFIGS = ("wgm128n128s2_persist", "wgm192n128s2p_persist", "wgm128n128s2p_persist",
                      "wgm128n128s2_c2_persist", "wgm192n128s2p_c2", "wgm128n64s2_c2", "wgm128n128s2_c2")


H200_SMS = 132  # the GPU the prebuilt kernels serve (runtime.fwd's dense route for int cache lengths)


def variants(arch: str,
             suites: tuple[str, ...] = ("fwd", "bwd", "varlen", "kvcache", "bench", "sm90", "dropout")) -> set:
    """(key, config) pairs requested by tests/test_{fwd,bwd,varlen,kvcache,dropout}_gpu.py (suites "fwd", "bwd",
    "varlen", "kvcache", "dropout") and by `flash-gen bench`'s default shapes and the benchmarks/ scripts
    ("bench")."""
    import test_bwd_gpu as tb
    import test_fwd_gpu as t
    import test_kvcache_gpu as tk
    import test_varlen_gpu as tv

    from flash_gen import bwd_tilings
    from flash_gen.fwd_tilings import (
        cache_chunk_runs_hopper,
        config_from_name,
        default_config,
        infeasible_reason,
        pack_gqa_pays,
        portable_config,
    )
    from flash_gen.spec import FwdKey
    from flash_gen.spec_bwd import BwdKey
    from flash_gen.validate import derive_mask

    def default(dtype: str, head_dim: int, mask: str, softcap: bool = False, alibi: bool = False,
                varlen: bool = False, kv: str = "dense", split: bool = False, pack: bool = False,
                portable: bool = False, dropout: bool = False) -> tuple:
        """The key's default tiling; `portable`: the portable kernel's (decoding steps over a KV cache)."""
        key = FwdKey(arch, dtype, head_dim, mask, softcap, alibi, varlen, kv, split, pack, dropout)
        return key, portable_config(key) if portable else default_config(key)

    def default_bwd(dtype: str, head_dim: int, mask: str, softcap: bool = False, alibi: bool = False,
                    deterministic: bool = False, varlen: bool = False, dropout: bool = False) -> tuple:
        key = BwdKey(arch, dtype, head_dim, mask, softcap, alibi, varlen, deterministic, dropout)
        return key, bwd_tilings.default_config(key)

    out = set()
    cases = (t.CASES if "fwd" in suites else []) + (tb.CASES if "bwd" in suites else [])
    for c in cases:
        causal, window = t.MASKS[c.mask]
        mask, _ = derive_mask(causal, window, c.seqlen_q, c.seqlen_k)
        key, cfg = default(c.dtype, c.head_dim, mask, c.feature == "softcap", c.feature.startswith("alibi"))
        out.add((key, cfg))
        if pack_gqa_pays(key, c.seqlen_q, c.nheads // c.nheads_k):  # the runtime packs this call
            out.add(default(c.dtype, c.head_dim, mask, c.feature == "softcap", pack=True))
        if isinstance(c, tb.Case):
            out.add(default_bwd(c.dtype, c.head_dim, mask, c.feature == "softcap", c.feature.startswith("alibi"),
                                c.deterministic))
    if "fwd" in suites:  # the split-KV tests of dense calls
        extra = [t.Case("bf16", 128, 1, 8192, 2, 8, 2, "causal"), t.Case("fp16", 64, 5, 300, 2, 4, 4, "causal")]
        for c in t.SPLIT_CASES + extra:
            mask, _ = derive_mask(*t.MASKS[c.mask], c.seqlen_q, c.seqlen_k)
            feats = (c.feature == "softcap", c.feature.startswith("alibi"))
            pack = pack_gqa_pays(FwdKey(arch, c.dtype, c.head_dim, mask, *feats), c.seqlen_q, c.nheads // c.nheads_k)
            out.add(default(c.dtype, c.head_dim, mask, *feats, split=True, pack=pack))
        for mask, pack in itertools.product(("none", "causal", "local"), (False, True)):
            out.add((FwdKey(arch, "bf16", 128, mask, split=True, pack_gqa=pack), config_from_name("m64n64w4s2")))
    if "varlen" in suites:
        for c in tv.CASES:
            causal, window = t.MASKS[c.mask]
            mask, _ = derive_mask(causal, window, sum(c.lens_q), sum(c.lens_k))
            feats = (c.feature == "softcap", c.feature == "alibi")
            key, cfg = default(c.dtype, c.head_dim, mask, *feats, varlen=True)
            if c.sm90_config:
                if arch != "sm90":
                    continue
                cfg = config_from_name(c.sm90_config)
            out.add((key, cfg))
            out.add(default_bwd(c.dtype, c.head_dim, mask, *feats, c.deterministic, varlen=True))
        out.add(default("bf16", 64, "causal", varlen=True))  # the packed-variant and CUDA-graph tests
        out.update(default("bf16", 64, "causal", varlen=True, kv=kv) for kv in ("cache", "paged"))  # block_table
        out.add(default("bf16", 64, "none", varlen=True, kv="cache"))  # memcheck_cases.py's varlen_paged_cases
        out.update(default_bwd("bf16", 64, "causal", deterministic=det, varlen=True) for det in (False, True))
    if "kvcache" in suites:
        extra = [tk.Case(16, seqlen_q=4, splits=s) for s in (1, 2)] + [tk.Case(16, new=1, splits=3)]
        extra += [tk.Case(256, seqlen_q=s, splits=0) for s in (1, 4, 16, 64)]  # the Hopper-or-portable test
        for c in tk.CASES + extra:
            causal, window = t.MASKS[c.mask]
            mask, _ = derive_mask(causal, window, c.seqlen_q, tk.CAPACITY)
            kv = "paged" if c.page and (c.page % 128 or c.leftpad) else "cache"
            pack = c.nheads_k < tk.NHEADS and c.feature != "alibi"
            feats = (c.feature == "softcap", c.feature == "alibi")
            portable = not cache_chunk_runs_hopper(kv, c.seqlen_q, tk.NHEADS // c.nheads_k, pack)
            for split in {c.splits != 1, c.splits > 1}:  # the heuristic (0) may or may not split
                out.add(default(c.dtype, c.head_dim, mask, *feats, kv=kv, split=split, pack=pack, portable=portable))
            dense = tk.BATCH * tk.NHEADS * -(-c.seqlen_q // 128) >= H200_SMS  # query tiles fill the SMs
            if c.int_seqlens and dense and not (c.page or c.batch_idx or c.leftpad):  # served as a dense call
                pack = pack_gqa_pays(FwdKey(arch, c.dtype, c.head_dim, mask, *feats), c.seqlen_q,
                                     tk.NHEADS // c.nheads_k)
                out.add(default(c.dtype, c.head_dim, mask, *feats, split=c.splits > 1, pack=pack))
        out.add(default("bf16", 64, "none"))  # merge_attention_states
    if "decode" in suites:  # benchmarks/bench_decode.py (GQA 32/8, hdim 128) under FLASH_GEN_FWD_CONFIG sweeps
        for mask, kv, split in itertools.product(("none", "causal"), ("cache", "paged"), (False, True)):
            key = FwdKey(arch, "bf16", 128, mask, kv=kv, split=split, pack_gqa=True)
            out.update((key, config_from_name(name)) for name in DECODE_CONFIGS)
    if "bwd" in suites:  # the autograd, determinism, compile, profiler and CUDA-graph tests
        for d in (64, 128):
            out.add(default("bf16", d, "causal"))
            out.update(default_bwd("bf16", d, "causal", deterministic=det) for det in (False, True))
        for dtype, d, mask_name, name in tb.TILINGS:  # test_backward_tilings
            mask = derive_mask(*t.MASKS[mask_name], *tb.TILING_LENS)[0]
            cfg = bwd_tilings.config_from_name(name)
            if bwd_tilings.infeasible_reason(default_bwd(dtype, d, mask)[0], cfg) is None:
                out.add(default(dtype, d, mask))
                out.add((default_bwd(dtype, d, mask)[0], cfg))
    if "sm90" in suites and arch == "sm90":  # tests/test_fwd_sm90_gpu.py and the Hopper kernel's bench tilings
        import test_fwd_sm90_gpu as ts

        for dtype, d, name, mask_name, _, sq, sk, _, _, feature in ts.CASES:
            mask = derive_mask(*t.MASKS[mask_name], sq, sk)[0]
            feats = feature.split("+")
            key = FwdKey(arch, dtype, d, mask, "softcap" in feats, feature.startswith("alibi"),
                         pack_gqa="pack" in feats)
            out.add((key, config_from_name(name)))
        for dtype, d, name, *_ in ts.SK_CASES:
            out.add((FwdKey(arch, dtype, d, "none"), config_from_name(name)))
        for d, mask, name in itertools.product((64, 128, 256), ("none", "causal"), SM90_BENCH_CONFIGS):
            key, cfg = FwdKey(arch, "bf16", d, mask), config_from_name(name)
            if infeasible_reason(key, cfg) is None:
                out.add((key, cfg))
    if "fwd" in suites:
        for head_dim, names in t.CONFIGS.items():
            for name in names:
                for mask in ("none", "causal"):
                    out.add((FwdKey(arch, "bf16", head_dim, mask), config_from_name(name)))
        for name, mask in itertools.product(t.PACKED_CONFIGS, ("none", "causal", "local")):
            out.add((FwdKey(arch, "bf16", 64, mask, pack_gqa=True), config_from_name(name)))
        for dtype in ("fp16", "bf16"):  # the packed-qkv, API and requires_grad tests
            out.update(default(dtype, 64, mask) for mask in ("none", "causal"))
    if "bench" in suites:  # flash-gen bench's defaults and benchmarks/bench_varlen.py's
        for d in (64, 128, 256):
            for mask in ("none", "causal"):
                out.update((default("bf16", d, mask), default_bwd("bf16", d, mask)))
        for mask in ("none", "causal"):
            out.update((default("bf16", 128, mask, varlen=True), default_bwd("bf16", 128, mask, varlen=True)))
            out.update(default("bf16", 128, mask, kv=kv, split=split, pack=True, portable=True)
                       for kv in ("cache", "paged") for split in (False, True))  # benchmarks/bench_decode.py (GQA 32/8)
            out.add(default("bf16", 128, mask, pack=True))  # benchmarks/bench_pack_gqa.py, memcheck_cases.py
        # benchmarks/bench_kvcache_chunks.py: the Hopper kernel's cache form (GQA 32/8, no mask)
        out.update(default("bf16", 128, "none", kv="cache", split=split, pack=True) for split in (False, True))
        # benchmarks/bench_dense_split.py: split dense calls, MHA and packed
        out.update(default("bf16", 128, "none", split=True, pack=pack) for pack in (False, True))
    if "dropout" in suites:  # tests/test_dropout_gpu.py
        import test_dropout_gpu as td

        forced = [(c, config_from_name(name)) for c, name in td.FWD_TILINGS]
        forced_bwd = [(c, bwd_tilings.config_from_name(name)) for c, name in td.BWD_TILINGS]
        for c, cfg, bwd_cfg in [(c, None, None) for c in td.CASES] + [(c, f, None) for c, f in forced] + [
                (c, None, b) for c, b in forced_bwd]:
            mask, _ = derive_mask(*t.MASKS[c.mask], c.seqlen_q, c.seqlen_k)
            feats = (c.feature == "softcap", c.feature.startswith("alibi"))
            key, default_cfg = default(c.dtype, c.head_dim, mask, *feats, dropout=True)
            if cfg is None or infeasible_reason(key, cfg) is None:
                out.add((key, cfg or default_cfg))
            bwd_key, default_bwd_cfg = default_bwd(c.dtype, c.head_dim, mask, *feats, c.deterministic, dropout=True)
            if bwd_cfg is None or bwd_tilings.infeasible_reason(bwd_key, bwd_cfg) is None:
                out.add((bwd_key, bwd_cfg or default_bwd_cfg))
        for mask in ("none", "causal"):  # the packed-batch tests
            out.add(default("bf16", 64, mask, varlen=True, dropout=True))
            out.add(default_bwd("bf16", 64, mask, varlen=True, dropout=True))
        out.add(default("bf16", 64, "causal", dropout=True))  # the API, torch.compile and CUDA-graph tests
        out.add(default_bwd("bf16", 64, "causal", dropout=True))
        out.update(default("fp16", 128, "none", varlen=True, dropout=d) for d in (False, True))  # the varlen API
        for d, mask in itertools.product((64, 128, 256), ("none", "causal")):  # flash-gen bench --dropout
            out.update((default("bf16", d, mask, dropout=True), default_bwd("bf16", d, mask, dropout=True)))
    # Tilings the shipped tuning database picks for keys the suites use (the runtime prefers them), their own
    # entries or every tiling derived from the head dim they compute (the runtime takes the first without spills).
    from flash_gen import tuned
    from flash_gen.spec import BUCKETS

    for key in {key for key, _ in out}:
        direction = "bwd" if isinstance(key, BwdKey) else "fwd"
        out.update((key, cfg) for bucket, _ in BUCKETS[direction] for cfg in tuned.tuned_configs(key, bucket))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm90")
    # FLASH_GEN_CACHE_DIR when set, so a second tree (a branch's git archive) fills the same folder.
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("FLASH_GEN_CACHE_DIR", ROOT / ".kernels")))
    parser.add_argument("--suites", default="fwd,bwd,varlen,kvcache,bench,sm90,dropout",
                        help="comma list of fwd, bwd, varlen, kvcache, bench, sm90 (Hopper kernel), dropout, decode "
                        "(tiling sweep)")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--prune", action="store_true",
                        help="only delete cache entries this plan does not use (stale after header changes), "
                             "so the folder stays small enough to carry")
    parser.add_argument("--archive", type=Path, default=None,
                        help="also write the folder as this .tar.xz (about 15x smaller: cubins compress well), "
                             "for a device carry limit the folder outgrows; scripts/device_check.sh unpacks it")
    args = parser.parse_args()
    os.environ["FLASH_GEN_CACHE_DIR"] = str(args.out.resolve())  # inherited by the worker processes

    from flash_gen.build import cache, spill_free
    from flash_gen.gen.render import entry_name, render_many

    # The plan: the suites' variants, plus the fallback of each cached default that spills (the runtime runs that
    # one instead, flash_gen.build.spill_free); compile_resolved adds those of the kernels compiled below.
    plan, missing = [], []
    pending = sorted(variants(args.arch, tuple(args.suites.split(","))), key=lambda v: (v[0].name, v[1].name))
    while pending:
        hits = [(v, cache.lookup(render_many([v]), entry_name(*v), args.arch)) for v in pending]
        plan += pending
        missing += [v for v, hit in hits if hit is None]
        pending = spill_free.fallbacks(v for v, hit in hits if hit is not None and hit[1]["spills"])
    if args.prune:
        keep = {cache.cache_key(render_many([v]), entry_name(*v), args.arch) for v in plan}
        for meta in (args.out / args.arch).glob("*/*.json"):  # a kept kernel may share another's cubin file
            if meta.stem in keep:
                keep.add(Path(json.loads(meta.read_text()).get("cubin_file", meta.name)).stem)
        stale = [f for f in (args.out / args.arch).glob("*/*") if f.stem not in keep]
        for f in stale:
            f.unlink()
        print(f"pruned {len(stale)} files; {len(keep)} kernels planned")
        return 0
    print(f"{len(plan) - len(missing)} kernels already in {args.out}; {len(missing)} to compile", flush=True)
    start = time.perf_counter()
    failed = 0

    def report(batch: list) -> None:
        nonlocal failed
        for c in batch:
            if c.result is None:
                failed += 1
                print(f"  {c.entry}: {(c.error or '').splitlines()[0]}", flush=True)
            elif c.result.spills:  # kept: the tests check spilling tilings too (e.g. _qreg)
                print(f"  {c.entry}: spills {c.result.spill_stores} bytes", flush=True)
            if c.result is not None and c.result.wgmma_serialized:  # ptxas C7515: every wgmma waited for at once
                print(f"  {c.entry}: wgmma serialized", flush=True)
        print(f"  batch of {len(batch)} ({batch[0].key.name}...) in {batch[0].seconds:.0f} s", flush=True)

    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        spill_free.compile_resolved(missing, args.jobs, pool, on_batch=report)
    print(f"done in {time.perf_counter() - start:.0f} s, {failed} failed")
    if args.archive:
        with tarfile.open(args.archive, "w:xz") as tar:
            tar.add(args.out, arcname=".kernels")
        print(f"wrote {args.archive} ({args.archive.stat().st_size / 2**20:.1f} MiB)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
