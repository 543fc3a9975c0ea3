#!/bin/bash
# Wall time and peak used memory of one command, e.g. `make run` from an empty runs/full:
#   rm -rf runs/full && bash bench/time_and_memory.sh /tmp/makerun.stats -- make run
# Used memory is the machine's MemTotal - MemAvailable, sampled every 0.5 s (as bench/learning.py does), so
# run it alone on the machine.
out=$1; shift 2
# The machine's speed first (bench/machine.py): a wall time means nothing without it.
here=$(cd "$(dirname "$0")" && pwd)
py="$here/../.venv/bin/python"; [ -x "$py" ] || py=python3
calibration=$("$py" "$here/machine.py")
echo "$calibration" >&2
base=$(awk '/MemTotal/{t=$2}/MemAvailable/{a=$2}END{print t-a}' /proc/meminfo)
peak=$base
start=$(date +%s.%N)
"$@" &
pid=$!
while kill -0 $pid 2>/dev/null; do
  u=$(awk '/MemTotal/{t=$2}/MemAvailable/{a=$2}END{print t-a}' /proc/meminfo)
  [ $u -gt $peak ] && peak=$u
  sleep 0.5
done
wait $pid; rc=$?
end=$(date +%s.%N)
echo "rc=$rc wall_s=$(echo "$end - $start" | bc) peak_used_gib=$(echo "scale=2; $peak/1048576" | bc) baseline_gib=$(echo "scale=2; $base/1048576" | bc) peak_above_baseline_gib=$(echo "scale=2; ($peak-$base)/1048576" | bc)" > $out
echo "$calibration" >> $out
