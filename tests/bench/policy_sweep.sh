#!/usr/bin/env bash
# Eviction policies against capacity on a Mooncake trace: token hit rate and prefill compute saved
# (client/tools/prefill_cost.h) for lru, slru, horizon and the horizon order alone, beside the
# offline farthest-next-use bound, over the whole trace and its held-out last third. Writes
# OUT_PREFIX.md (the tables quoted in docs/performance.md) and, with gnuplot (Debian's
# gnuplot-nox), OUT_PREFIX.png (hit rate and compute saved against capacity).
# Usage: tests/bench/policy_sweep.sh TRACE OUT_PREFIX [block_tokens] [build-dir]
# Needs a build with -DKVD_BUILD_BENCHMARKS=ON. KVD_SWEEP_CAPACITIES overrides the capacities.
set -euo pipefail
trace="$1"; out="$2"; bt="${3:-16}"; build="${4:-build}"
caps="${KVD_SWEEP_CAPACITIES:-1000000,3000000,10000000,50000000}"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
# name: kvd_core_replay flags
policies=("lru:--policy=lru --bounds=on" "slru:--policy=slru --bounds=off"
          "horizon:--policy=horizon --bounds=off" "horizon-order-only:--policy=horizon --horizon-sample=0 --bounds=off")
for p in "${policies[@]}"; do
  name="${p%%:*}"; flags="${p#*:}"
  # shellcheck disable=SC2086
  "$build/tests/bench/kvd_core_replay" --trace="$trace" --block-tokens="$bt" --capacity-tokens="$caps" \
      --hash-sample=0 $flags | tee "$tmp/$name.txt" >&2
  # capacity, hit, saved, bound hit, bound saved, held-out hit, held-out saved, held-out bound hit,
  # held-out bound saved, ns/block
  grep '^| [0-9]' "$tmp/$name.txt" | awk -F'|' '{for (i = 2; i <= 17; i++) gsub(/[ %B]/, "", $i);
      print $2, $4, $5, $6, $7, $8, $9, $10, $11, $14}' > "$tmp/$name.dat"
done
{
  echo "$(basename "$trace"), ${bt}-token blocks: token hit rate / prefill compute saved (%)"
  echo
  echo "| capacity | lru | slru | horizon | horizon order only | farthest-next-use bound | gap to the bound closed by horizon (hit) |"
  echo "|---|---|---|---|---|---|---|"
  paste "$tmp/lru.dat" "$tmp/slru.dat" "$tmp/horizon.dat" "$tmp/horizon-order-only.dat" | awk '{
      gap = ($4 - $2 >= 1) ? sprintf("%.0f %%", 100 * ($22 - $2) / ($4 - $2)) : "n/a (LRU is within a point of it)";
      printf "| %gM | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f | %s |\n",
             $1 / 1e6, $2, $3, $12, $13, $22, $23, $32, $33, $4, $5, gap }'
  echo
  echo "Held out (the last third of the trace by time), same runs:"
  echo
  echo "| capacity | lru | slru | horizon | horizon order only | farthest-next-use bound |"
  echo "|---|---|---|---|---|---|"
  paste "$tmp/lru.dat" "$tmp/slru.dat" "$tmp/horizon.dat" "$tmp/horizon-order-only.dat" | awk '{
      printf "| %gM | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f |\n",
             $1 / 1e6, $6, $7, $16, $17, $26, $27, $36, $37, $8, $9 }'
  echo
  echo "Engine time per block (ns), same runs: lru / slru / horizon / horizon order only"
  echo
  paste "$tmp/lru.dat" "$tmp/slru.dat" "$tmp/horizon.dat" "$tmp/horizon-order-only.dat" | awk '{
      printf "- %gM: %d / %d / %d / %d\n", $1 / 1e6, $10, $20, $30, $40 }'
} > "$out.md"
cat "$out.md" >&2
if command -v gnuplot > /dev/null; then
  paste "$tmp/lru.dat" "$tmp/slru.dat" "$tmp/horizon.dat" "$tmp/horizon-order-only.dat" > "$tmp/all.dat"
  # One panel's series: hit rate (offset 0) or compute saved (offset 1) of the bound and each policy.
  series() {
    local o=$1
    printf '"%s" using ($1/1e6):%d with linespoints title "farthest-next-use (offline bound)", ' "$tmp/all.dat" $((4 + o))
    printf '"" using ($1/1e6):%d with linespoints title "horizon", ' $((22 + o))
    printf '"" using ($1/1e6):%d with linespoints title "slru (default)", ' $((12 + o))
    printf '"" using ($1/1e6):%d with linespoints title "lru", ' $((2 + o))
    printf '"" using ($1/1e6):%d with linespoints dashtype 2 title "horizon order only"' $((32 + o))
  }
  gnuplot <<GP
set terminal pngcairo size 1200,500 noenhanced
set output "$out.png"
set multiplot layout 1,2 title "$(basename "$trace"), ${bt}-token blocks"
set xlabel "device capacity (million tokens)"
set logscale x
set grid
set key bottom right
set ylabel "token hit rate (%)"
plot $(series 0)
set ylabel "prefill compute saved (%, Llama-3-8B shape)"
plot $(series 1)
unset multiplot
GP
  echo "wrote $out.png" >&2
fi
echo "wrote $out.md" >&2
