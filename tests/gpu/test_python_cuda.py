#!/usr/bin/env python3
"""On a GPU: a Python worker maps kvd's CUDA slabs with cudaIpcOpenMemHandle (ctypes) and shares
blocks both ways with the C++ example worker, bytes verified (the pattern of
client/examples/kv_pattern.h, tests/python/kvd_testlib.py). Exits 0 with "skipped" when
kvd cannot use a GPU.

Usage: test_python_cuda.py KVD_BINARY EXAMPLE_WORKER_BINARY   (PYTHONPATH=<build>/python,
       KVD_CUDART=<path to libcudart.so>)
"""
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from kvd_testlib import SMALL_POOL, Daemon, check, finish, run_worker, slot_bytes  # noqa: E402

from kvd import Client, cuda  # noqa: E402


def main():
    kvd, worker = sys.argv[1], sys.argv[2]
    tmp = tempfile.mkdtemp(prefix="kvd-pycuda-")
    with open(os.path.join(tmp, "kvd.log"), "w") as log:
        daemon = Daemon(kvd, tmp, SMALL_POOL, extra=["--backend=cuda"], stderr=log)
    try:
        if not daemon.started:
            print("skipped: kvd --backend=cuda did not start (no usable GPU)")
            return 0
        target = daemon.target
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
            rc, res = run_worker(worker, target, "cpp-b", "300:22")
            check(rc == 0 and res.get("cached_tokens") == 20 and res.get("mismatches") == 0,
                  f"C++ worker verified Python's device KV ({res})")
            rc, _ = run_worker(worker, target, "cpp-c", "700:13")
            check(rc == 0, "C++ worker wrote and published on the GPU")
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
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
