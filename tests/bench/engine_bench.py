"""Replays a Mooncake trace through 2-4 reference-engine worker processes (kvd.engine) on one kvd,
with kvd's prefix cache and without it, and reports prefill tokens computed vs skipped, time to
first token, and kvd's control-plane share of each request's wall time.

  PYTHONPATH=build/python /usr/bin/python3 tests/bench/engine_bench.py \
      --kvd build/server/kvd --trace ../shared/data/mooncake-fast25/conversation_trace.jsonl \
      [--workers 3] [--requests 240] [--scale 64]

Scaling to the tiny model: one trace hash id (512 tokens of a real prompt) becomes one 8-token
kvd block whose tokens derive from the hash id, so prompts that share hash ids share prefixes
exactly as in the trace; prompt length = ceil(input_length / scale) capped to whole hash-id
blocks and max_prompt; output = min(output_length / scale, max_new). Requests go round-robin to
the workers in trace order; each worker serves its share closed-loop (no timestamps).

"without cache" runs the same requests, each under a salt of its own: nothing is reused, every
request still pays kvd's full protocol. Both modes run on one daemon each, the same pool.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BLOCK = 8
POOL = ("pools:\n  - name: default\n    block_tokens: 8\n    num_layers: 2\n"
        "    bytes_per_token_per_layer: 128\n    capacity_blocks: {cap}\n    max_model_len: 1024\n"
        "    dtype: float32\n    kv_heads: 2\n    head_dim: 8\n    kv_arrangement: token_kv_head_dim\n"
        "budget_bytes: {budget}\n")


def requests_from(trace, n, scale, max_prompt, max_new):
    out = []
    with open(trace) as f:
        for i, line in enumerate(f):
            if len(out) == n:
                break
            r = json.loads(line)
            length = min(-(-r["input_length"] // scale), max_prompt, len(r["hash_ids"]) * BLOCK)
            prompt = [(h * 131 + j * 7 + 1) % 97 for h in r["hash_ids"] for j in range(BLOCK)][:length]
            out.append({"id": f"t{i}", "prompt": prompt,
                        "max_new": max(1, min(r["output_length"] // scale, max_new))})
    return out


def start_daemon(kvd, tmp, name, cap):
    config = os.path.join(tmp, name + ".yaml")
    with open(config, "w") as f:
        f.write(POOL.format(cap=cap, budget=cap * BLOCK * 2 * 128))
    sock, ready = os.path.join(tmp, name + ".sock"), os.path.join(tmp, name + ".ready")
    proc = subprocess.Popen([kvd, "--config=" + config, "--listen=unix://" + sock, "--metrics-listen=off",
                             "--ready-file=" + ready, "--log-level=warn"])
    for _ in range(500):
        if os.path.exists(ready):
            return proc, "unix://" + sock
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError("kvd did not start")


def run(kvd, tmp, name, reqs, workers, cap):
    proc, target = start_daemon(kvd, tmp, name, cap)
    try:
        files = []
        for w in range(workers):
            path = os.path.join(tmp, f"{name}-{w}.jsonl")
            with open(path, "w") as f:
                for r in reqs[w::workers]:
                    f.write(json.dumps(r) + "\n")
            files.append(path)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        start = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-m", "kvd.engine.worker", "--target", target, "--prompts", p,
                                   "--name", f"{name}-{i}"], stdout=subprocess.PIPE, text=True, env=env)
                 for i, p in enumerate(files)]
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=3600)
            if p.returncode != 0:
                raise RuntimeError(f"a worker failed ({p.returncode})")
            results += [json.loads(x) for x in out.splitlines() if x.strip()]
        return results, time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def summarize(label, results, elapsed):
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    ttft = [r["ttft_s"] * 1e3 for r in results]
    rpc_share = [r["rpc_s"] / r["wall_s"] for r in results]
    rpc_ms = [r["rpc_s"] * 1e3 for r in results]
    q = statistics.quantiles(ttft, n=10)
    return {"mode": label, "requests": len(results), "prompt_tokens": prompt, "computed": prompt - cached,
            "skipped": cached, "ttft_p50_ms": statistics.median(ttft), "ttft_p90_ms": q[8],
            "rpc_ms_p50": statistics.median(rpc_ms), "rpc_share_p50": statistics.median(rpc_share),
            "rpc_share_total": sum(r["rpc_s"] for r in results) / sum(r["wall_s"] for r in results),
            "elapsed_s": elapsed}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvd", required=True)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--scale", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-new", type=int, default=4)
    ap.add_argument("--capacity-blocks", type=int, default=4096)
    args = ap.parse_args()
    if not 1 <= args.workers <= 16:
        ap.error("--workers must be in [1, 16]")
    reqs = requests_from(args.trace, args.requests, args.scale, args.max_prompt, args.max_new)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hot, t_hot = run(args.kvd, tmp, "cache", reqs, args.workers, args.capacity_blocks)
        cold_reqs = [dict(r, salt="own-" + r["id"]) for r in reqs]
        cold, t_cold = run(args.kvd, tmp, "nocache", cold_reqs, args.workers, args.capacity_blocks)
    rows.append(summarize("kvd cache", hot, t_hot))
    rows.append(summarize("no reuse", cold, t_cold))
    same = {r["id"]: r["digest"] for r in hot} == {r["id"]: r["digest"] for r in cold}
    print(f"trace {os.path.basename(args.trace)}: {len(reqs)} requests, {args.workers} workers, scale 1/{args.scale}")
    print(f"{'mode':<10} {'prompt tok':>10} {'computed':>9} {'skipped':>8} {'TTFT p50':>9} {'TTFT p90':>9} "
          f"{'kvd RPC p50':>11} {'RPC share p50':>13} {'RPC share all':>13} {'elapsed':>8}")
    for r in rows:
        print(f"{r['mode']:<10} {r['prompt_tokens']:>10} {r['computed']:>9} {r['skipped']:>8} "
              f"{r['ttft_p50_ms']:>7.1f}ms {r['ttft_p90_ms']:>7.1f}ms {r['rpc_ms_p50']:>9.2f}ms "
              f"{100 * r['rpc_share_p50']:>12.1f}% {100 * r['rpc_share_total']:>12.1f}% {r['elapsed_s']:>7.1f}s")
    print(f"TTFT p50 ratio (no reuse / kvd cache): {rows[1]['ttft_p50_ms'] / rows[0]['ttft_p50_ms']:.2f}x; "
          f"outputs identical in both modes: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
