"""The continuous-batching reference engine (kvd.engine.batch) replaying a Mooncake trace with its
arrivals: W worker processes on one kvd (steps, block credit, one shared prefix cache) against the
same engine with an in-process block manager per worker (kvd.engine.local_blocks: its own free
list and prefix cache, the pool split W ways, no daemon). Once with a salt per request (no reuse:
the protocol's cost alone) and once with reuse. Reports output throughput, TTFT p50, time per
output token p50 and prompt tokens computed; --plot writes an SVG of TTFT p50 and throughput over
the batch limit (max running requests).

  PYTHONPATH=build/python /usr/bin/python3 tests/bench/batch_engine_bench.py --kvd build/server/kvd \\
      --trace ../shared/data/mooncake-fast25/conversation_trace.jsonl [--workers 2] [--requests 200] \\
      [--time-scale 50] [--batches 4,16,32] [--plot docs/batch_engine.svg]

Scaling to the PatternModel (kvd.engine.batch): one trace hash id (512 tokens) becomes one 8-token
block whose tokens derive from the id, so prompts sharing hash ids share prefixes as in the trace;
prompt = ceil(input_length / scale) capped to whole hash-id blocks; output = min(output_length /
scale, max_new); arrival = timestamp / time_scale.

Overlap (kvd-reuse-2): --prefill-tps F makes the model take 1/F s per position it computes (one
engine per worker: its prefills queue, so a prefix computed twice costs its time twice);
--wait-in-flight S gives kvd's engine BatchEngine(wait_in_flight_s=S) (a start whose prefix another
request computes is deferred while there is other work); --chains stop runs the in-process
baseline under the old duplicate rule (continue: vLLM's, the default). --fanout N replaces the
trace with an agent fan-out: N requests on a new shared context of --fanout-context tokens plus
--fanout-own of their own, all arriving at 0, on one worker; the report adds the time to the last
first token. For example (one engine, 8 x (512 + 32) tokens at 20,000 tokens/s):

  PYTHONPATH=build/python /usr/bin/python3 tests/bench/batch_engine_bench.py --kvd build/server/kvd \
      --fanout 8 --fanout-context 512 --fanout-own 32 --prefill-tps 20000 --wait-in-flight 5 --batches 16
"""
import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))

BLOCK = 8
POOL = ("pools:\n  - name: default\n    block_tokens: 8\n    num_layers: 2\n    bytes_per_token_per_layer: 16\n"
        "    capacity_blocks: {cap}\n    max_model_len: 1024\n")


def load(trace, n, scale, max_prompt, max_new, time_scale):
    out = []
    with open(trace) as f:
        for i, line in enumerate(f):
            if len(out) == n:
                break
            r = json.loads(line)
            length = max(2, min(-(-r["input_length"] // scale), max_prompt, len(r["hash_ids"]) * BLOCK))
            prompt = [(h * 131 + j * 7 + 1) % 50000 for h in r["hash_ids"] for j in range(BLOCK)][:length]
            out.append((r["timestamp"] / 1000.0 / time_scale, f"t{i}", prompt,
                        max(1, min(r["output_length"] // scale, max_new))))
    t0 = out[0][0] if out else 0
    return [(t - t0, rid, p, m) for t, rid, p, m in out]


def fanout(n, context, own, max_new):
    """N requests arriving together: a new shared context, then each one's own tokens."""
    ctx = [(j * 7919 + 13) % 50000 for j in range(context)]
    return [(0.0, f"f{k}", ctx + [(k * 104729 + j * 31 + 5) % 50000 for j in range(own)], max_new)
            for k in range(n)]


class DelayedModel:
    """The PatternModel taking 1 / tps seconds per position it computes (a prefill delay), as a
    device would. `--model-delay` says how:
    - `device` (the default since kvd-reuse-2 item 6's eighth pass): the work accrues on a
      timeline, the PatternModel's own Python compute (its KV bytes, its digests) runs inside
      that time, and the call sleeps out the rest. A device computes while the host waits; the
      Python stand-in for that compute used to run after the sleep, on the host's cores, adding
      its time to every step, and more wherever another process (kvd) shared the two cores.
    - `queued`: the same timeline, the Python compute after the sleep (item 6's fourth to
      seventh passes). What one sleep overshoots (the kernel's timer slack, ~50-100 us here) is
      taken off the next call in both.
    - `per-call`: one sleep of the nominal time per call, every overshoot added (the tables
      before item 6's fourth pass)."""

    def __init__(self, tps, mode="device"):
        from kvd.engine.batch import PatternModel
        self.inner, self.tps, self.mode = PatternModel(), tps, mode
        self.done_at = 0.0  # when the work queued so far is done

    def forward(self, kv, tokens, start, end):
        work = (end - start) / self.tps
        if self.mode == "per-call":
            time.sleep(work)
            return self.inner.forward(kv, tokens, start, end)
        self.done_at = max(self.done_at, time.perf_counter()) + work
        if self.mode == "queued":
            self._sleep_out()
            return self.inner.forward(kv, tokens, start, end)
        rows = self.inner.forward(kv, tokens, start, end)
        self._sleep_out()
        return rows

    def _sleep_out(self):
        """Sleeps until the work queued so far is done (at once when it is)."""
        left = self.done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def forget(self, kv):
        return self.inner.forget(kv)

    def sample(self, row):
        return self.inner.sample(row)


def child(args):
    from kvd import Client
    from kvd.engine.batch import BatchEngine
    from kvd.engine.local_blocks import LocalBlocks
    with open(args.child_work) as f:
        work = [tuple(x) for x in json.load(f)]
    salt = args.salt
    arrivals = [(t, rid, p, m, rid if salt else "") for t, rid, p, m in work]
    if args.target == "local":
        client = LocalBlocks(block_tokens=BLOCK, num_layers=2, bytes_per_token_per_layer=16,
                             capacity_blocks=args.capacity_blocks, max_model_len=1024, chains=args.chains)
        wait = {}
    else:
        if args.client == "native":
            from kvd.native import NativeClient as Client
        client = Client(args.target, worker_name="bench") if args.client == "native" else \
            Client(args.target, worker_name="bench", step_lane=args.client != "python-grpc")
        wait = {"wait_in_flight_s": args.wait_in_flight} if args.wait_in_flight > 0 else {}
    model = DelayedModel(args.prefill_tps, args.model_delay) if args.prefill_tps > 0 else None
    e = BatchEngine(client, max_running=args.max_running, chunk=64, token_budget=512, hold_s=args.hold_s,
                    overlap=not args.no_overlap, model=model, carry=args.client != "python-nocarry", **wait)
    t_run = time.perf_counter()  # CLOCK_MONOTONIC: comparable across the workers
    res = e.run(arrivals)
    print(json.dumps({"results": list(res.values()), "prefill_tokens": e.prefill_tokens, "steps": e.steps,
                      "run": (t_run, time.perf_counter()),
                      "rpc_calls": client.rpc_calls, "rpc_s": getattr(client, "rpc_seconds", 0.0)}))
    return 0


def run_mode(args, tmp, mode, salt, max_running, reqs, client="python"):
    daemon = None
    target, cap = "local", args.capacity_blocks // args.workers
    if mode == "kvd":
        from kvd_testlib import Daemon
        daemon = Daemon(args.kvd, tmp, POOL.format(cap=args.capacity_blocks), name=f"kvd-{salt}-{max_running}")
        target = daemon.target
    try:
        files = []
        for w in range(args.workers):
            path = os.path.join(tmp, f"{mode}-{salt}-{max_running}-{w}.json")
            with open(path, "w") as f:
                json.dump(reqs[w::args.workers], f)
            files.append(path)
        start = time.perf_counter()
        cpu0 = _children_cpu()
        procs = [subprocess.Popen([sys.executable, __file__, "--child-work", p, "--target", target,
                                   "--capacity-blocks", str(cap), "--max-running", str(max_running),
                                   "--hold-s", str(args.hold_s), "--prefill-tps", str(args.prefill_tps),
                                   "--wait-in-flight", str(args.wait_in_flight), "--chains", args.chains,
                                   "--client", client, "--model-delay", args.model_delay]
                                  + (["--no-overlap"] if args.no_overlap else [])
                                  + (["--salt"] if salt else []), stdout=subprocess.PIPE, text=True) for p in files]
        results, prefill, path, spans = [], 0, {"steps": 0, "rpc_calls": 0, "rpc_s": 0.0}, []
        for p in procs:
            out, _ = p.communicate(timeout=3600)
            if p.returncode != 0:
                raise RuntimeError(f"a worker failed ({p.returncode})")
            d = json.loads(out.strip().splitlines()[-1])
            results += d["results"]
            spans.append(d["run"])
            prefill += d["prefill_tokens"]
            for k in path:  # the step path: steps, round trips, seconds the engine waited on them
                path[k] += d.get(k, 0)
        elapsed = time.perf_counter() - start
        cpu1 = _children_cpu()  # the workers', reaped above
    finally:
        if daemon is not None:
            daemon.stop()
    kvd_cpu = _children_cpu() - cpu1 if daemon is not None else 0.0  # the daemon's, reaped by stop()
    out_tokens = sum(len(r["tokens"]) for r in results)
    # Time per output token: first to last token sampled. Until kvd-reuse-2 item 6 it ran to the
    # request's end (done_s), which the engine records once the step after the last token is
    # answered: in-process before that step's model runs, on kvd with overlap after it (the model
    # runs while the step is in flight), so every kvd request was charged one step of other
    # requests' work (`tpot_end`, kept for comparison with the older tables).
    many = [r for r in results if len(r["tokens"]) > 1]
    tpot = [((r.get("last_token_s") or r["done_s"]) - r["ttft_s"]) / (len(r["tokens"]) - 1) for r in many]
    tpot_end = [(r["done_s"] - r["ttft_s"]) / (len(r["tokens"]) - 1) for r in many]
    # Throughput over the engines' runs, from the first worker's first step to the last one's last
    # answer: a worker's start (imports, connecting) and exit are outside it, as they are outside
    # a serving engine's steady state; `throughput_wall_tok_s` counts from spawning the workers to
    # reaping them (what the tables before item 6's eighth pass called throughput).
    run_s = max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans)
    return {"mode": mode, "reuse": not salt, "max_running": max_running, "requests": len(results),
            "throughput_tok_s": out_tokens / run_s, "throughput_wall_tok_s": out_tokens / elapsed, "run_s": run_s,
            "ttft_p50_ms": statistics.median(r["ttft_s"] for r in results) * 1e3,
            "tpot_p50_ms": statistics.median(tpot) * 1e3 if tpot else 0.0,
            "tpot_end_p50_ms": statistics.median(tpot_end) * 1e3 if tpot_end else 0.0, "prefill_computed": prefill,
            "cached_tokens": sum(r["cached_tokens"] or 0 for r in results), "elapsed_s": elapsed,
            "last_first_token_ms": max((r["ttft_s"] or 0 for r in results), default=0) * 1e3,
            # TTFT in two parts: arrival to the start answered, then to the first token.
            "started_p50_ms": statistics.median(r["started_s"] for r in results) * 1e3,
            "started_to_first_p50_ms": statistics.median(r["ttft_s"] - r["started_s"] for r in results) * 1e3,
            "workers_cpu_s": cpu1 - cpu0, "kvd_cpu_s": kvd_cpu, **path,
            # Each request's timeline (for --runs-out): arrival to its start sent, answered, first token.
            "per_request": [{k: r.get(k) for k in ("id", "sent_s", "sent_idle", "start_steps", "started_s", "ttft_s")}
                            for r in results]}


def _children_cpu():
    """User and system CPU seconds of this process's reaped children."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def median_rows(runs):
    """One row per (max running, reuse, mode): each figure's median over the repeated runs; prints
    the noise floor (in-process, odd runs against even runs)."""
    rows = []
    for key in dict.fromkeys((r["max_running"], r["reuse"], r["mode"]) for r in runs):
        same = [r for r in runs if (r["max_running"], r["reuse"], r["mode"]) == key]
        row = dict(same[0])
        for k, v in same[0].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("max_running", "rep"):
                row[k] = statistics.median(r[k] for r in same)
        rows.append(row)
        if key[2] == "in-process" and len(same) >= 2:
            odd, even = same[1::2], same[0::2]
            print(f"noise floor, max running {key[0]}, reuse {key[1]}: in-process odd/even runs: TPOT p50 "
                  f"{statistics.median(r['tpot_p50_ms'] for r in odd) / statistics.median(r['tpot_p50_ms'] for r in even):.3f}, "
                  f"TTFT p50 {statistics.median(r['ttft_p50_ms'] for r in odd) / statistics.median(r['ttft_p50_ms'] for r in even):.3f}")
    return rows


def ratio_interval(runs, b, reuse, kmode, key, n=2000, seed=1):
    """The ratio of medians kvd / in-process for one figure, with a 90 % bootstrap interval:
    the repetitions are resampled in pairs (a kvd run and the in-process run beside it), so the
    interval says how far the ratio could move with other draws of the same noise."""
    pairs = []
    for rep in sorted({r["rep"] for r in runs}):
        k = [r[key] for r in runs if (r["max_running"], r["reuse"], r["mode"], r["rep"]) == (b, reuse, kmode, rep)]
        l = [r[key] for r in runs if (r["max_running"], r["reuse"], r["mode"], r["rep"]) == (b, reuse, "in-process", rep)]
        if k and l:
            pairs.append((k[0], l[0]))
    def ratio(ps):
        return statistics.median(p[0] for p in ps) / max(statistics.median(p[1] for p in ps), 1e-9)
    rng = random.Random(seed)
    boot = sorted(ratio([rng.choice(pairs) for _ in pairs]) for _ in range(n))
    return ratio(pairs), boot[int(0.05 * n)], boot[int(0.95 * n) - 1]


def matched_requests(runs, b, reuse, kmode):
    """Each request against itself across the two modes (medians over the runs), TTFT split at the
    start's answer: (TTFT, start answered, answer to first token) differences kvd - in-process in
    ms, as medians over the requests, and the share of starts sent to an idle engine (nothing else
    to compute in their step: the round trip is not hidden) in kvd's runs."""
    by = {}
    for r in runs:
        if r["max_running"] == b and r["reuse"] == reuse and r["mode"] in (kmode, "in-process"):
            for q in r.get("per_request", ()):
                by.setdefault(q["id"], {}).setdefault(r["mode"], []).append(q)
    diffs = ([], [], [])
    idle = [q["sent_idle"] for m in by.values() for q in m.get(kmode, ()) if q["sent_idle"] is not None]
    for m in by.values():
        k, l = m.get(kmode), m.get("in-process")
        if not k or not l:
            continue
        for out, f in zip(diffs, (lambda q: q["ttft_s"], lambda q: q["started_s"],
                                  lambda q: q["ttft_s"] - q["started_s"])):
            out.append((statistics.median(map(f, k)) - statistics.median(map(f, l))) * 1e3)
    if not diffs[0]:
        return None
    return tuple(statistics.median(d) for d in diffs) + (sum(idle) / max(len(idle), 1),)


def plot(rows, path):
    """A small SVG: TTFT p50 and throughput over max_running, kvd against in-process, with reuse."""
    sel = [r for r in rows if r["reuse"]]
    xs = sorted({r["max_running"] for r in sel})
    w, h, pad = 640, 260, 50
    def series(mode, key):
        return [next(r[key] for r in sel if r["mode"] == mode and r["max_running"] == x) for x in xs]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * w}" height="{h}" font-family="sans-serif" font-size="12">']
    for k, (key, title) in enumerate((("ttft_p50_ms", "TTFT p50 (ms)"), ("throughput_tok_s", "throughput (tokens/s)"))):
        ox = k * w
        vals = series("kvd", key) + series("in-process", key)
        top = max(vals) * 1.1 or 1
        parts.append(f'<text x="{ox + pad}" y="20">{title} over max running requests (with reuse)</text>')
        parts.append(f'<line x1="{ox + pad}" y1="{h - pad}" x2="{ox + w - 20}" y2="{h - pad}" stroke="black"/>')
        parts.append(f'<line x1="{ox + pad}" y1="{h - pad}" x2="{ox + pad}" y2="30" stroke="black"/>')
        for i, x in enumerate(xs):
            px = ox + pad + (i + 0.5) * (w - pad - 20) / len(xs)
            parts.append(f'<text x="{px - 8}" y="{h - pad + 16}">{x}</text>')
        parts.append(f'<text x="{ox + 5}" y="40">{top:.0f}</text>')
        for mode, color in (("kvd", "#1f77b4"), ("in-process", "#d62728")):
            pts = []
            for i, v in enumerate(series(mode, key)):
                px = ox + pad + (i + 0.5) * (w - pad - 20) / len(xs)
                py = h - pad - v / top * (h - pad - 30)
                pts.append(f"{px:.1f},{py:.1f}")
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{" ".join(pts)}"/>')
            parts.append(f'<text x="{ox + w - 110}" y="{45 if mode == "kvd" else 60}" fill="{color}">{mode}</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvd")
    ap.add_argument("--trace")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--scale", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--time-scale", type=float, default=50.0)
    ap.add_argument("--capacity-blocks", type=int, default=4096)
    ap.add_argument("--batches", default="16")
    ap.add_argument("--plot")
    ap.add_argument("--child-work")
    ap.add_argument("--target")
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--salt", action="store_true")
    # The Python step path (kvd.engine.batch): ends and publishes held back up to this long, and the
    # model run while the step is in flight; --hold-s 0 --no-overlap is the synchronous path.
    ap.add_argument("--hold-s", type=float, default=0.05)
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--prefill-tps", type=float, default=0.0)
    ap.add_argument("--wait-in-flight", type=float, default=0.0)
    ap.add_argument("--chains", choices=("continue", "stop"), default="continue")
    ap.add_argument("--fanout", type=int, default=0)
    ap.add_argument("--fanout-context", type=int, default=512)
    ap.add_argument("--fanout-own", type=int, default=32)
    # kvd's step path in the workers: "python" (kvd.Client, steps on the step lane), "python-grpc"
    # (the same, steps over gRPC), "python-nocarry" (BatchEngine(carry=False): every step's starts
    # answered within it), "native" (kvd.native,
    # the C++ client under pybind11); "python,native" runs both beside the in-process baseline.
    ap.add_argument("--clients", default="python")
    ap.add_argument("--model-delay", choices=("device", "queued", "per-call"), default="device")
    ap.add_argument("--client", default="python", help=argparse.SUPPRESS)  # a worker's
    # Runs every row's modes this many times, interleaved, and reports each figure's median over
    # the runs, the ratios of those medians, and the noise floor: the in-process baseline's
    # median over its odd runs against its even runs (single runs scatter by up to +-30 % in TPOT).
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--runs-out", help="writes every run's figures as JSON (for analysis after)")
    args = ap.parse_args()
    if args.child_work:
        return child(args)
    if args.fanout > 0:
        args.workers = 1
        reqs = fanout(args.fanout, args.fanout_context, args.fanout_own, args.max_new)
    else:
        reqs = load(args.trace, args.requests, args.scale, args.max_prompt, args.max_new, args.time_scale)
    rows = []
    kvd_modes = [{"python": "kvd", "python-grpc": "kvd-grpc", "python-nocarry": "kvd-nocarry",
                  "native": "kvd-native"}[c]
                 for c in args.clients.split(",")]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeat):
            for b in (int(x) for x in args.batches.split(",")):
                for salt in (True, False):
                    for mode in kvd_modes + ["in-process"]:  # interleaved
                        client = {"kvd-native": "native", "kvd-nocarry": "python-nocarry",
                                  "kvd-grpc": "python-grpc"}.get(mode, "python")
                        runs.append(run_mode(args, tmp, "local" if mode == "in-process" else "kvd", salt, b, reqs, client))
                        runs[-1].update(mode=mode, rep=rep)
    rows = median_rows(runs) if args.repeat > 1 else runs
    print("| max running | reuse | mode | throughput (tok/s) | TTFT p50 (ms) | TPOT p50 (ms) | prompt tokens computed |"
          " tokens reused | last first token (ms) |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['max_running']} | {'yes' if r['reuse'] else 'no (salt)'} | {r['mode']} | {r['throughput_tok_s']:.0f} |"
              f" {r['ttft_p50_ms']:.1f} | {r['tpot_p50_ms']:.2f} | {r['prefill_computed']} | {r['cached_tokens']} |"
              f" {r['last_first_token_ms']:.0f} |")
    for b in sorted({r["max_running"] for r in rows}):
        for reuse, kmode in ((x, m) for x in (False, True) for m in kvd_modes):
            k = next(r for r in rows if r["max_running"] == b and r["reuse"] == reuse and r["mode"] == kmode)
            l = next(r for r in rows if r["max_running"] == b and r["reuse"] == reuse and r["mode"] == "in-process")
            print(f"max running {b}, reuse {reuse}: throughput {kmode}/in-process {k['throughput_tok_s'] / l['throughput_tok_s']:.3f} "
                  f"(spawn to reap {k['throughput_wall_tok_s'] / l['throughput_wall_tok_s']:.3f}), "
                  f"TTFT's start answered p50 {k['started_p50_ms']:.2f} vs {l['started_p50_ms']:.2f} ms, "
                  f"TPOT p50 {k['tpot_p50_ms'] / max(l['tpot_p50_ms'], 1e-9):.3f} (to the end "
                  f"{k['tpot_end_p50_ms'] / max(l['tpot_end_p50_ms'], 1e-9):.3f}), TTFT p50 {k['ttft_p50_ms'] / max(l['ttft_p50_ms'], 1e-9):.3f}, "
                  f"prefill computed {k['prefill_computed']} vs {l['prefill_computed']}; kvd's step path: "
                  f"{k['rpc_calls'] / max(k['steps'], 1):.2f} round trips a step, "
                  f"{k['rpc_s'] * 1e6 / max(k['steps'], 1):.0f} us a step waited on them; CPU s: workers "
                  f"{k['workers_cpu_s']:.2f} vs {l['workers_cpu_s']:.2f}, kvd {k['kvd_cpu_s']:.2f}, in a run of "
                  f"{k['elapsed_s']:.2f} vs {l['elapsed_s']:.2f} s")
    print("\nEach request against itself, kvd - in-process (medians over the runs, then over the requests):")
    for b in sorted({r["max_running"] for r in rows}):
        for reuse, kmode in ((x, m) for x in (False, True) for m in kvd_modes):
            m = matched_requests(runs, b, reuse, kmode)
            if m is not None:
                print(f"max running {b}, reuse {reuse}, {kmode}: TTFT {m[0]:+.2f} ms, of it start answered {m[1]:+.2f} ms "
                      f"and answer to first token {m[2]:+.2f} ms; starts sent to an idle engine {m[3] * 100:.0f} %")
    if args.repeat >= 4:
        print("\nRatios of medians kvd / in-process with 90 % bootstrap intervals over the paired runs:")
        for b in sorted({r["max_running"] for r in rows}):
            for reuse, kmode in ((x, m) for x in (False, True) for m in kvd_modes):
                parts = []
                for key, name in (("throughput_tok_s", "throughput"), ("tpot_p50_ms", "TPOT p50"), ("ttft_p50_ms", "TTFT p50")):
                    r, lo, hi = ratio_interval(runs, b, reuse, kmode, key)
                    parts.append(f"{name} {r:.3f} [{lo:.3f}, {hi:.3f}]")
                print(f"max running {b}, reuse {reuse}, {kmode}: " + ", ".join(parts))
    if args.runs_out:
        with open(args.runs_out, "w") as f:
            json.dump(runs, f)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
