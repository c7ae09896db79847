#!/usr/bin/env python3
"""Smoke test of the batch engine benchmark's fan-out (tests/bench/batch_engine_bench.py, kvd-reuse-2):
4 requests on a new 64-token context with 8 tokens of their own, arriving together on one engine
with a prefill delay. On kvd with the in-flight wait the context is computed once (64 + 4 x 8
prompt tokens); the in-process baseline (vLLM's rule: no wait) computes it 4 times (4 x 72), and
so does every run under a salt per request. A performance figure is never asserted.

Usage: test_bench_fanout.py KVD_BINARY   (PYTHONPATH=<build>/python:<this dir>)
"""
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "batch_engine_bench.py")


def main():
    kvd = sys.argv[1]
    out = subprocess.run([sys.executable, BENCH, "--kvd", kvd, "--fanout", "4", "--fanout-context", "64",
                          "--fanout-own", "8", "--prefill-tps", "2000", "--wait-in-flight", "5", "--batches", "8",
                          "--max-new", "2"], check=True, capture_output=True, text=True, timeout=120).stdout
    computed = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and cells[0] == "8":
            computed[(cells[1], cells[2])] = int(cells[6])
    assert computed == {("no (salt)", "kvd"): 288, ("no (salt)", "in-process"): 288,
                        ("yes", "kvd"): 96, ("yes", "in-process"): 288}, (computed, out)
    print("ok")


if __name__ == "__main__":
    main()
