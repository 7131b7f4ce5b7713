#!/bin/bash
# What docs/explore.md reports: on a many-core box, each gate run pinned to two cores of its own (an
# idle 2-core runner each), the default gate on Correct with and without exploration, and the
# exploration specimen at several seeds (WAVE=1), upstream opacus with --expect (WAVE=2). Needs opacus
# importable (PYTHONPATH) and writes to $OUT.
# measurement on the device box: every job pinned to its own 2 cores (an idle 2-core runner each)
[ -d .whl ] && { python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 9; }
OUT=${OUT:-/tmp/explore_catch}; mkdir -p $OUT
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DPFSDP_HYPOTHESIS_PROFILE=ci
python3 -c "import torch, opacus, hypothesis; print('torch', torch.__version__, 'opacus', opacus.__version__)" || exit 8
command -v taskset || { echo no taskset; exit 7; }
G="python3 -m dpfsdp_verify run"
job() { # name cores args...
  local name=$1 cores=$2; shift 2
  ( s=$(date +%s.%N); taskset -c $cores $G "$@" -q --json $OUT/$name.json > $OUT/$name.log 2>&1; rc=$?
    echo "$name rc=$rc wall=$(echo "$(date +%s.%N) - $s" | bc)" >> $OUT/summary.txt ) &
}
W=${WAVE:-1}
if [ "$W" = 1 ]; then
job correct_fixed 0,1 --target fixtures.specimens:Correct --seed 1 --explore 0
job correct_default 2,3 --target fixtures.specimens:Correct --seed 1
job spec_fixed 4,5 --target fixtures.explore_specimens:UnclippedRowsFrom40 --properties clipped_step --seed 1 --explore 0
for s in 1 2 3 4 5; do c=$((4 + 2*s)); job spec_s$s $c,$((c+1)) --target fixtures.explore_specimens:UnclippedRowsFrom40 --properties clipped_step --seed $s; done
wait
fi
if [ "$W" = 2 ]; then
for s in 1 2 3 4; do c=$((2*s - 2)); job upstream_s$s $c,$((c+1)) --target opacus --expect opacus-1.6.0 --properties clipped_step --seed $s; done
for s in 6 7 8 9; do c=$((2*s - 4)); job spec_s$s $c,$((c+1)) --target fixtures.explore_specimens:UnclippedRowsFrom40 --properties clipped_step --seed $s; done
wait
fi
cat $OUT/summary.txt
for f in $OUT/*.json; do python3 - "$f" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
tot = sum(v["seconds"] for v in r["results"])
ex = [v for v in r["results"] if "explore" in v["config"]]
print(sys.argv[1].split("/")[-1], r["exit_code"], r["summary"], "sum_seconds=%.1f" % tot,
      [(v["property"], v["status"], v["diagnosis"], v["config"]["explore"].get("draws"), v["seconds"]) for v in ex])
for v in ex:
    if v["status"] != "pass":
        print("   ", v["message"][:400]); print("   ", v["repro"])
PY
done
