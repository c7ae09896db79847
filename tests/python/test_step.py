#!/usr/bin/env python3
"""The Python client's steps (kvd.step) against a real kvd, with the C++ step worker on the same
daemon: a batch decoded on block credit (most steps make no round trip), KV reused across languages
byte for byte, bad items answered per item, a start that waits keeping its place, and the typed
calls of the contract (admit/acquire apart, peek_prefix_len, objects, sessions).

Usage: test_step.py KVD_BINARY STEP_WORKER_BINARY   (PYTHONPATH=<build>/python:<this dir>)
"""
import os
import shutil
import subprocess
import sys
import tempfile

import grpc

from kvd import Client, KvdError, StepBatch, StepRequest
from kvd_testlib import SMALL_POOL, Daemon, check, finish, slot_bytes

BT, LAYERS, BPT = 4, 2, 16


def touch(client, req, tokens, start, end, verify):
    """Writes (or verifies) the kv_pattern.h bytes of positions [start, end); mismatching bytes."""
    bad = 0
    for pos in range(start, end):
        block = req.blocks[pos // BT]
        off = (pos % BT) * BPT
        for layer in range(LAYERS):
            want = slot_bytes(tokens[pos], pos, layer, BPT)
            view = client.layer_view(req.pool_id, block, layer)
            if verify:
                bad += sum(a != b for a, b in zip(view[off:off + BPT], want))
            else:
                view[off:off + BPT] = want
            view.release()
    return bad


def next_token(prev):
    return (prev * 1103515245 + 12345) % 50000


def main():
    kvd, step_worker = sys.argv[1], sys.argv[2]
    tmp = tempfile.mkdtemp(prefix="kvd-py-step-")
    config = SMALL_POOL.replace("capacity_blocks: 64", "capacity_blocks: 256") + \
        f"tiers:\n  host_bytes: 1048576\n  disk_dir: {tmp}/disk\n"
    daemon = Daemon(kvd, tmp, config)
    try:
        # The C++ step worker computes 4 prompts (they share 8 tokens) and decodes 12 steps.
        out = subprocess.run([step_worker, "--target=" + daemon.target, "--batch=4", "--prompt-len=13",
                              "--shared=8", "--gen=12", "--id=cpp"], capture_output=True, text=True, timeout=60)
        check(out.returncode == 0, f"the C++ step worker ran ({out.stdout.strip()} {out.stderr.strip()})")

        with Client(daemon.target, worker_name="py-step", step_credit_blocks=32) as c:
            # The same prompts (kv_pattern.h tokens: shared 0..7, then 100000 + i*10000 + t).
            prompts = [[t if t < 8 else 100000 + i * 10000 + t for t in range(13)] for i in range(4)]
            reqs = [StepRequest(f"py-{i}") for i in range(4)]
            batch = StepBatch()
            for r, p in zip(reqs, prompts):
                batch.start(r, pool="default", prompt=p, max_new_tokens=40)
            res = c.step(batch)
            check(all(x.ok and not x.waiting for x in res), "four starts in one step")
            cached = [r.cached_tokens for r in reqs]
            check(cached[0] == 12 and all(x >= 8 for x in cached), f"the C++ worker's prefix is reused: {cached}")
            bad = sum(touch(c, r, p, 0, r.cached_tokens, True) for r, p in zip(reqs, prompts))
            check(bad == 0, f"reused KV written by C++ is byte-exact ({bad} bad bytes)")
            for r, p in zip(reqs, prompts):
                touch(c, r, p, r.cached_tokens, len(p), False)
            c.step(StepBatch())  # nothing to do: no round trip
            calls = c.rpc_calls
            toks = [list(p) for p in prompts]
            for _ in range(24):
                b = StepBatch()
                for r in reqs:
                    b.grow(r, 1)
                res = c.step(b)
                check(all(x.ok for x in res), "decode step") if not all(x.ok for x in res) else None
                for r, t in zip(reqs, toks):
                    t.append(next_token(t[-1]))
                    touch(c, r, t, len(t) - 1, len(t), False)
            decode_calls = c.rpc_calls - calls
            check(decode_calls <= 4, f"24 decode steps of 4 requests made {decode_calls} round trips (credit)")
            check(all(r.num_tokens == 37 and len(r.blocks) == 10 for r in reqs), "tables grew locally")
            end = StepBatch()
            for r, t in zip(reqs, toks):
                end.end(r, publish_blocks=len(t) // BT, more_tokens=t[13:])
            res = c.step(end)
            check(all(x.ok for x in res), "every request ended, publishing")
            # The C++ worker cached the same prompt and its first generated tokens: those blocks were
            # already cached or duplicated; every full block is accounted for.
            r0 = res[0]
            check(r0.already_cached >= 3 and r0.kept + r0.already_cached + r0.duplicates + r0.no_parent == 9,
                  f"the end published 9 blocks ({r0.kept}, {r0.already_cached}, {r0.duplicates}, {r0.no_parent})")

            # Bad items get their own status; the good ones in the same step apply.
            a, ghost = StepRequest("alive"), StepRequest("ghost")
            c.step(StepBatch().start(a, pool="default", prompt=list(range(500, 510)), max_new_tokens=4))
            ghost.live, ghost.epoch = True, c.epoch  # a request kvd never saw
            b = StepBatch().grow(ghost, 1).publish(a, [1, 2, 3, 4], 1).grow(a, 1000).grow(a, 2)
            res = c.step(b)
            # The ghost's growth came from credit (placed locally, answered OK); kvd's refusal arrives
            # with the step that told it, on the request.
            check(res[0].ok and ghost.error is not None and ghost.error.code == grpc.StatusCode.NOT_FOUND,
                  f"unknown request: {ghost.error}")
            check(not c.step(StepBatch().grow(ghost, 1))[0].ok, "a request kvd refused takes no more growth")
            check(res[1].code == grpc.StatusCode.INVALID_ARGUMENT, f"publish of other tokens: {res[1].code}")
            check(res[2].code == grpc.StatusCode.OUT_OF_RANGE, f"growth past max_model_len: {res[2].code}")
            check(res[3].ok and a.num_tokens == 12, "the good item in the same step applied")
            c.step(StepBatch().end(a, completed=False))

            # Typed calls.
            check(c.peek_prefix_len("default", prompts[0] + [1]) == 12, "peek_prefix_len")
            check(c.admit("apart", "default", prompts[1], max_new_tokens=2), "admit apart")
            r = c.acquire("apart")
            check(r.cached_tokens >= 8, "acquire apart reuses the prefix")
            r.release()
            c.put_object("default", "vision/x", b"pixels")
            check(c.get_object("default", "vision/x") == b"pixels", "objects round-trip")
            c.delete_object("default", "vision/x")
            try:
                c.get_object("default", "vision/x")
                check(False, "a deleted object is gone")
            except KvdError as e:
                check(e.code == grpc.StatusCode.NOT_FOUND, "a deleted object is NOT_FOUND")
            with c.request("sess-1", "default", list(range(900, 909)), session="s1") as q:
                q.publish(list(range(900, 908)))
            check(any(s.session_id == "s1" for s in c.list_sessions()), "list_sessions sees it")
            check(c.get_session("s1").session_id == "s1", "get_session")
            c.close_session("s1")

            # A step worker's exit gives its credit back; ours goes with the client.
        with Client(daemon.target, worker_name="observer", map_slabs=False) as o:
            rep = o.report()
            check(rep.live_requests == 0 and rep.reserved_bytes == 0,
                  f"nothing held after the workers left ({rep.live_requests}, {rep.reserved_bytes})")
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
