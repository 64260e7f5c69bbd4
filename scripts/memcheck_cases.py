"""Packed-batch and KV-cache calls with valid and with malformed index tensors, and dense forward + backward calls
at lengths that are not tile multiples, to run under `compute-sanitizer --tool memcheck` (or `--tool racecheck`)
on a GPU (issue 4: offsets and page indices that cannot be checked without a host sync must still never make a
kernel read or write outside its tensors):

    compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 python3 scripts/memcheck_cases.py

(`--sections 1,3` runs a subset: sanitized runs are CPU-bound, so processes over disjoint subsets finish sooner.)

Malformed values give meaningless numbers; only memory safety is checked here (the GPU tests check results).
Uses kernels tests/test_{varlen,kvcache,bwd,fwd,fwd_sm90}_gpu.py and benchmarks/bench_pack_gqa.py use (prebuilt by
scripts/prebuild_gpu_test_kernels.py).
"""

from __future__ import annotations

import argparse

import torch

from flash_gen import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def varlen_cases(head_dim: int = 64) -> int:
    """Packed batches with valid, out-of-range and garbage offsets (head dim 128: the 192-row forward tiles; 72:
    aligned rows, its odd KV head's boxes shifted)."""
    total_q, total_k = 300, 250
    q = torch.randn(total_q, 4, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(total_k, 2, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(total_k, 2, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offsets = [
        ([0, 100, 100, 300], [0, 50, 120, 250]),  # valid, with a zero-length entry
        ([0, 200, 100, 300], [0, 300, 20, 250]),  # decreasing, past the end
        ([-50, 100, 9999, 7], [400, -3, 0, 250]),  # garbage
    ]
    for cu_q, cu_k in offsets:
        for causal in (False, True):
            out = flash_attn_varlen_func(q, k, v, i32(cu_q), i32(cu_k), None, None, causal=causal)
            out.backward(torch.ones_like(out))
    return len(offsets) * 2


def varlen_paged_cases() -> int:
    """flash_attn_varlen_func over pages of 256 rows (on sm90 the Hopper kernel's cache form), with valid and with
    garbage key counts and block-table entries."""
    q = torch.randn(300, 4, 64, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(8, 256, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    tables = (i32([[0, 1], [2, 3], [4, 5]]), i32([[-7, 10**6], [2, 3], [7, -1]]))
    offsets = ([0, 100, 100, 300], [0, 50, 120, 512]), ([-50, 100, 9999, 7], [400, -3, 0, 10**6])
    for table, (cu_q, cu_k) in zip(tables, offsets):
        for causal in (False, True):
            flash_attn_varlen_func(q, k_cache, v_cache, i32(cu_q), i32(cu_k), None, None, causal=causal,
                                   block_table=table)
    return 4


def dense_backward_cases(dropout_p: float = 0.0) -> int:
    """GQA, seqlen_q above and below seqlen_k, single rows, every mask kind (the Hopper backward's keys and the
    portable one's), with dropout when `dropout_p` > 0."""
    cases = [  # head dim, batch, seqlen_q, seqlen_k, heads, KV heads, causal, window, softcap
        (64, 2, 301, 777, 6, 2, False, (-1, -1), 0.0),
        (64, 1, 777, 301, 4, 4, True, (-1, -1), 0.0),
        (128, 2, 130, 513, 4, 1, False, (64, 64), 0.0),
        (128, 3, 1, 1, 2, 2, False, (-1, -1), 0.0),
        (128, 1, 799, 3, 2, 1, True, (-1, -1), 0.0),
        (64, 2, 200, 200, 2, 2, False, (-1, 17), 0.0),
        (96, 2, 301, 513, 4, 2, True, (-1, -1), 0.0),  # the narrow (_h96) default: 64-byte swizzled Q/dO, 16-col dQ
        (72, 1, 257, 129, 4, 2, False, (-1, -1), 0.0),  # forward as 80, backward as 96; KV head 1: rows off sectors
        (256, 2, 301, 777, 4, 2, False, (-1, -1), 0.0),  # split head dim: dQ halves staged in the dS/P^T and Q buffers
        (256, 1, 777, 301, 2, 1, True, (-1, -1), 0.0),
        (192, 2, 211, 300, 4, 2, True, (-1, -1), 30.0),  # split, narrow, softcap: the second P^T buffer
    ]
    for d, b, sq, sk, h, hk, causal, window, softcap in cases:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        out = flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal, window_size=window, softcap=softcap)
        out.backward(torch.randn_like(out))
    return len(cases)


def dropout_backward_tiling_cases() -> int:
    """Dropout through Hopper backward tilings the dropout keys' defaults do not use (tests/test_dropout_gpu.py
    builds them): 80- and 128-query steps, decoupled warpgroups, the split head dim with and without bulk dQ, head
    dims 80 and 96 computed as 96."""
    from flash_gen.bwd_tilings import config_from_name
    from flash_gen.ops import dropout_seed
    from flash_gen.runtime.bwd import attention_bwd
    from flash_gen.runtime.fwd import attention_fwd

    cases = [  # head dim, config, batch, seqlen_q, seqlen_k, heads, KV heads, causal
        (128, "wgbm80n128b", 2, 300, 517, 4, 1, False),
        (128, "wgbm64n128obd", 2, 517, 300, 4, 2, True),
        (80, "wgbm64n128ob_h96", 2, 300, 517, 4, 1, False),  # computed as 96
        (96, "wgbm64n128obd_h96", 2, 517, 300, 4, 2, True),
        (64, "wgbm128n128ob", 2, 777, 555, 8, 8, False),
        (256, "wgbm64n64b", 2, 333, 1200, 2, 1, True),
        (256, "wgbm64n64o", 2, 200, 300, 4, 2, False),
    ]
    for d, name, b, sq, sk, h, hk, causal in cases:
        q, do = (torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        attn = dict(softmax_scale=d**-0.5, causal=causal, window_size=(-1, 0) if causal else (-1, -1), softcap=0.0,
                    alibi_slopes=None, dropout_p=0.2, rng_state=dropout_seed(q, 0.2))
        out, lse = attention_fwd(q, k, v, **attn)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        attention_bwd(do, q, k, v, out, lse, *grads, deterministic=False, config=config_from_name(name), **attn)
    return len(cases)


def _dense_calls(cases: list[tuple]) -> int:
    """flash_attn_func at head dim 128, bf16, per (batch, seqlen_q, seqlen_k, heads, KV heads, causal)."""
    for b, sq, sk, h, hk, causal in cases:
        q = torch.randn(b, sq, h, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, sk, hk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        flash_attn_func(q, k, v, causal=causal)
    return len(cases)


def pack_gqa_cases() -> int:
    """GQA calls with few query positions, which the runtime runs pack-GQA: groups of 8 and 7 (a warpgroup's
    last row unused), causal and not, a single position."""
    return _dense_calls([(2, 37, 700, 16, 2, True), (1, 5, 300, 14, 2, False), (3, 1, 129, 8, 1, True)])


def dense_split_cases() -> int:
    """Dense calls with few query tiles and thousands of keys, which the runtime splits over CTAs (the kernel's
    split form, then the combine): packed GQA with a causal mask, and MHA."""
    return _dense_calls([(2, 1, 3001, 8, 2, True), (1, 3, 2500, 4, 4, False)])


def hopper_tiling_cases() -> int:
    """Hopper forward tilings the defaults do not use (tests/test_fwd_sm90_gpu.py builds them): persistent
    ping-pong CTAs with pack-GQA (the producer's tile slot), clusters sharing K/V by multicast, persistent and
    with an odd number of query tiles per head, head dim 80 computed exactly (16-column boxes), persistent at
    head dim 256 (O staged in the V ring), and head dim 72 with aligned rows."""
    from flash_gen.runtime.fwd import attention_fwd
    from flash_gen.spec_sm90 import sm90_config_from_name

    cases = [  # dtype, head dim, config, batch, seqlen_q, seqlen_k, heads, KV heads, causal, pack
        (torch.bfloat16, 128, "wgm128n128s2p_persist", 3, 1000, 1000, 8, 2, True, True),
        (torch.float16, 64, "wgm192n128s2p_c2_persist", 2, 777, 555, 16, 16, False, False),
        (torch.bfloat16, 128, "wgm128n128s2p_c2", 3, 300, 517, 4, 2, False, False),
        (torch.bfloat16, 80, "wgm192n96s2p_persist", 3, 777, 555, 16, 16, True, False),
        (torch.bfloat16, 256, "wgm128n80s2p_persist", 3, 777, 555, 16, 4, True, False),  # O in the V ring
        # aligned rows: odd KV heads' boxes start 8 columns before the row (negative TMA coordinates), O staged
        # rotated back; persistent, so O's buffer is staged again while the previous tile's stores may read it
        (torch.bfloat16, 72, "wgm192n112s2p_al", 2, 300, 517, 8, 4, False, False),
        (torch.bfloat16, 72, "wgm192n96s4p_al_persist", 2, 777, 555, 16, 16, True, False),
    ]
    for dtype, d, name, b, sq, sk, h, hk, causal, pack in cases:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dtype) for _ in range(2))
        attention_fwd(q, k, v, softmax_scale=d**-0.5, causal=causal, window_size=(-1, 0) if causal else (-1, -1),
                      softcap=0.0, alibi_slopes=None, config=sm90_config_from_name(name), pack_gqa=pack)
    return len(cases)


def kvcache_cases(seqlen_q: int = 4, page_sizes: tuple[int, ...] = (0, 1, 16, 256)) -> int:
    """flash_attn_with_kvcache over contiguous (page 0) and paged caches with valid and garbage lengths, padding,
    entries and pages. 4 query positions (GQA 8/2) are decoding steps (the portable kernel); 70 are chunks, which
    on sm90 run the Hopper kernel's cache form over the contiguous cache and pages of 256 rows."""
    batch, capacity, hk = 3, 700, 2
    q = torch.randn(batch, seqlen_q, 8, 128, device="cuda", dtype=torch.bfloat16)
    k_new = torch.randn(batch, 2, hk, 128, device="cuda", dtype=torch.bfloat16)
    calls = 0
    for page in page_sizes:
        pages = -(-capacity // page) if page else 0
        blocks = batch * pages + 3 if page else batch + 1
        rows = page or capacity
        k_cache = torch.randn(blocks, rows, hk, 128, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(blocks, device="cuda")[: batch * pages].view(batch, pages).to(torch.int32) \
            if page else None
        bad_table = table.clone() if page else None
        if page:
            bad_table[0, 0], bad_table[1, -1] = -7, 10**6
        for seqlens, leftpad, batch_idx, tbl in (
            (i32([5, 400, 698]), None, None, table),  # valid
            (i32([-5, 10**6, 699]), i32([9, -1, 10**6]), None, bad_table),  # garbage lengths, padding, pages
            (i32([1, 2, 3]), None, i32([0, -2, 10**6]) if not page else None, bad_table),
        ):
            for splits in (1, 3):
                flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=seqlens,
                                        cache_leftpad=leftpad if page != 256 else None, cache_batch_idx=batch_idx,
                                        block_table=tbl, causal=True, num_splits=splits)
                calls += 1
    # One int length for every entry of a contiguous cache: read tile by tile with the length as a per-call field
    # (a dense call over the cache's first rows only where the query tiles fill the SMs), split and not.
    k_cache = torch.randn(batch, capacity, hk, 128, device="cuda", dtype=torch.bfloat16)
    for splits in (1, 3):
        flash_attn_with_kvcache(q, k_cache, k_cache.clone(), k_new, k_new, cache_seqlens=capacity - 9, causal=True,
                                num_splits=splits)
        calls += 1
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default="",
                        help="comma list of 1-based sections to run (default: all), so that several sanitizer "
                             "processes can share the sections, each on its own CPU core")
    args = parser.parse_args()
    sections = [varlen_cases, lambda: varlen_cases(128) + varlen_cases(72), dense_backward_cases, pack_gqa_cases, dense_split_cases,
                lambda: dense_backward_cases(dropout_p=0.2), kvcache_cases, lambda: kvcache_cases(70, (0, 256)),
                varlen_paged_cases]
    if torch.cuda.get_device_capability() == (9, 0):
        sections += [hopper_tiling_cases, dropout_backward_tiling_cases]
    chosen = {int(i) for i in args.sections.split(",") if i} or set(range(1, len(sections) + 1))
    n = 0
    for i, section in enumerate(sections):
        if i + 1 not in chosen:
            continue
        n += section()
        torch.cuda.synchronize()
        # progress, so a run stopped by a time limit (sanitized kernels run far slower) shows how far it got
        print(f"memcheck_cases: section {i + 1} of {len(sections)} done ({n} calls)", flush=True)
    print(f"memcheck_cases: {n} calls completed")


if __name__ == "__main__":
    main()
