#!/usr/bin/env bash
# The GPU proof, from the bundle scripts/gpu-bundle.sh builds: one call on a bare GPU machine (no
# network, none of kvd's Debian libraries; needs Linux x86-64 with glibc >= 2.36, the NVIDIA driver,
# and for the Python steps a python3 with PyTorch; the hybrid_model step also grpcio and protobuf).
# Finishes in well under 5 minutes.
#
# Usage: run.sh OUT_DIR
# Writes OUT_DIR/results.jsonl (one JSON object per step: step, ok, rc, seconds, detail),
# OUT_DIR/<step>.log and OUT_DIR/summary.txt, and prints the summary. Exit status: 0 when every
# step passed; 2 when no NVIDIA driver is present (after checking that every binary loads); 3 when
# the driver shows no usable GPU; 1 when anything else failed.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:?usage: run.sh OUT_DIR}"
mkdir -p "$out"
# The binaries find their libraries through RUNPATH $ORIGIN/lib; this covers a root without /proc.
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
results="$out/results.jsonl"
: >"$results"
failed=0
summary=()

json_escape() { sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/\t/ /g' | tr -d '\r' | awk 'BEGIN{ORS="\\n"} {print}'; }

# record STEP RC SECONDS DETAIL: one JSON line; a non-zero RC marks the run failed unless STEP is
# listed in $soft.
record() {
  local ok=true
  [ "$2" -eq 0 ] || ok=false
  printf '{"step": "%s", "ok": %s, "rc": %d, "seconds": %s, "detail": "%s"}\n' \
    "$1" "$ok" "$2" "$3" "$(printf '%s' "$4" | json_escape)" >>"$results"
  summary+=("$(printf '%-14s %-5s %6ss  %s' "$1" "$([ "$ok" = true ] && echo ok || echo FAIL)" "$3" "$(printf '%s' "$4" | head -1 | cut -c1-100)")")
  [ "$ok" = true ] || failed=1
}

# run STEP TIMEOUT_S COMMAND...: runs with a time limit, log in OUT_DIR/STEP.log; sets $rc, $secs.
run() {
  local step=$1 limit=$2
  shift 2
  local t0=$(date +%s.%N)
  timeout --kill-after=10 "$limit" "$@" >"$out/$step.log" 2>&1
  rc=$?
  secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
}

finish() {
  { echo "kvd GPU proof: $(grep -c '"ok": true' "$results") passed, $(grep -c '"ok": false' "$results") failed"
    cat "$here/BUILD_INFO" 2>/dev/null
    printf '%s\n' "${summary[@]}"; } >"$out/summary.txt"
  cat "$out/summary.txt"
  exit "$1"
}

# 1. Every binary loads: no library missing, nothing from the build machine assumed.
missing=""
for b in kvd kvdctl kvd_example_worker kvd_step_worker gpu_cuda_test kvd_cuda_bench kvd_gpu_probe; do
  "$here/$b" --help >"$out/load-$b.log" 2>&1
  if grep -q "error while loading shared libraries" "$out/load-$b.log"; then
    missing+="$b: $(grep "error while loading" "$out/load-$b.log") "
  fi
done
record libraries "$([ -z "$missing" ] && echo 0 || echo 1)" 0 "${missing:-every binary loads with the bundled libraries}"

# 2. The driver and the devices, by identity.
run probe 30 "$here/kvd_gpu_probe"
probe_rc=$rc
record probe "$probe_rc" "$secs" "$(cat "$out/probe.log")"
if [ "$probe_rc" -eq 2 ]; then
  summary+=("no NVIDIA driver on this machine: the GPU steps cannot run")
  finish 2
elif [ "$probe_rc" -ne 0 ]; then
  summary+=("the NVIDIA driver shows no usable GPU: the GPU steps cannot run")
  finish 3
fi

export KVD_TEST_BIN_DIR="$here"
# 3. The [.gpu] suite: IPC across processes, slow-writer publish, tiers on CUDA, device identity.
run gpu_tests 150 "$here/gpu_cuda_test" "[.gpu]" --reporter compact --success
record gpu_tests "$rc" "$secs" "$(tail -3 "$out/gpu_tests.log")"

# 4. Benchmarks: IPC open cost per slab size beside cudaMalloc; gather/scatter beside cudaMemcpy.
run cuda_bench 90 "$here/kvd_cuda_bench" --max-gib="${KVD_IPC_MAX_GIB:-8}"
record cuda_bench "$rc" "$secs" "$(cat "$out/cuda_bench.log")"

# write_config [POOL KEY: VALUE]: the pool of steps 5 and 5b (one more key when given) in $tmp/kvd.yaml.
write_config() {
  printf 'pools:\n  - name: default\n    block_tokens: 16\n    num_layers: 8\n    bytes_per_token_per_layer: 1024\n    capacity_blocks: 1024\n    max_model_len: 8192\n' >"$tmp/kvd.yaml"
  [ -z "${1:-}" ] || printf '    %s\n' "$1" >>"$tmp/kvd.yaml"
}

# start_kvd READY_FILE LOG [FLAGS...]: kvd on $tmp/kvd.yaml and $tmp/kvd.sock, CUDA backend; sets
# $kvd_pid; true once it serves.
start_kvd() {
  local ready=$1 log=$2
  shift 2
  "$here/kvd" --config="$tmp/kvd.yaml" --listen="unix://$tmp/kvd.sock" --metrics-listen=off --backend=cuda \
    --ready-file="$ready" "$@" >"$log" 2>&1 &
  kvd_pid=$!
  for _ in $(seq 1 250); do [ -e "$ready" ] || ! kill -0 "$kvd_pid" 2>/dev/null && break; sleep 0.04; done
  [ -e "$ready" ]
}

# 5. Two daemon-backed worker processes share device blocks, bytes verified.
tmp=$(mktemp -d)
write_config
if start_kvd "$tmp/ready" "$out/daemon.log"; then
  run worker_a 60 "$here/kvd_example_worker" --target="unix://$tmp/kvd.sock" --id=a --prompt-range=0:1000 --gen=16
  a_rc=$rc a_secs=$secs
  run worker_b 60 "$here/kvd_example_worker" --target="unix://$tmp/kvd.sock" --id=b --prompt-range=0:1000 --gen=16
  b_out=$(tail -1 "$out/worker_b.log")
  ok=1
  [ "$a_rc" -eq 0 ] && [ "$rc" -eq 0 ] && grep -q '"cached_tokens": 992' <<<"$b_out" && grep -q '"mismatches": 0' <<<"$b_out" && ok=0
  record two_workers "$ok" "$(awk -v a="$a_secs" -v b="$secs" 'BEGIN{print a+b}')" "$b_out"
else
  record two_workers 1 0 "kvd --backend=cuda did not start: $(tail -5 "$out/daemon.log")"
fi
kill "$kvd_pid" 2>/dev/null; wait "$kvd_pid" 2>/dev/null; rm -rf "$tmp"

# 5c. Continuous batching on CUDA slabs through steps (kvd-step): worker a decodes a batch of 8 on
# block credit and preempts one request, resumed from its checkpoint; worker b, another process,
# reuses a's prompts; every reused byte verified (cudaMemcpy through the client), none wrong.
tmp=$(mktemp -d)
write_config
if start_kvd "$tmp/ready" "$out/daemon_steps.log"; then
  run steps_a 90 "$here/kvd_step_worker" --target="unix://$tmp/kvd.sock" --id=a --batch=8 --prompt-len=200 \
    --shared=64 --gen=48 --preempt-at=20
  a_rc=$rc a_secs=$secs a_out=$(tail -1 "$out/steps_a.log")
  run steps_b 90 "$here/kvd_step_worker" --target="unix://$tmp/kvd.sock" --id=b --batch=8 --prompt-len=200 \
    --shared=64 --gen=48
  b_out=$(tail -1 "$out/steps_b.log")
  ok=1
  [ "$a_rc" -eq 0 ] && [ "$rc" -eq 0 ] && grep -q '"resumed": 1' <<<"$a_out" && grep -q '"mismatches": 0' <<<"$a_out" \
    && grep -q '"mismatches": 0' <<<"$b_out" && ! grep -q '"cached_tokens": 0,' <<<"$b_out" && ok=0
  record batched_steps "$ok" "$(awk -v a="$a_secs" -v b="$secs" 'BEGIN{print a+b}')" "a: $a_out b: $b_out"
else
  record batched_steps 1 0 "kvd --backend=cuda did not start: $(tail -5 "$out/daemon_steps.log")"
fi
kill "$kvd_pid" 2>/dev/null; wait "$kvd_pid" 2>/dev/null; rm -rf "$tmp"

# 5b. Hot handoff of a VMM pool (allocator: vmm): kvd A serves worker a; kvd B --takeover takes
# its sockets, the VMM slab's fd and the index; worker b then hits the same 992 tokens in the same
# device memory, bytes verified, and A has exited 0.
tmp=$(mktemp -d)
write_config "allocator: vmm"
if start_kvd "$tmp/ready_a" "$out/handoff_a.log"; then
  old_pid=$kvd_pid
  run handoff_worker_a 60 "$here/kvd_example_worker" --target="unix://$tmp/kvd.sock" --id=a --prompt-range=0:1000 --gen=16
  a_rc=$rc
  if start_kvd "$tmp/ready_b" "$out/handoff_b.log" --takeover; then
    wait "$old_pid"; old_rc=$?
    run handoff_worker_b 60 "$here/kvd_example_worker" --target="unix://$tmp/kvd.sock" --id=b --prompt-range=0:1000 --gen=16
    b_out=$(tail -1 "$out/handoff_worker_b.log")
    ok=1
    [ "$a_rc" -eq 0 ] && [ "$old_rc" -eq 0 ] && [ "$rc" -eq 0 ] && grep -q '"cached_tokens": 992' <<<"$b_out" &&
      grep -q '"mismatches": 0' <<<"$b_out" && ok=0
    record vmm_handoff "$ok" "$secs" "old kvd exit $old_rc; $b_out"
  else
    record vmm_handoff 1 0 "kvd --takeover did not start: $(tail -5 "$out/handoff_b.log") / $(tail -3 "$out/handoff_a.log")"
  fi
else
  record vmm_handoff 1 0 "kvd with allocator: vmm did not start: $(tail -5 "$out/handoff_a.log")"
fi
kill "$kvd_pid" 2>/dev/null; wait "$kvd_pid" 2>/dev/null; rm -rf "$tmp"

# 6. PyTorch maps a device slab in place (no stubs, no grpcio) and checks the C++ worker's bytes.
py="${KVD_PYTHON:-$(command -v python3 || true)}"
if [ -z "$py" ]; then
  record python_torch 0 0 "skipped: no python3 on this machine"
else
  run python_torch 90 "$py" "$here/python/torch_slab_check.py" "$here"
  if [ "$rc" -eq 4 ]; then
    record python_torch 0 "$secs" "$(tail -1 "$out/python_torch.log")"
  else
    record python_torch "$rc" "$secs" "$(tail -4 "$out/python_torch.log")"
  fi
fi

# 7. The reference hybrid model (docs/hybrid.md §2.10) on a CUDA slab: TinyHybrid's full, window
# and recurrent-state groups in kvd's device memory, reused across a continuous batch, tokens and
# logits bit-identical to a no-cache run on the same device; the negative controls differ. Needs
# grpcio and protobuf beside PyTorch (the Python client); skipped, saying so, without them.
if [ -z "$py" ]; then
  record hybrid_model 0 0 "skipped: no python3 on this machine"
else
  run hybrid_model 120 "$py" "$here/python/hybrid_gpu_check.py" "$here"
  if [ "$rc" -eq 4 ]; then
    record hybrid_model 0 "$secs" "$(tail -1 "$out/hybrid_model.log")"
  else
    detail=$(grep -E '^FAIL|failed$' "$out/hybrid_model.log" | tail -6)
    [ "$rc" -eq 0 ] || grep -q '^FAIL' "$out/hybrid_model.log" || detail=$(tail -4 "$out/hybrid_model.log")
    record hybrid_model "$rc" "$secs" "$detail"
  fi
fi

finish "$failed"
