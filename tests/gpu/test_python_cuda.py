#!/usr/bin/env python3
"""On a GPU: a Python worker maps kvd's CUDA slabs with cudaIpcOpenMemHandle (ctypes) and shares
blocks both ways with the C++ example worker, bytes verified (the pattern of
client/examples/kv_pattern.h, as in tests/python/test_interop.py). Exits 0 with "skipped" when
kvd cannot use a GPU.

Usage: test_python_cuda.py KVD_BINARY EXAMPLE_WORKER_BINARY   (PYTHONPATH=<build>/python,
       KVD_CUDART=<path to libcudart.so>)
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from test_interop import slot_bytes  # noqa: E402

from kvd import Client, cuda  # noqa: E402

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def main():
    kvd, worker = sys.argv[1], sys.argv[2]
    tmp = tempfile.mkdtemp(prefix="kvd-pycuda-")
    config = os.path.join(tmp, "kvd.yaml")
    with open(config, "w") as f:
        f.write("pools:\n  - name: default\n    block_tokens: 4\n    num_layers: 2\n"
                "    bytes_per_token_per_layer: 16\n    capacity_blocks: 64\n    max_model_len: 200\n")
    sock = os.path.join(tmp, "kvd.sock")
    ready = os.path.join(tmp, "ready.json")
    log = open(os.path.join(tmp, "kvd.log"), "w")
    daemon = subprocess.Popen([kvd, "--config=" + config, "--listen=unix://" + sock, "--metrics-listen=off",
                               "--ready-file=" + ready, "--backend=cuda"], stderr=log)
    try:
        for _ in range(500):
            if os.path.exists(ready) or daemon.poll() is not None:
                break
            time.sleep(0.02)
        if daemon.poll() is not None:
            print("skipped: kvd --backend=cuda did not start (no usable GPU)")
            return 0
        target = "unix://" + sock
        rt = cuda.CudaRuntime()
        with Client(target, worker_name="py-cuda", cuda_runtime=rt) as c:
            pool = c.pools[0]
            check(c.backend == "cuda" and pool.devices[0] is not None and pool.devices[0].ptr,
                  f"python mapped the CUDA slab ({pool.devices[0].size} bytes on device {pool.devices[0].device})")
            prompt = list(range(300, 322))
            n = pool.bytes_per_token_per_layer
            with c.request("py-a", pool="default", prompt=prompt) as r:
                for pos in range(r.num_tokens):
                    for layer in range(pool.num_layers):
                        addr = c.layer_address(r.pool, r.blocks[pos // pool.block_tokens], layer)
                        rt.copy_to_device(addr + (pos % pool.block_tokens) * n, slot_bytes(prompt[pos], pos, layer, n))
                check(r.publish(prompt).kept == 5, "python wrote device memory and published 5 blocks")
            out = subprocess.run([worker, "--target=" + target, "--id=cpp-b", "--prompt-range=300:22"],
                                 capture_output=True, text=True, timeout=60)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            check(out.returncode == 0 and res["cached_tokens"] == 20 and res["mismatches"] == 0,
                  f"C++ worker verified Python's device KV ({res})")
            out = subprocess.run([worker, "--target=" + target, "--id=cpp-c", "--prompt-range=700:13"],
                                 capture_output=True, text=True, timeout=60)
            check(out.returncode == 0, "C++ worker wrote and published on the GPU")
            prompt2 = list(range(700, 713))
            with c.request("py-d", pool="default", prompt=prompt2) as r:
                check(r.cached_tokens == 12, f"python reuses C++'s 12 tokens (got {r.cached_tokens})")
                bad = 0
                for pos in range(r.cached_tokens):
                    for layer in range(pool.num_layers):
                        addr = c.layer_address(r.pool, r.blocks[pos // pool.block_tokens], layer)
                        got = rt.copy_from_device(addr + (pos % pool.block_tokens) * n, n)
                        bad += got != slot_bytes(prompt2[pos], pos, layer, n)
                check(bad == 0, "python read C++'s device KV byte for byte")
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=15)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
