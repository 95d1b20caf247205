#!/bin/bash
# The issue-15 measurement on one GPU (PERFORMANCE.md, "The rehearsal beside the service, and
# the full run on its cache"), for one or more payload folders side by side (a "before" and an
# "after" in one call, so that their figures are comparable):
#
#   OUT=results bash tools/rehearsal_measure.sh base=/path/to/main/files new=files
#
# Per NAME=DIR (DIR holds moe_bench/): the rehearsal on an empty TRITON_CACHE_DIR (/tmp/tc_NAME)
# with its process's GPU memory sampled every 0.2 s (nvidia-smi --query-compute-apps), then the
# full run on that cache, the cache files it added (comm -13 of before and after), and the memory
# probe (tools/rehearsal_memory_probe.py) of one more rehearsal on the warm cache. Files go to
# $OUT; a summary is printed last.
set -u
OUT=${OUT:-results}; mkdir -p "$OUT"
PROBE=$(dirname "$0")/rehearsal_memory_probe.py
(nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,utilization.gpu,clocks.sm,temperature.gpu --format=csv
 python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
 date -u) > "$OUT/device.txt" 2>&1
for spec in "$@"; do
  name=${spec%%=*}; pkg=${spec#*=}
  export TRITON_CACHE_DIR=/tmp/tc_$name; rm -rf "$TRITON_CACHE_DIR"
  t0=$(date +%s.%N)
  PYTHONPATH=$pkg python3 -m moe_bench --rehearse --preset kimi-k2.6 --backend triton --device cuda:0 \
      --out "$OUT/${name}_rehearsal.json" > "$OUT/${name}_rehearsal.log" 2>&1 &
  pid=$!
  : > "$OUT/${name}_samples.csv"
  while kill -0 $pid 2>/dev/null; do
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | grep "^$pid," >> "$OUT/${name}_samples.csv"
    sleep 0.2
  done
  wait $pid; rc=$?
  t1=$(date +%s.%N)
  awk -F', ' 'BEGIN{m=0} {if ($2>m) m=$2} END{print m}' "$OUT/${name}_samples.csv" > "$OUT/${name}_peak.txt"
  echo "$name rehearsal rc=$rc wall=$(awk "BEGIN{print $t1 - $t0}") s peak=$(cat "$OUT/${name}_peak.txt") MiB"
  find "$TRITON_CACHE_DIR" -type f | sort > "$OUT/${name}_cache_before.txt"
  t0=$(date +%s.%N)
  PYTHONPATH=$pkg python3 -m moe_bench --preset kimi-k2.6 --backend triton --device cuda:0 \
      --out "$OUT/${name}_full.json" > "$OUT/${name}_full.log" 2>&1; rc=$?
  t1=$(date +%s.%N)
  find "$TRITON_CACHE_DIR" -type f | sort > "$OUT/${name}_cache_after.txt"
  comm -13 "$OUT/${name}_cache_before.txt" "$OUT/${name}_cache_after.txt" > "$OUT/${name}_newfiles.txt"
  echo "$name full rc=$rc wall=$(awk "BEGIN{print $t1 - $t0}") s new cache files $(wc -l < "$OUT/${name}_newfiles.txt")"
  PROBE_OUT=$OUT/${name}_probe.json PYTHONPATH=$pkg python3 "$PROBE" --rehearse --preset kimi-k2.6 --backend triton \
      --device cuda:0 --out "$OUT/${name}_probe_rehearsal.json" > "$OUT/${name}_probe.log" 2>&1
  echo "$name probe rc=$?"; grep " s " "$OUT/${name}_probe.log" | tail -40
done
python3 - "$OUT" "$@" <<'PY'
import json, sys
out, names = sys.argv[1], [s.split("=", 1)[0] for s in sys.argv[2:]]
for name in names:
    r = json.load(open(f"{out}/{name}_rehearsal.json"))
    f = json.load(open(f"{out}/{name}_full.json"))
    peak = open(f"{out}/{name}_peak.txt").read().strip()
    new = open(f"{out}/{name}_newfiles.txt").read().split()
    reh = r.get("rehearsal") or {}
    print(f"== {name}: rehearsal {r['status']}, {reh.get('experts')} experts, estimate {reh.get('need_mib')} MiB "
          f"(smallest), peak {peak} MiB, phases {r.get('phases')}")
    print(f"   full run {f['status']}, {len(new)} new cache files, phases {f.get('phases')}")
    print(f"   full checks (m, ok, call_s): {[(c['m'], c['ok'], c['call_s']) for c in f['correctness']]}")
    print(f"   full us: {[(x['m'], x['us']) for x in f['results']]}")
if len(names) > 1:
    base = {x["m"]: x["us"] for x in json.load(open(f"{out}/{names[0]}_full.json"))["results"]}
    for name in names[1:]:
        other = {x["m"]: x["us"] for x in json.load(open(f"{out}/{name}_full.json"))["results"]}
        print(f"full run {name} against {names[0]} per M (%):",
              {m: round(100 * (other[m] / base[m] - 1), 1) for m in base if m in other})
PY
cat "$OUT/device.txt"
