#!/usr/bin/env bash
# Time hand-picked forward tilings against the defaults and SDPA's FLASH/CUDNN backends on a GPU machine:
# compile them all in parallel first (into the shared kernel cache), then bench. The config lists match
# tests/test_fwd_gpu.py::CONFIGS, which checks the same kernels for correctness.
#   usage: benchmarks/sweep_fwd_configs.sh [seqlens]       (default 2048,8192)
set -uo pipefail
seqlens=${1:-2048,8192}
declare -A CONFIGS=(
  [64]=m128n64w4s1,m128n64w4s2,m128n128w8s1,m64n64w4s1,m128n64w8s1,m128n64w4s1_qreg
  [128]=m128n32w4s1,m128n32w4s2,m64n64w4s1,m64n64w4s2,m128n64w8s1,m128n64w8s2
  [256]=m64n64w4s1,m64n32w4s1,m128n32w8s1,m128n64w8s2,m64n64w4s2
)
for d in 64 128 256; do
  python3 -m flash_gen.cli compile --arch sm90 --dtype bf16 --hdim "$d" --mask none,causal \
    --configs "${CONFIGS[$d]}" -j "$(( $(nproc) / 3 + 1 ))" | tail -n 20 &
done
wait
for d in 64 128 256; do
  python3 -m flash_gen.cli bench --hdim "$d" --seqlen "$seqlens" --causal both --configs "${CONFIGS[$d]}" \
    --json "${OUT:-.}/sweep_hd$d.json"
done
