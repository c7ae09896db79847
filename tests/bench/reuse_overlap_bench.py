"""Overlapping requests on one node, kvd against the vLLM-like in-process baseline (kvd-reuse-2
items 4 and 5): prompt tokens computed and hit rate on a Mooncake trace prefix with a prefill delay,
at a number of requests in flight (closed loop) and at the trace's arrivals sped up; and the agent
fan-out (N requests on a new shared context of S tokens started together).

  PYTHONPATH=build/python /usr/bin/python3 tests/bench/reuse_overlap_bench.py --kvd build/server/kvd \\
      --bench build/client/kvd-bench --trace ../shared/data/mooncake-fast25/conversation_trace.jsonl \\
      [--requests 400] [--in-flight 8,32,64,128] [--prefill-tps 100000] \\
      [--arrivals 200:1,4,16] [--arrival-prefill-tps 20000] [--fanout 8,32 --fanout-context 4096]

kvd: `kvd-bench` against a fresh kvd per run (16-token blocks, a pool no run fills), every request
waiting out its prefill delay ((prompt - hit) / tps, per request) between its Start and its
publish, once without and once with the in-flight wait (--wait-in-flight-ms).

The baseline: one engine's own prefix cache (kvd.engine.local_blocks.LocalBlocks, 16-token blocks,
no eviction at this size), replayed in simulated time with the same workers, arrivals and prefill
delay, publishing its prompt when its prefill ends as vLLM does when a block fills. Under both
duplicate rules: "continue" (vLLM's) and "stop" (the old rule). "sequential" is the trace's
unlimited-cache bound: what nothing computed twice would compute; the simultaneous-compute loss is
the baseline's computed tokens above it, and "recovered" the share of that loss kvd's wait removes.

The fan-out shares one engine (--prefill-shared: prefills queue on the node's rate); the baseline
prefills all N prompts in full on that engine at once (N x (S + own) tokens, the last first token
when all of them are done).
"""
import argparse
import heapq
import json
import os
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace as NS

BT = 16
CONFIG = ("metrics_listen: \"\"\nlog_level: warn\npools:\n  - name: bench\n    block_tokens: 16\n"
          "    num_layers: 1\n    bytes_per_token_per_layer: 16\n    capacity_blocks: 400000\n"
          "    max_model_len: 131072\n")


def load(trace, n):
    out = []
    with open(trace) as f:
        for line in f:
            if len(out) == n:
                break
            out.append(json.loads(line))
    return out


def tokens_of(r):  # what kvd-bench's TraceTokens shares: a token per (hash id, offset)
    return [r["hash_ids"][i // 512] * 512 + i % 512 for i in range(r["input_length"])]


def simulate(reqs, workers, tps, speedup, chains):
    """The in-process baseline in simulated time: worker k serves requests k, k+N, ... in order."""
    from kvd.engine.local_blocks import LocalBlocks
    lb = LocalBlocks(pool="bench", block_tokens=BT, num_layers=1, bytes_per_token_per_layer=1,
                     capacity_blocks=400000, max_model_len=131072, chains=chains)
    events, seq = [], 0
    for k in range(min(workers, len(reqs))):
        heapq.heappush(events, (0.0, seq, "free", k, None))
        seq += 1
    nxt = list(range(min(workers, len(reqs))))
    prompt = hit = 0
    while events:
        t, _, kind, k, r = heapq.heappop(events)
        if kind == "free":
            i = nxt[k]
            if i >= len(reqs):
                continue
            nxt[k] = i + workers
            at = max(t, reqs[i]["timestamp"] / 1000.0 / speedup) if speedup > 0 else t
            heapq.heappush(events, (at, seq, "start", k, i))
        elif kind == "start":
            toks = tokens_of(reqs[r])
            req = NS(id=r, blocks=[], num_tokens=0, cached_tokens=0, waiting=False, live=False)
            lb._start(req, NS(admit=NS(prompt=toks, max_new_tokens=0, namespace=NS(cache_salt=""))))
            prompt, hit = prompt + len(toks), hit + req.cached_tokens
            heapq.heappush(events, (t + (len(toks) - req.cached_tokens) / tps, seq, "publish", k, (req, toks)))
        else:
            req, toks = r
            lb._publish(req, NS(tokens=toks, num_blocks=len(toks) // BT))
            lb._end(req, None)
            heapq.heappush(events, (t, seq, "free", k, None))
        seq += 1
    return {"computed": prompt - hit, "prompt": prompt, "hit_rate": hit / prompt if prompt else 0,
            "duplicates": lb.duplicates, "no_parent": lb.no_parent}


def kvd_run(args, tmp, extra):
    config = os.path.join(tmp, "kvd.yaml")
    with open(config, "w") as f:
        f.write(CONFIG)
    sock, ready = os.path.join(tmp, "kvd.sock"), os.path.join(tmp, "kvd.ready")
    for p in (sock, ready):
        if os.path.exists(p):
            os.unlink(p)
    proc = subprocess.Popen([args.kvd, "--config=" + config, "--listen=unix://" + sock, "--ready-file=" + ready],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(500):
            if os.path.exists(ready):
                break
            time.sleep(0.02)
        out = os.path.join(tmp, "report.json")
        subprocess.run([args.bench, "--target=unix://" + sock, "--max-decode-tokens=0", "--json=" + out] + extra,
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)
    finally:
        proc.terminate()
        proc.wait()


def trace_row(args, tmp, reqs, label, workers, tps, speedup):
    base = ["--trace=" + args.trace, f"--limit={len(reqs)}", f"--workers={workers}", f"--prefill-tps={tps}",
            f"--speedup={speedup}"]
    nowait = kvd_run(args, tmp, base)
    wait = kvd_run(args, tmp, base + [f"--wait-in-flight-ms={args.wait_ms}"])
    cont = simulate(reqs, workers, tps, speedup, "continue")
    stop = simulate(reqs, workers, tps, speedup, "stop")
    seq_computed = round(nowait["prompt_tokens"] * (1 - nowait["unlimited_bound"]))
    loss = cont["computed"] - seq_computed
    rec = (cont["computed"] - wait["computed_tokens"]) / loss if loss > 0 else float("nan")
    m = 1e6
    print(f"| {label} | {seq_computed / m:.3f} | {stop['computed'] / m:.3f} ({100 * (1 - stop['computed'] / stop['prompt']):.1f} %, "
          f"np {stop['no_parent']}) | {cont['computed'] / m:.3f} ({100 * cont['hit_rate']:.1f} %) | "
          f"{nowait['computed_tokens'] / m:.3f} ({100 * nowait['hit_rate']:.1f} %, np {nowait['no_parent']}) | "
          f"{wait['computed_tokens'] / m:.3f} ({100 * wait['hit_rate']:.1f} %, np {wait['no_parent']}, "
          f"{wait['in_flight_published']}/{wait['in_flight_seen']} waits) | {100 * rec:.0f} % |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvd", required=True)
    ap.add_argument("--bench", required=True)
    ap.add_argument("--trace")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--in-flight", default="8,32,64,128")
    ap.add_argument("--prefill-tps", type=float, default=100000)
    ap.add_argument("--arrivals", default="", help="N:s1,s2,...  the first N requests at these speed-ups")
    ap.add_argument("--arrival-prefill-tps", type=float, default=20000)
    ap.add_argument("--arrival-workers", type=int, default=128)
    ap.add_argument("--wait-ms", type=int, default=30000)
    ap.add_argument("--fanout", default="")
    ap.add_argument("--fanout-context", type=int, default=4096)
    ap.add_argument("--fanout-own", type=int, default=256)
    ap.add_argument("--fanout-tps", type=float, default=100000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.trace and (args.in_flight or args.arrivals):
            print(f"trace {os.path.basename(args.trace)}; token counts in millions (hit rate, no_parent)\n")
            print("| run | sequential | baseline, old rule | baseline (vLLM-like) | kvd, no wait | kvd, wait | "
                  "loss recovered |\n|---|---|---|---|---|---|---|")
        if args.trace and args.in_flight:
            reqs = load(args.trace, args.requests)
            for w in [int(x) for x in args.in_flight.split(",") if x]:
                trace_row(args, tmp, reqs, f"first {len(reqs)}, {w} in flight, {args.prefill_tps:.0f} tok/s",
                          w, args.prefill_tps, 0)
        if args.trace and args.arrivals:
            n, speeds = args.arrivals.split(":")
            reqs = load(args.trace, int(n))
            for s in [float(x) for x in speeds.split(",")]:
                trace_row(args, tmp, reqs, f"first {len(reqs)}, arrivals x{s:g}, {args.arrival_prefill_tps:.0f} tok/s",
                          args.arrival_workers, args.arrival_prefill_tps, s)
        if args.fanout:
            S, own, tps = args.fanout_context, args.fanout_own, args.fanout_tps
            print(f"\nfan-out over S = {S} shared + {own} own tokens, one engine at {tps:.0f} tokens/s\n")
            print("| N | baseline computed | baseline last first token | kvd no wait computed | last first token | "
                  "kvd wait computed | last first token | goal S + N x own |\n|---|---|---|---|---|---|---|---|")
            for n in [int(x) for x in args.fanout.split(",")]:
                common = [f"--fanout={n}", f"--fanout-context={S}", f"--fanout-own={own}", f"--prefill-tps={tps}",
                          "--prefill-shared"]
                nowait = kvd_run(args, tmp, common + ["--seed=1"])
                wait = kvd_run(args, tmp, common + ["--seed=2", f"--wait-in-flight-ms={args.wait_ms}"])
                base = n * (S + own)
                print(f"| {n} | {base} | {1000 * base / tps:.0f} ms | {nowait['computed_tokens']} | "
                      f"{nowait['last_first_token_ms']:.0f} ms | {wait['computed_tokens']} | "
                      f"{wait['last_first_token_ms']:.0f} ms | {S + n * own} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
