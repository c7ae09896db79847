#!/usr/bin/env python3
"""A Python worker and the C++ example worker share KV blocks both ways through a real kvd.

Usage: test_interop.py KVD_BINARY EXAMPLE_WORKER_BINARY   (PYTHONPATH=<build>/python)

The bytes follow client/examples/kv_pattern.h (kvd_testlib.slot_bytes), so each side verifies the
other's writes byte for byte.
"""
import shutil
import sys
import threading
import tempfile

import grpc

from kvd import Client, KvdError
from kvd_testlib import SMALL_POOL, Daemon, check, finish, run_worker, slot_bytes

def touch(client, req, tokens, start, end, verify):
    """Writes (or verifies) the pattern for positions [start, end); returns mismatching bytes."""
    pool = client.pool(req.pool)
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
    daemon = Daemon(kvd, tmp, SMALL_POOL)
    try:
        target = daemon.target
        with Client(target, worker_name="py-test") as c:
            check(c.backend == "host" and c.pools[0].maps[0] is not None, "python client attached and mapped the slab")

            # Python writes, C++ verifies.
            prompt = list(range(300, 322))  # 22 tokens: 5 full blocks
            with c.request("py-a", pool="default", prompt=prompt) as r:
                check(r.cached_tokens == 0, "first python request misses")
                # The writes run on another thread (as on a GPU stream); the fence orders the
                # publish after them (host-synchronized publish, docs/api.md).
                writer = threading.Thread(target=touch, args=(c, r, prompt, 0, r.num_tokens, False))
                fence_calls = []
                c.add_write_fence(lambda: fence_calls.append(1) or writer.join())
                writer.start()
                check(r.publish(prompt).kept == 5, "python published 5 blocks")
                check(fence_calls == [1] and not writer.is_alive(), "publish waited for the write fence, once")
                c.add_write_fence(lambda: (_ for _ in ()).throw(RuntimeError("stream failed")))
                try:
                    r.publish(prompt)
                    check(False, "a failed write fence stops the publish")
                except RuntimeError:
                    check(True, "a failed write fence stops the publish (the engine's error)")
                # numpy views alias the same slab bytes (no copy).
                arr = c.block_array(r.pool, r.blocks[1])
                pool = c.pool(r.pool)
                check(arr.shape == (pool.num_layers, pool.block_tokens, pool.bytes_per_token_per_layer) and
                      bytes(arr[1, 2]) == slot_bytes(prompt[6], 6, 1, pool.bytes_per_token_per_layer),
                      "numpy block view shows the written KV")
                arr[0, 0, 0] ^= 0xFF
                view = c.layer_view(r.pool, r.blocks[1], 0)
                check(view[0] == bytes(arr[0, 0])[0], "a write through numpy lands in the shared slab")
                arr[0, 0, 0] ^= 0xFF
                view.release()
                del arr
            rc, res = run_worker(worker, target, "cpp-b", "300:22")
            check(rc == 0 and res.get("cached_tokens") == 20 and res.get("mismatches") == 0
                  and res.get("verified_bytes") == 20 * 2 * 16, f"C++ worker verified Python's KV ({res})")

            # C++ writes, Python verifies.
            rc, _ = run_worker(worker, target, "cpp-c", "700:13")
            check(rc == 0, "C++ worker wrote and published")
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
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
