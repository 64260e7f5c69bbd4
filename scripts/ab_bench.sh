#!/usr/bin/env bash
# A/B of a change on a lent GPU machine: `flash-gen bench` from a base tree and from the working tree, alternating
# round by round so that clock and temperature drift hit both alike, then benchmarks/ab_table.py's table.
#   here:  mkdir -p .ab/base && git archive REV flash_gen setup.py pyproject.toml | tar -x -C .ab/base
#          (.ab/ in .git/info/exclude; carry it, with kernel caches for both trees if they were prebuilt)
#   there: scripts/ab_bench.sh .ab/base 2 --direction fwd+bwd --hdim 64,128 --seqlen 2048,8192 --causal both --peers= --repeats 3
#   env: BASE_CACHE, NEW_CACHE: each tree's kernel cache (default FLASH_GEN_CACHE_DIR, else /tmp/flash_gen_cache);
#   OUT: where the records (ab_{base,new}_ROUND.json) and the runs' output (appended to ab.log) go: 2 rounds leave
#   5 files of the 8 a device call brings back. The wheels the machine lacks are expected in /tmp/site
#   (device_check.sh).
set -uo pipefail
base=$(cd "$1" && pwd) || exit 2
rounds=$2
shift 2
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
cache=${FLASH_GEN_CACHE_DIR:-/tmp/flash_gen_cache}
(cd "$base" && python3 setup.py -q build_ext --inplace > /dev/null 2>&1) || echo "base tree: the C launcher did not build"
log=$OUT/ab.log
: > "$log"
for r in $(seq 1 "$rounds"); do
  echo "== base, round $r" >> "$log"
  (cd "$base" && FLASH_GEN_CACHE_DIR=${BASE_CACHE:-$cache} PYTHONPATH=/tmp/site:$base \
    python3 -m flash_gen.cli bench "$@" --json "$OUT/ab_base_$r.json" >> "$log" 2>&1) \
    || echo "base, round $r: failed (see $log)"
  echo "== new, round $r" >> "$log"
  FLASH_GEN_CACHE_DIR=${NEW_CACHE:-$cache} PYTHONPATH=/tmp/site:$PWD \
    python3 -m flash_gen.cli bench "$@" --json "$OUT/ab_new_$r.json" >> "$log" 2>&1 \
    || echo "new, round $r: failed (see $log)"
done
if compgen -G "$OUT/ab_base_*.json" > /dev/null && compgen -G "$OUT/ab_new_*.json" > /dev/null; then
  python3 benchmarks/ab_table.py "$OUT"/ab_base_*.json --new "$OUT"/ab_new_*.json
else
  echo "no records from one of the trees: nothing to compare"
  exit 1
fi
