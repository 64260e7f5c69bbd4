"""The `flash-gen` command: `compile` (render + NVRTC, the ptxas report), `bench` (flash_gen.bench), `cache`.

Owns argument parsing and the compile report. Each subcommand imports the compiler, the cache or rich when it
runs; compile workers are separate processes (NVRTC is CPU-bound and serialises compiles within a process), each
compiling a batch of variants as one translation unit.
Imports optuna only for `tune`.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from flash_gen import bwd_tilings, fwd_tilings, spec, spec_bwd
from flash_gen.build import spill_free
from flash_gen.build.batches import Compiled, compile_batch, plan_batches  # noqa: F401  (re-exported)


def _csv(cast: Callable[[str], Any], allowed: Sequence[Any]) -> Callable[[str], tuple]:
    """argparse type for a comma list whose items must be in `allowed`."""

    def parse(text: str) -> tuple:
        items = tuple(cast(x) for x in text.split(",") if x)
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(map(str, allowed))}")
        return items

    return parse


def _window(text: str) -> tuple[int, int]:
    """argparse type for LEFT,RIGHT window sizes (flash_attn's window_size, -1 unbounded)."""
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: two integers LEFT,RIGHT") from None
    if left < -1 or right < -1:
        raise argparse.ArgumentTypeError(f"{text!r}: each side -1 (unbounded) or at least 0")
    return left, right


def _variants(args: argparse.Namespace) -> list[tuple]:
    """Selected keys (forward and/or backward) x (their default config, or each --configs tiling of that
    direction that is feasible for the key)."""
    out = []
    for arch, dtype, hdim, mask in itertools.product(args.arch, args.dtype, args.hdim, args.mask):
        fwd = spec.FwdKey(arch, dtype, hdim, mask, args.softcap, args.alibi, args.varlen, args.kv, args.split,
                          args.pack_gqa)
        if "fwd" in args.direction:
            out += _with_configs(fwd, fwd_tilings.default_config, fwd_tilings.config_from_name,
                                 fwd_tilings.infeasible_reason, args)
        if "bwd" in args.direction and args.kv == "dense":  # KV-cache kernels are forward-only
            bwd = spec_bwd.BwdKey(arch, dtype, hdim, mask, args.softcap, args.alibi, args.varlen, args.deterministic)
            out += _with_configs(bwd, bwd_tilings.default_config, bwd_tilings.config_from_name,
                                 bwd_tilings.infeasible_reason, args)
    return out


def _with_configs(key, default, from_name, infeasible, args: argparse.Namespace) -> list[tuple]:
    if not args.configs:
        return [(key, default(key))]
    out = []
    for name in args.configs:
        try:
            cfg = from_name(name)
        except ValueError:  # a tiling of the other direction
            continue
        if infeasible(key, cfg) is None:
            out.append((key, cfg))
    return out


def _config_name(text: str) -> str:
    """A forward (either family) or backward config name, checked."""
    try:
        return fwd_tilings.config_from_name(text).name
    except ValueError:
        return bwd_tilings.config_from_name(text).name


def _cmd_compile(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    variants = _variants(args)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        if args.configs:
            batches = plan_batches(variants, args.jobs)
            jobs = track(pool.map(compile_batch, batches), total=len(batches), description="compiling", transient=True)
            done = [c for batch in jobs for c in batch]
        else:  # each default that spills is followed by its fallback tiling, as the runtime would run it
            done = spill_free.compile_resolved(variants, args.jobs, pool)
    # Without --configs a key's last compile is what the runtime runs; the spilling ones before it are replaced.
    runs = {id(c) for c in ({c.key: c for c in done}.values() if not args.configs else done)}

    table = Table(title=f"{len(done)} kernels ({'chosen' if args.configs else 'default'} configs)")
    for col in ("kernel", "config", "regs", "spill st", "spill ld", "stack", "smem static+dyn", "batch s", "status"):
        table.add_column(col, justify="left" if col in ("kernel", "config", "status") else "right")
    for c in done:
        r = c.result
        status = ("[green]ok" if c.ok else "[red]FAILED" if r is None else "[yellow]spills: fell back"
                  if id(c) not in runs else "[red]spills" if r.spills else "[red]wgmma serialized")
        nums = ("-",) * 5 if r is None else (
            r.registers, r.spill_stores, r.spill_loads, r.stack_frame, f"{r.static_smem}+{_smem(c.key, c.cfg)}"
        )
        table.add_row(c.key.name, c.cfg.name, *map(str, nums), f"{c.seconds:.1f}", status)
    console = Console(width=None if sys.stdout.isatty() else 160)  # logs get the whole table, not 80 columns
    console.print(table)
    for error in dict.fromkeys(c.error for c in done if c.error):  # a failed batch reports once
        entries = ", ".join(c.entry for c in done if c.error == error)
        console.print(f"[red]{entries}[/red]: " + "\n".join(error.splitlines()[:20]), markup=True, highlight=False)

    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for c in done:
            if c.source is not None:
                (args.out / f"{c.entry}.cu").write_text(c.source)
            if c.result is not None:
                (args.out / f"{c.entry}.ptx").write_text(c.result.ptx)
                (args.out / f"{c.entry}.cubin").write_bytes(c.result.cubin)
        console.print(f"wrote sources, PTX and cubins to {args.out}")
    bad = sum(not c.ok for c in done if id(c) in runs)
    if bad:
        console.print(f"[red]{bad} of {len(runs)} kernels failed to compile, spilled or had their wgmmas serialized")
    return 1 if bad else 0


def _smem(key, cfg) -> int:
    if isinstance(key, spec_bwd.BwdKey):
        return bwd_tilings.smem_bytes(key, cfg)
    return fwd_tilings.smem_bytes(key, cfg)


def _cmd_bench(args: argparse.Namespace) -> int:
    from flash_gen import bench

    return bench.run(args)


def _cmd_tune(args: argparse.Namespace) -> int:
    from flash_gen.search import tune

    return tune.run(args)


def _cmd_build(args: argparse.Namespace) -> int:
    from flash_gen.build import make_library

    start = time.perf_counter()
    compiled, kept = make_library.build(args.arch, args.out, args.jobs)
    print(f"library {args.out}: {compiled} kernels compiled, {kept} unchanged, in {time.perf_counter() - start:.0f} s"
          f" (FLASH_GEN_LIBRARY={args.out} makes the loader use it)")
    if args.wheel:
        for arch in args.arch:
            print(f"wrote {make_library.pack_wheel(args.out, arch, args.out / 'wheels')}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    """What the libraries (FLASH_GEN_LIBRARY, installed wheels) and the kernel cache hold, per arch."""
    from flash_gen.build import cache, library

    for arch in args.arch:
        for lib in library.installed(arch):
            recs = [r for (a, _), r in lib.records.items() if a == arch]
            print(f"{arch}: library {lib.root}: {len(recs)} kernels")
            for r in sorted(recs, key=lambda r: r.entry):
                print(f"  {r.key or r.entry:58s} {r.config:20s} regs={r.registers} spills={r.spills} smem={r.smem}")
    for arch, count in cache.info()["entries"].items():
        if arch in args.arch:
            print(f"{arch}: cache {cache.info()['dir']}: {count} kernels")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    """A kernel key's default and tuned tilings, and what the library holds for it."""
    from flash_gen import tuned
    from flash_gen.build import library
    from flash_gen.gen import render

    key = spec_bwd.bwd_key_from_name(args.key) if args.key.startswith("bwd") else spec.key_from_name(args.key)
    chain = spill_free.chain(key)
    default = chain[0]
    smem = _smem(key, default)
    print(f"{key.name}: default tiling {default.name} ({default.num_threads} threads, {smem} B shared memory)")
    if len(chain) > 1:
        print(f"  where it spills, the first that does not of: {', '.join(c.name for c in chain[1:])}")
    entries = tuned.shipped(key.arch).entries
    own = entries.get(key.name, {})
    computed = tuned.computed_key(key)
    borrowed = {b: e for b, e in entries.get(computed.name, {}).items() if b not in own} if computed else {}
    for bucket, e in sorted({**own, **borrowed}.items()):
        source = f" (head dim {computed.head_dim}'s entry)" if bucket in borrowed else ""
        stale = "" if tuned.tuned_config(key, bucket) else f" (stale: tuned against {e.default_config}, unused)"
        print(f"  tuned {bucket}: {e.config}{source}{stale} {e.ms:.3f} ms vs default {e.default_ms:.3f} ms "
              f"({e.speedup:.2f}x) on {e.gpu}, {e.date}")
    tilings = bwd_tilings if isinstance(key, spec_bwd.BwdKey) else fwd_tilings
    for lib in library.installed(key.arch):
        for r in lib.records.values():  # the kernels that would serve this key (render.kernel_key)
            if r.key in (key.name, computed and computed.name) and \
                    r.entry == render.entry_name(key, tilings.config_from_name(r.config)):
                print(f"  library {lib.root}: {r.config} registers={r.registers} spills={r.spills} smem={r.smem} "
                      f"threads={r.threads}")
    return 0


def _cmd_cache(args: argparse.Namespace) -> int:
    from flash_gen.build import cache

    if args.action == "clear":
        cache.clear()
        print("cache cleared")
    else:
        for name, value in cache.info().items():
            print(f"{name}: {value}")
    return 0


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The `flash-gen bench` options, declared here so building the parser never imports torch (flash_gen.bench
    maps the names and validates the peers)."""
    ints = lambda text: tuple(int(x) for x in text.split(",") if x)  # noqa: E731
    names = lambda text: tuple(x for x in text.split(",") if x)  # noqa: E731
    parser.add_argument("--hdim", type=ints, default=(64, 128, 256), help="head dims (comma list)")
    parser.add_argument("--seqlen", type=ints, default=(1024, 2048, 4096, 8192, 16384), help="comma list")
    parser.add_argument("--causal", choices=("both", "no", "yes"), default="both")
    parser.add_argument("--direction", choices=("fwd", "fwd+bwd"), default="fwd",
                        help="time the forward, or forward + backward through autograd (FLOPs: 3.5x forward)")
    parser.add_argument("--dtype", choices=spec.DTYPES, default="bf16")
    parser.add_argument("--total-tokens", type=int, default=32768, help="batch = total_tokens / seqlen")
    parser.add_argument("--model-dim", type=int, default=2048, help="nheads = model_dim / hdim")
    parser.add_argument("--nheads", type=int, default=0,
                        help="heads of every shape instead of model_dim / hdim (16: shared/ANCHORS.md's vision shapes)")
    parser.add_argument("--peers", type=names, default=("flash", "cudnn"),
                        help="peers to compare with (comma list): flash and cudnn (torch SDPA's backends), fa4 "
                        "(FlashAttention-4, where the flash-attn-4 package is installed)")
    parser.add_argument("--configs", type=names, default=(),
                        help="also time flash_gen forced to these tilings, as fg:NAME columns: forward tilings "
                        "(FwdConfig names, e.g. m128n64w4s2) with --direction fwd, backward tilings (BwdConfig names, "
                        "e.g. m64n128w8a242s2) with fwd+bwd")
    parser.add_argument("--softcap", type=float, default=0.0,
                        help="flash_gen's softcap (SDPA has none: run with --peers= to time flash_gen alone)")
    parser.add_argument("--window", type=_window, default=(-1, -1), metavar="LEFT,RIGHT",
                        help="flash_gen's local window, flash_attn's window_size (-1: unbounded; with causal the "
                        "right side is 0); FLOPs count the visible pairs. SDPA has none: run with --peers=")
    parser.add_argument("--dropout", type=float, default=0.0, metavar="P",
                        help="dropout_p of every implementation (training: SDPA's FLASH and CUDNN backends take it, "
                        "FA4 does not); no output check then, as each draws its own mask")
    parser.add_argument("--json", default="bench_fwd.json", help="write every number here (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per cell, interleaved; the median is kept")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flash-gen", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compile", help="render and compile kernels with NVRTC; print registers, spills, smem")
    p.add_argument("--arch", type=_csv(str, spec.ARCHS), default=spec.ARCHS, help="comma list (default: all)")
    p.add_argument("--hdim", type=_csv(int, spec.HEAD_DIMS), default=(64, 128), help="comma list (default: 64,128)")
    p.add_argument("--dtype", type=_csv(str, spec.DTYPES), default=("bf16", "fp16"), help="comma list")
    p.add_argument("--mask", type=_csv(str, spec.MASKS), default=spec.MASKS, help="comma list (default: all)")
    p.add_argument("--softcap", action="store_true", help="compile the softcap variants")
    p.add_argument("--alibi", action="store_true", help="compile the ALiBi variants")
    p.add_argument("--varlen", action="store_true", help="compile the packed ragged-batch (cu_seqlens) variants")
    p.add_argument("--kv", default="dense", choices=spec.KV_LAYOUTS, help="K/V layout: dense, KV cache, paged cache")
    p.add_argument("--split", action="store_true", help="split-KV variants (KV-cache kernels)")
    p.add_argument("--pack-gqa", action="store_true", help="pack-GQA variants (KV-cache kernels)")
    p.add_argument("--direction", type=_csv(str, ("fwd", "bwd")), default=("fwd",),
                   help="fwd, bwd or fwd,bwd (default: fwd)")
    p.add_argument("--deterministic", action="store_true", help="backward kernels with ordered dQ accumulation")
    p.add_argument(
        "--configs",
        type=lambda text: tuple(_config_name(c) for c in text.split(",") if c),
        default=(),
        help="tilings to compile instead of the defaults (FwdConfig names like m128n64w4s2, Hopper forward names "
        "like wgm128n128s2, BwdConfig names like m64n128w8a242s2, each applied to its direction); infeasible ones "
        "skipped",
    )
    p.add_argument("--out", type=Path, help="write <kernel>.cu, .ptx and .cubin here (PTX and cubin hold the whole "
                   "batch the kernel was compiled in)")
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles (default: cores)")
    p.set_defaults(func=_cmd_compile)

    p = sub.add_parser("bench", help="forward or fwd+bwd TFLOP/s against SDPA's FA2 and cuDNN backends (GPU)")
    _add_bench_arguments(p)
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("tune", help="search each family's tiling space on this GPU; write flash_gen/tuned/<arch>.json")
    p.add_argument("--arch", type=_csv(str, spec.ARCHS), default=("sm90",), help="the GPU's arch (default: sm90)")
    p.add_argument("--hdim", type=_csv(int, spec.HEAD_DIMS), default=(64, 128), help="comma list (default: 64,128)")
    p.add_argument("--dtype", type=_csv(str, spec.DTYPES), default=("bf16",), help="comma list (default: bf16)")
    p.add_argument("--mask", type=_csv(str, spec.MASKS), default=("none", "causal"), help="comma list")
    p.add_argument("--direction", type=_csv(str, ("fwd", "bwd", "decode")), default=("fwd",),
                   help="comma list of fwd, bwd, decode (default: fwd)")
    p.add_argument("--bucket", type=lambda t: tuple(x for x in t.split(",") if x), default=(),
                   help="comma list of sequence-length buckets to tune, e.g. 's<=1k,s>4k' (default: all; the "
                   "database keeps the others' entries)")
    p.add_argument("--dropout", type=float, default=0.0, metavar="P",
                   help="tune the dropout keys (fwd, bwd), measured at dropout_p P (default 0: the keys without)")
    p.add_argument("--trials", type=int, default=40, help="completed trials per family and bucket (default: 40)")
    p.add_argument("--time-budget", type=float, default=0.0, help="minutes per family (0: no limit)")
    p.add_argument("--storage", default=None, help="Optuna RDB URL (default: SQLite in the kernel cache folder; "
                   "postgresql://... to share studies between processes and hosts)")
    p.add_argument("--study", default="flash-gen", help="study name prefix (resume by reusing it)")
    p.add_argument("--devices", type=lambda t: tuple(int(x) for x in t.split(",") if x), default=(0,),
                   help="GPUs, one worker process each (default: 0)")
    p.add_argument("--database", type=Path, default=None, help="tuning database to update (default: "
                   "flash_gen/tuned/<arch>.json)")
    p.add_argument("--seed", type=int, default=None, help="sampler seed")
    p.add_argument("--candidates", type=lambda t: tuple(x for x in t.split(",") if x), default=(),
                   help="comma list of tilings each bucket measures first (after the database's own), e.g. a "
                   "bench --configs find; infeasible ones and other templates' are skipped")
    p.add_argument("-j", "--jobs", type=int, default=0, help="compile workers (default: cores)")
    p.add_argument("--dry-run", action="store_true", help="print each family's space size and buckets; no GPU")
    p.add_argument("--precompile", action="store_true", help="compile each family's whole space (what passes the "
                   "static model) into the kernel cache, batched, and stop; no GPU. A tune then only measures")
    p.add_argument("--verify", action="store_true", help="re-measure the database's entries for these families "
                   "(tuned config and default on each bucket shape) and stop; writes nothing")
    p.add_argument("--no-collect", action="store_true", help=argparse.SUPPRESS)  # per-GPU worker processes
    p.set_defaults(func=_cmd_tune)

    p = sub.add_parser("build", help="compile the kernel library (tuned variants + defaults) into a folder; no GPU")
    p.add_argument("--arch", type=_csv(str, spec.ARCHS), default=spec.ARCHS, help="comma list (default: all)")
    p.add_argument("--out", type=Path, default=Path("build/flash_gen_library"), help="library folder (default: "
                   "%(default)s); rebuilt incrementally")
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles (default: cores)")
    p.add_argument("--wheel", action="store_true", help="also pack each arch into an installable wheel, "
                   "flash_gen_kernels_<arch>, under OUT/wheels (the loader finds it once installed)")
    p.set_defaults(func=_cmd_build)

    p = sub.add_parser("list", help="what the kernel libraries and the cache hold, per arch")
    p.add_argument("--arch", type=_csv(str, spec.ARCHS), default=spec.ARCHS, help="comma list (default: all)")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("info", help="a kernel key's tilings: default, tuned, and in the library")
    p.add_argument("key", help="a key name, e.g. fwd_sm90_bf16_hd128_causal or bwd_sm90_bf16_hd64_none")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("cache", help="inspect or clear the compiled-kernel cache")
    p.add_argument("action", choices=("info", "clear"))
    p.set_defaults(func=_cmd_cache)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `flash-gen` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.argv = argv  # `tune --devices` restarts itself once per GPU with the same arguments
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
