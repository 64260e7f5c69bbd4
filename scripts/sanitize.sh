#!/usr/bin/env bash
# compute-sanitizer over the project's sanitizer scripts on a GPU machine, in parallel processes: memcheck over
# scripts/memcheck_cases.py split into disjoint section groups (a sanitized process is slow, so groups finish
# sooner on several cores) and racecheck over scripts/racecheck_cases.py beside them. Logs land in $OUT; the
# summaries print last; the exit status is non-zero when any process reported an error or did not finish.
#   usage: scripts/sanitize.sh   env: SECTION_GROUPS (memcheck section groups, space-separated), LIMIT (s per process)
# The carried wheels and a prebuilt kernel cache as scripts/device_check.sh uses them, e.g. in one device call:
#   SKIP_TESTS=1 SKIP_BENCH=1 bash scripts/device_check.sh    # installs .whl/ into /tmp/site
#   PYTHONPATH=/tmp/site:$PWD FLASH_GEN_CACHE_DIR=$PWD/.kernels bash scripts/sanitize.sh
set -uo pipefail
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
pids=() logs=()
for g in ${SECTION_GROUPS:-1,2 3 4,5,9 6 7,8 10,11}; do
  log="$OUT/memcheck_${g//,/_}.log"
  timeout "${LIMIT:-440}" compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 \
    python3 scripts/memcheck_cases.py --sections "$g" > "$log" 2>&1 &
  pids+=($!) logs+=("$log")
done
log="$OUT/racecheck.log"
timeout "${LIMIT:-440}" compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/racecheck_cases.py \
  > "$log" 2>&1 &
pids+=($!) logs+=("$log")
rc=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { rc=1; echo "FAILED or timed out: ${logs[$i]}"; }
done
for log in "${logs[@]}"; do
  echo "== $(basename "$log")"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|calls completed" "$log" | tail -n 3
done
exit $rc
