"""The Python client's figure beside kvd_daemon_bench --decode: B requests of 512 tokens grow one
position per step for N steps through Client.step (kvd.step), against Extend(1) per request and
against Python's unary Ping, all in the same run on one kvd (host backend).

  PYTHONPATH=build/python /usr/bin/python3 tests/bench/step_bench.py --kvd build/server/kvd \
      [--batches 1,64,256] [--steps 256]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from kvd import Client, StepBatch, StepRequest  # noqa: E402
from kvd.v1 import kvd_pb2  # noqa: E402
from kvd_testlib import Daemon  # noqa: E402

POOL = ("pools:\n  - name: bench\n    block_tokens: 16\n    num_layers: 32\n    bytes_per_token_per_layer: 64\n"
        "    capacity_blocks: 16384\n    max_model_len: 65552\n")


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(len(v) * q))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvd", required=True)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--steps", type=int, default=256)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvd-stepbench-")
    d = Daemon(a.kvd, tmp, POOL)
    try:
        with Client(d.target, worker_name="py-bench", map_slabs=False, step_credit_blocks=128) as c:
            print("| batch | protocol | steps | p50 per step (us) | p99 (us) | mean (us) | mean / Ping p50 | round trips |")
            print("|---|---|---|---|---|---|---|---|")
            for rnd, b in enumerate(int(x) for x in a.batches.split(",")):
                ping = []
                for _ in range(300):
                    t0 = time.perf_counter()
                    c._rpc("Ping", kvd_pb2.PingRequest())
                    ping.append((time.perf_counter() - t0) * 1e6)
                p50 = statistics.median(ping)
                # Extend(1) per request (fewer steps at large batches: b round trips each).
                reqs = [c.request(f"p{rnd}-{i}", "bench", [rnd * 10**6 + i * 1000 + t for t in range(512)],
                                  max_new_tokens=a.steps + 16) for i in range(b)]
                per = []
                for _ in range(max(8, min(a.steps, 4096 // b))):
                    t0 = time.perf_counter()
                    for r in reqs:
                        r.extend(1)
                    per.append((time.perf_counter() - t0) * 1e6)
                for r in reqs:
                    r.release()
                # Steps.
                sreqs = [StepRequest(f"s{rnd}-{i}") for i in range(b)]
                start = StepBatch()
                for i, r in enumerate(sreqs):
                    start.start(r, "bench", [rnd * 10**6 + 500000 + i * 1000 + t for t in range(512)],
                                max_new_tokens=a.steps + 16)
                c.step(start)
                calls0, st = c.rpc_calls, []
                for _ in range(a.steps):
                    batch = StepBatch()
                    for r in sreqs:
                        batch.grow(r, 1)
                    t0 = time.perf_counter()
                    c.step(batch)
                    st.append((time.perf_counter() - t0) * 1e6)
                trips = c.rpc_calls - calls0
                end = StepBatch()
                for r in sreqs:
                    end.end(r, completed=True)
                c.step(end)
                for name, v, n, t in (("Extend(1) per request", per, len(per), b * len(per)),
                                      ("Client.step", st, len(st), trips)):
                    print(f"| {b} | {name} | {n} | {statistics.median(v):.1f} | {pct(v, 0.99):.1f} | "
                          f"{statistics.fmean(v):.1f} | {statistics.fmean(v) / p50:.2f} | {t} |")
                print(f"| {b} | Ping | | {p50:.1f} | | | 1.00 | |")
    finally:
        d.stop()


if __name__ == "__main__":
    main()
