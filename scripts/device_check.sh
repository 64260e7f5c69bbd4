#!/usr/bin/env bash
# One call on a lent GPU machine: install carried wheels, run the GPU tests in parallel workers (each JIT-
# compiles what it needs into one shared cache, so the 16 cores compile while the GPU tests), then the forward
# benchmark against SDPA's FLASH and CUDNN backends. Full logs land in $OUT; the tables print last.
# A carried .kernels/ (scripts/prebuild_gpu_test_kernels.py, run on a CPU machine) serves as the kernel cache,
# so the device compiles only what it lacks; a carried .kernels.tar.xz (its --archive) is unpacked into it first.
#   usage: scripts/device_check.sh [pytest args...]
#   env: TESTS (default tests/), JOBS, TEST_TIMEOUT, SKIP_TESTS, SKIP_BENCH, BENCH_ARGS (default: the forward
#   table), BENCH2_ARGS (a second bench run, e.g. "--direction fwd+bwd ...")
set -uo pipefail
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
[ -f .kernels.tar.xz ] && tar -xJf .kernels.tar.xz
default_cache=/tmp/flash_gen_cache
[ -d .kernels ] && default_cache=$PWD/.kernels
export PYTHONUNBUFFERED=1 FLASH_GEN_CACHE_DIR=${FLASH_GEN_CACHE_DIR:-$default_cache}
if compgen -G ".whl/*.whl" >/dev/null; then  # packages the machine lacks (CUTLASS headers, CCCL 13.0)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# The per-call C launcher (an ignored build output, so it does not travel): without it the launches go through ctypes
# and tests/test_build.py's launcher test fails.
python3 setup.py -q build_ext --inplace >/tmp/build_ext.log 2>&1 || { echo "the C launcher did not build:"; tail -n 5 /tmp/build_ext.log; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/device.txt"
rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -m gpu -q -n "${JOBS:-16}" -p no:cacheprovider "$@" ${TESTS:-tests/} \
    >"$OUT/pytest.log" 2>&1 || rc=$?
  grep -E "passed|failed|error" "$OUT/pytest.log" | tail -n 40
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  python3 -m flash_gen.cli bench ${BENCH_ARGS:---hdim 64,128,256 --seqlen 1024,2048,4096,8192,16384 --causal both} \
    --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -n 45
  if [ -n "${BENCH2_ARGS:-}" ]; then
    python3 -m flash_gen.cli bench $BENCH2_ARGS --json "$OUT/bench2.json" 2>&1 | tee "$OUT/bench2.log" | tail -n 45
  fi
fi
# ptxas report of every kernel compiled in this call (registers, spills), from the cache's metadata.
python3 - "$FLASH_GEN_CACHE_DIR" <<'PY' | tee "$OUT/ptxas.txt" | tail -n 30
import json, pathlib, sys
rows = [json.loads(p.read_text()) for p in pathlib.Path(sys.argv[1]).glob("*/*/*.json")]
for m in sorted(rows, key=lambda m: m.get("entry", "")):
    print(f"{m.get('entry','?'):70s} regs={m.get('registers')} spill_st={m.get('spill_stores')} spill_ld={m.get('spill_loads')}")
PY
exit $rc
