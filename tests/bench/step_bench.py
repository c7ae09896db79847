"""The Python client's figure beside kvd_daemon_bench --decode: B requests of 512 tokens grow one
position per step for N steps through Client.step (kvd.step), against Extend(1) per request and
against Python's unary Ping, all in the same run on one kvd (host backend).

  PYTHONPATH=build/python /usr/bin/python3 tests/bench/step_bench.py --kvd build/server/kvd \
      [--batches 1,64,256] [--steps 256]

--starts N instead times N steps of three 256-token starts (then their ends), on the step lane and
over gRPC, interleaved in rounds: sent back to back, and after 20 ms of sleep (how an engine comes
to a step, after its model ran).
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
    ap.add_argument("--starts", type=int, default=0)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvd-stepbench-")
    d = Daemon(a.kvd, tmp, POOL)
    try:
        if a.starts > 0:
            return starts(d.target, a.starts)
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


def starts(target, n, rounds=4):
    """Steps of three 256-token starts on the step lane against gRPC, warm and after a sleep."""
    times = {}
    for rnd in range(rounds):
        for lane in (True, False):
            with Client(target, worker_name="py-bench", map_slabs=False, step_credit_blocks=32, step_lane=lane) as c:
                for cold in (False, True):
                    v = times.setdefault((lane, cold), [])
                    for i in range(n):
                        reqs = [StepRequest(f"r{rnd}{lane}{cold}-{i}-{k}") for k in range(3)]
                        batch = StepBatch()
                        for k, r in enumerate(reqs):
                            batch.start(r, "bench", [rnd * 10**7 + i * 1000 + k * 300 + t for t in range(256)] +
                                        [int(lane), int(cold)])
                        if cold:
                            time.sleep(0.02)
                        t0 = time.perf_counter()
                        res = c.step_submit(batch).result()
                        v.append((time.perf_counter() - t0) * 1e6)
                        assert all(x.ok for x in res), [x.message for x in res]
                        end = StepBatch()
                        for r in reqs:
                            end.end(r)
                        c.step(end)
                    assert (c._stepper.lane is not None) == lane
    print("| path | when | steps | p50 (us) | p90 (us) |")
    print("|---|---|---|---|---|")
    for (lane, cold), v in times.items():
        print(f"| {'step lane' if lane else 'gRPC'} | {'after 20 ms of sleep' if cold else 'back to back'} | "
              f"{len(v)} | {statistics.median(v):.0f} | {pct(v, 0.9):.0f} |")


if __name__ == "__main__":
    main()
