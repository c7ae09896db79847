#!/usr/bin/env python3
"""Peer transfer benchmark (docs/performance.md, "Peer transfer"): two kvd nodes in two network
namespaces joined by a veth pair (tests/transfer/netns.py; root only); pulls over the peers'
mutual-TLS channel, beside UCX's own TCP get bandwidth between the same namespaces as a baseline.

1. Throughput: node A holds a 16,384-token prefix of a Llama-3-8B-shaped pool (1,024 blocks of
   2 MiB, 2 GiB); a worker on node B starts that prompt naming node-a, and kvd B pulls it. Each
   repetition clears B's cache first. Beside it, in the same run and between the same
   namespaces, `ucx_perftest -t ucp_get` with 2 MiB messages: the transport's get bandwidth.
2. Time to first token on node B with the reference engine (a pool of 16-token blocks, 16,384-token
   prompts): pulled from A, recomputed by B's engine, and fetched from a Redis tier (a
   redis-server inside B's namespace; B computed the prompt, its upload finished, B's cache was
   cleared, then the engine asks again).

Usage: transfer_bench.py KVD [--reps N]   (PYTHONPATH holds the kvd package)."""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "transfer"))
import netns  # noqa: E402

LLAMA = """pools:
  - name: llama
    block_tokens: 16
    num_layers: 32
    bytes_per_token_per_layer: 4096
    capacity_blocks: 1040
    max_model_len: 20000
  - name: tiny-engine
    block_tokens: 16
    num_layers: 2
    bytes_per_token_per_layer: 128
    capacity_blocks: 4096
    max_model_len: 20000
    dtype: float32
    kv_heads: 2
    head_dim: 8
    kv_arrangement: token_kv_head_dim
"""
TOKENS = 16384


def gc(client):
    from kvd.v1 import kvd_pb2
    client._rpc("Gc", kvd_pb2.GcRequest(max_idle_ms=0))


def fill_and_publish(client, pool, prompt, seed):
    import numpy
    with client.request(f"fill{seed}", pool, prompt, max_new_tokens=1) as req:
        slab = client.slab_array(pool)
        rng = numpy.random.default_rng(seed)
        blocks = list(req.blocks)[:TOKENS // 16]
        for b in blocks:
            slab[:, b, :] = rng.integers(0, 256, size=slab[:, b, :].shape, dtype=numpy.uint8)
        req.end(publish_blocks=len(blocks))


def perftest(pair, size, iters, outstanding=0):
    """ucx_perftest get bandwidth from B reading A, MB/s (10^6 bytes); `outstanding` > 0 keeps
    that many gets in flight (-O), as a pull does."""
    env = dict(os.environ, UCX_TLS="tcp")
    server = subprocess.Popen(["ip", "netns", "exec", pair.a.ns, "ucx_perftest", "-p", "13337"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)
    window = ["-O", str(outstanding)] if outstanding else []
    r = subprocess.run(["ip", "netns", "exec", pair.b.ns, "ucx_perftest", pair.a.ip, "-p", "13337", "-t", "ucp_get",
                        "-s", str(size), "-n", str(iters), "-w", "50"] + window,
                       env=env, capture_output=True, text=True, timeout=300)
    server.wait(timeout=30)
    final = [line for line in r.stdout.splitlines() if line.startswith("Final:")]
    if not final:
        raise RuntimeError("ucx_perftest:\n" + r.stdout + r.stderr)
    # Final: iterations, typical/avg/overall latency (usec), avg/overall bandwidth (MB/s, 2^20), msgrate
    cols = final[0].split()
    return float(cols[6]) * (1 << 20) / 1e6


def engine(node, prompts, peer=""):
    lines = "".join(json.dumps(p) + "\n" for p in prompts)
    args = [sys.executable, "-m", "kvd.engine.worker", "--target", node.target, "--name", "bench"]
    if peer:
        args += ["--peer", peer]
    r = subprocess.run(args, input=lines, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(r.stdout + r.stderr)
    return [json.loads(line) for line in r.stdout.splitlines()]


def prompt(seed):
    return [(seed * 131 + i * 17 + i // 7) % 97 for i in range(TOKENS + 1)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kvd")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--part", choices=["all", "throughput", "ttft"], default="all")
    args = ap.parse_args()
    reason = netns.why_not()
    if reason:
        sys.exit(f"transfer_bench: {reason}")
    redis_port = 16379
    if args.part in ("all", "throughput"):
        throughput(args)
    if args.part in ("all", "ttft"):
        ttft(args, redis_port)


def throughput(args):
    from kvd.client import Client
    # 2 GiB pulls: a deadline well past what they take, so that a slow machine measures, not fails.
    with netns.Pair(args.kvd, pools=LLAMA, extra="  pull_timeout_s: 120\n") as pair:
        a = Client(pair.a.target, worker_name="prefill")
        b = Client(pair.b.target, worker_name="decode")
        llama_prompt = [(i * 7) % 50000 for i in range(TOKENS + 1)]
        fill_and_publish(a, "llama", llama_prompt, 1)
        # Pulls and the transport's own get bandwidth alternate, so that both see the same machine:
        # ucx_perftest with 16 gets in flight (a pull keeps 32), of 2 MiB (the same two buffers
        # each time: they stay in the CPU caches) and of 64 MiB (1 GiB in flight: memory as cold
        # as the 2 GiB a pull reads and writes).
        pulls, gets, cold = [], [], []
        for rep in range(args.reps):
            gc(b)
            t0 = time.perf_counter()
            with b.request(f"pull{rep}", "llama", llama_prompt, max_new_tokens=1, peer="node-a", wait_s=60) as req:
                elapsed = time.perf_counter() - t0
                assert req.cached_tokens == TOKENS, f"pulled {req.cached_tokens} tokens; node B's log:\n{pair.b.log()[-3000:]}"
                req.release()
            pulls.append(elapsed)
            gets.append(perftest(pair, 2 << 20, 500, outstanding=16))
            cold.append(perftest(pair, 64 << 20, 48, outstanding=16))
        single = perftest(pair, 2 << 20, 500)  # one get at a time, for reference
        nbytes = TOKENS // 16 * (2 << 20)
        pull_bw = nbytes / statistics.median(pulls) / 1e6
        print(json.dumps({"part": "throughput", "bytes": nbytes, "pull_s": pulls, "median_s": statistics.median(pulls),
                          "pull_MBps": pull_bw, "perftest_2MiB_O16_MBps": gets, "perftest_64MiB_O16_MBps": cold,
                          "perftest_2MiB_O0_MBps": single,
                          "ratio_2MiB": pull_bw / statistics.median(gets),
                          "ratio_64MiB": pull_bw / statistics.median(cold)}), flush=True)
        a.close()
        b.close()


def ttft(args, redis_port):
    """Time to first token, reference engine, 16k-token prompts."""
    from kvd.client import Client
    redis = f"  redis_url: redis://127.0.0.1:{redis_port}\n"
    with netns.Pair(args.kvd, pools=LLAMA + "tiers:\n" + redis) as pair:
        rs = subprocess.Popen(["ip", "netns", "exec", pair.b.ns, "redis-server", "--port", str(redis_port), "--save", "",
                               "--appendonly", "no", "--maxmemory", "4gb"], stdout=subprocess.DEVNULL)
        time.sleep(1.0)
        try:
            rows = {"recompute": [], "pulled": [], "redis": []}
            for rep in range(args.reps):
                p = {"id": f"r{rep}", "prompt": prompt(rep), "max_new": 1}
                cold_b = engine(pair.b, [p])[0]
                rows["recompute"].append(cold_b["ttft_s"])
                # B's upload of what it computed finishes, B's cache is cleared: Redis serves.
                deadline = time.time() + 60
                while pair.b.metric('kvd_remote_blocks_total{direction="uploaded"}') < (rep + 1) * (TOKENS // 16) and time.time() < deadline:
                    time.sleep(0.2)
                with Client(pair.b.target, worker_name="ops") as ops:
                    gc(ops)
                via_redis = engine(pair.b, [dict(p, id=f"x{rep}")])[0]
                assert via_redis["cached_tokens"] == TOKENS and via_redis["digest"] == cold_b["digest"], via_redis
                rows["redis"].append(via_redis["ttft_s"])
                # A computes the prompt; B (its cache cleared, Redis emptied) pulls it.
                engine(pair.a, [dict(p, id=f"a{rep}")])
                subprocess.run(["ip", "netns", "exec", pair.b.ns, "redis-cli", "-p", str(redis_port), "FLUSHALL"],
                               check=True, capture_output=True)
                with Client(pair.b.target, worker_name="ops") as ops:
                    gc(ops)
                pulled = engine(pair.b, [dict(p, id=f"y{rep}")], peer="node-a")[0]
                assert pulled["cached_tokens"] == TOKENS and pulled["digest"] == cold_b["digest"], pulled
                rows["pulled"].append(pulled["ttft_s"])
            print(json.dumps({"part": "ttft", "tokens": TOKENS, "ttft_s": rows,
                              "median_s": {k: statistics.median(v) for k, v in rows.items()}}), flush=True)
        finally:
            rs.kill()
            rs.wait()


if __name__ == "__main__":
    main()
