#!/usr/bin/env bash
# Hit rate against device capacity for LRU and SLRU, beside the unlimited-cache and offline
# farthest-next-use bounds, on a Mooncake trace; writes a PNG with gnuplot (Debian's gnuplot-nox).
# Usage: tests/bench/plot_hit_rate.sh TRACE OUT.png [build-dir]
# Needs a build with -DKVD_BUILD_BENCHMARKS=ON and gnuplot (apt-get install gnuplot-nox).
set -euo pipefail
trace="$1"; out="$2"; build="${3:-build}"
caps="${KVD_PLOT_CAPACITIES:-1000000,2000000,3000000,5000000,10000000}"
data="$(mktemp)"; trap 'rm -f "$data" "$data".*' EXIT
for policy in lru slru; do
  bounds=off; [ "$policy" = lru ] && bounds=on
  "$build/tests/bench/kvd_core_replay" --trace="$trace" --capacity-tokens="$caps" --policy="$policy" \
      --bounds="$bounds" --hash-sample=1 | tee "$data.$policy" >&2
done
unlimited=$(sed -n 's/^unlimited cache at .*: \([0-9.]*\)%.*/\1/p' "$data.lru")
# capacity (M tokens), LRU, SLRU, farthest-next-use
paste <(grep '^| [0-9]' "$data.lru" | awk -F'|' '{gsub(/[ %]/,"",$2); gsub(/[ %]/,"",$4); gsub(/[ %]/,"",$5); print $2/1e6, $4, $5}') \
      <(grep '^| [0-9]' "$data.slru" | awk -F'|' '{gsub(/[ %]/,"",$4); print $4}') |
  awk '{print $1, $2, $4, $3}' > "$data"
gnuplot <<GP
set terminal pngcairo size 900,560 noenhanced
set output "$out"
set title "$(basename "$trace"): token hit rate against device capacity (16-token blocks)"
set xlabel "device capacity (million tokens)"
set ylabel "token hit rate (%)"
set key bottom right
set grid
set logscale x
plot "$data" using 1:4 with linespoints title "offline farthest-next-use (bound)", \
     "$data" using 1:3 with linespoints title "kvd SLRU + ghost (default)", \
     "$data" using 1:2 with linespoints title "leaf-first LRU", \
     $unlimited with lines dashtype 2 title "unlimited cache"
GP
echo "wrote $out" >&2
