#!/usr/bin/env bash
# Download, into .fa4/ (git-ignored), FlashAttention-4 (flash-attn-4 4.0.0b36, the peer of `flash-gen bench --peers
# fa4`) and the packages a lent GPU machine lacks to run it. Its CUDA 13 library wheel (92 MB) is over the device's
# 64 MiB carry, so its contents are repacked as one xz archive split in two: carry .fa4/first alone in one call, then
# .fa4/second (with .whl) in the next, within the 30 s the machine stays warm; scripts/install_fa4.sh installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
rm -rf .fa4 && mkdir -p .fa4/first .fa4/second
dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any "$@"
}
dl -d .fa4/second flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 \
  einops==0.8.2 protobuf==7.36.2
dl -d "$tmp" nvidia-cutlass-dsl-libs-cu13==4.8.1
mkdir "$tmp/x" && python3 -m zipfile -e "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl "$tmp/x"
tar -cf - -C "$tmp/x" . | xz -9 -T0 > "$tmp/cu13.tar.xz"  # about 64 MB; a few minutes on two cores
head -c 58000000 "$tmp/cu13.tar.xz" > .fa4/first/cu13.part0
tail -c +58000001 "$tmp/cu13.tar.xz" > .fa4/second/cu13.part1
rm -rf "$tmp"
du -sh .fa4/first .fa4/second
