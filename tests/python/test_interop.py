#!/usr/bin/env python3
"""A Python worker and the C++ example worker share KV blocks both ways through a real kvd.

Usage: test_interop.py KVD_BINARY EXAMPLE_WORKER_BINARY   (PYTHONPATH=<build>/python)

The bytes follow client/examples/kv_pattern.h, re-implemented here, so each side verifies the
other's writes byte for byte.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import grpc

from kvd import Client, KvdError

M = (1 << 64) - 1


def kv_byte(token, pos, layer, j):
    x = ((token << 32) ^ (pos << 12) ^ layer ^ ((j >> 3) << 48)) & M
    x = (x + 0x9E3779B97F4A7C15) & M
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M
    x ^= x >> 31
    return (x >> (8 * (j & 7))) & 0xFF


def slot_bytes(token, pos, layer, n):
    return bytes(kv_byte(token, pos, layer, j) for j in range(n))


def touch(client, req, tokens, start, end, verify):
    """Writes (or verifies) the pattern for positions [start, end); returns mismatching bytes."""
    pool = client.pools[req.pool]
    bad = 0
    for pos in range(start, end):
        block = req.blocks[pos // pool.block_tokens]
        off = (pos % pool.block_tokens) * pool.bytes_per_token_per_layer
        for layer in range(pool.num_layers):
            want = slot_bytes(tokens[pos], pos, layer, pool.bytes_per_token_per_layer)
            view = client.layer_view(req.pool, block, layer)
            if verify:
                bad += sum(a != b for a, b in zip(view[off:off + len(want)], want))
            else:
                view[off:off + len(want)] = want
            view.release()
    return bad


def main():
    kvd, worker = sys.argv[1], sys.argv[2]
    tmp = tempfile.mkdtemp(prefix="kvd-py-")
    config = os.path.join(tmp, "kvd.yaml")
    with open(config, "w") as f:
        f.write("pools:\n  - name: default\n    block_tokens: 4\n    num_layers: 2\n"
                "    bytes_per_token_per_layer: 16\n    capacity_blocks: 64\n    max_model_len: 200\n")
    sock = os.path.join(tmp, "kvd.sock")
    ready = os.path.join(tmp, "ready.json")
    daemon = subprocess.Popen([kvd, "--config=" + config, "--listen=unix://" + sock, "--metrics-listen=off",
                               "--ready-file=" + ready, "--log-level=warn"])
    failures = []

    def check(cond, what):
        print(("ok   " if cond else "FAIL ") + what)
        if not cond:
            failures.append(what)

    try:
        for _ in range(500):
            if os.path.exists(ready):
                break
            time.sleep(0.02)
        target = "unix://" + sock
        with Client(target, worker_name="py-test") as c:
            check(c.backend == "host" and c.pools[0].maps[0] is not None, "python client attached and mapped the slab")

            # Python writes, C++ verifies.
            prompt = list(range(300, 322))  # 22 tokens: 5 full blocks
            with c.request("py-a", pool="default", prompt=prompt) as r:
                check(r.cached_tokens == 0, "first python request misses")
                touch(c, r, prompt, 0, r.num_tokens, verify=False)
                check(r.publish(prompt).kept == 5, "python published 5 blocks")
                # numpy views alias the same slab bytes (no copy).
                arr = c.block_array(r.pool, r.blocks[1])
                pool = c.pools[r.pool]
                check(arr.shape == (pool.num_layers, pool.block_tokens, pool.bytes_per_token_per_layer) and
                      bytes(arr[1, 2]) == slot_bytes(prompt[6], 6, 1, pool.bytes_per_token_per_layer),
                      "numpy block view shows the written KV")
                arr[0, 0, 0] ^= 0xFF
                view = c.layer_view(r.pool, r.blocks[1], 0)
                check(view[0] == bytes(arr[0, 0])[0], "a write through numpy lands in the shared slab")
                arr[0, 0, 0] ^= 0xFF
                view.release()
                del arr
            out = subprocess.run([worker, "--target=" + target, "--id=cpp-b", "--prompt-range=300:22"],
                                 capture_output=True, text=True, timeout=30)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            check(out.returncode == 0 and res["cached_tokens"] == 20 and res["mismatches"] == 0
                  and res["verified_bytes"] == 20 * 2 * 16, f"C++ worker verified Python's KV ({res})")

            # C++ writes, Python verifies.
            out = subprocess.run([worker, "--target=" + target, "--id=cpp-c", "--prompt-range=700:13"],
                                 capture_output=True, text=True, timeout=30)
            check(out.returncode == 0, "C++ worker wrote and published")
            prompt2 = list(range(700, 713))
            with c.request("py-d", pool="default", prompt=prompt2) as r:
                check(r.cached_tokens == 12, f"python reuses C++'s 12 tokens (got {r.cached_tokens})")
                check(touch(c, r, prompt2, 0, r.cached_tokens, verify=True) == 0, "python verified C++'s KV")

            # Errors surface as KvdError with the gRPC code.
            try:
                c.request("bad", pool="nope", prompt=[1])
                check(False, "unknown pool is refused")
            except KvdError as e:
                check(e.code == grpc.StatusCode.NOT_FOUND, "unknown pool is NOT_FOUND")

            # An exception inside the block releases the request as interrupted.
            try:
                with c.request("py-e", pool="default", prompt=[1, 2, 3], max_new_tokens=4) as r:
                    r.extend(2)
                    raise RuntimeError("engine failure")
            except RuntimeError:
                pass
            check(c.report().live_requests == 0, "no request leaked")
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=15)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
