#!/usr/bin/env python3
"""Chains continue past duplicates (kvd-reuse-2 item 1) against a real kvd: requests that compute
the same prefix at once each get their own blocks after it cached, whoever ends first, through
per-request calls and steps; outcomes are counted once; a client naming a block that is not its
own is refused; a worker that goes away holding copies of duplicates leaks nothing.

Usage: test_publish_order.py KVD_BINARY   (PYTHONPATH=<build>/python:<this dir>)
"""
import shutil
import sys
import tempfile
import time

import grpc

from kvd import Client, KvdError, StepBatch, StepRequest
from kvd.v1 import kvd_pb2
from kvd_testlib import Daemon, check, finish, slot_bytes

BT, LAYERS, BPT = 16, 2, 16
POOL = ("pools:\n  - name: default\n    block_tokens: 16\n    num_layers: 2\n"
        "    bytes_per_token_per_layer: 16\n    capacity_blocks: 256\n    max_model_len: 1024\n")


def write(client, req, tokens, start, end):
    for pos in range(start, end):
        block, off = req.blocks[pos // BT], (pos % BT) * BPT
        for layer in range(LAYERS):
            view = client.layer_view(req.pool_id, block, layer)
            view[off:off + BPT] = slot_bytes(tokens[pos], pos, layer, BPT)
            view.release()


def bad_bytes(client, req, tokens, end):
    bad = 0
    for pos in range(end):
        block, off = req.blocks[pos // BT], (pos % BT) * BPT
        for layer in range(LAYERS):
            view = client.layer_view(req.pool_id, block, layer)
            bad += sum(a != b for a, b in zip(view[off:off + BPT], slot_bytes(tokens[pos], pos, layer, BPT)))
            view.release()
    return bad


def owned(client):
    return client.report().pools[0].owned_blocks


def main():
    kvd = sys.argv[1]
    tmp = tempfile.mkdtemp(prefix="kvd-py-publish-order-")
    daemon = Daemon(kvd, tmp, POOL)
    try:
        with Client(daemon.target, worker_name="py-order") as c:
            # Two requests share a 256-token system prompt and differ after it, both running at once.
            system = [7000 + t for t in range(256)]
            pa = system + [100000 + t for t in range(65)]  # 321 tokens: 20 full blocks
            pb = system + [200000 + t for t in range(48)]  # 304 tokens: 19 full blocks
            ra = c.request("a", "default", pa, max_new_tokens=4)
            rb = c.request("b", "default", pb, max_new_tokens=4)
            check(ra.cached_tokens == 0 and rb.cached_tokens == 0, "both start on nothing cached")
            write(c, ra, pa, 0, len(pa))
            write(c, rb, pb, 0, len(pb))
            dup0 = c.report().duplicate_blocks
            ea = ra.end(publish_blocks=20)
            check(ea.kept == 20, f"the first to end keeps its 20 blocks ({ea.kept})")
            eb = rb.end(publish_blocks=19)
            check((eb.duplicates, eb.kept, eb.no_parent) == (16, 3, 0),
                  f"the second's End: duplicates for the shared blocks, kept for its own "
                  f"(duplicates {eb.duplicates}, kept {eb.kept}, no_parent {eb.no_parent})")
            check(c.report().duplicate_blocks - dup0 == 16, "16 duplicates counted")
            with c.request("b-again", "default", pb) as rc:
                check(rc.cached_tokens == 288, f"the second prompt is found whole less the last token "
                                               f"({rc.cached_tokens} of 304)")
                check(bad_bytes(c, rc, pb, rc.cached_tokens) == 0, "its KV is what the requests wrote")
            check(owned(c) == 0, f"the copies of the duplicates were freed ({owned(c)} owned)")

            # Publish while running, then End: each position's outcome is counted once.
            system2 = [8000 + t for t in range(64)]
            px, py = system2 + [300000 + t for t in range(33)], system2 + [400000 + t for t in range(33)]
            rx = c.request("x", "default", px, max_new_tokens=8)
            ry = c.request("y", "default", py, max_new_tokens=8)
            write(c, rx, px, 0, len(px))
            write(c, ry, py, 0, len(py))
            check(rx.end(publish_blocks=6).kept == 6, "x keeps its 6 blocks")
            dup0 = c.report().duplicate_blocks
            pub = ry.publish(py[:96])
            check(list(pub.outcomes) == [kvd_pb2.PUBLISH_DUPLICATE] * 4 + [kvd_pb2.PUBLISH_KEPT] * 2,
                  f"y's publish continues past its duplicates: {list(pub.outcomes)}")
            # A careless client names another block where y's table now holds the cached one.
            wrong = list(ry.blocks)
            ry.blocks[1] = rx.blocks[5]
            try:
                ry.publish(py[:96])
                check(False, "a publish naming a block that is not y's is refused")
            except KvdError as e:
                check(e.code == grpc.StatusCode.INVALID_ARGUMENT, f"a foreign block is INVALID_ARGUMENT ({e.code})")
            ry.blocks = wrong
            again = ry.publish(py[:96])  # names y's own copies, as its engine's table does
            check(list(again.outcomes) == [kvd_pb2.PUBLISH_ALREADY_CACHED] * 6,
                  f"a repeat publish answers already_cached: {list(again.outcomes)}")
            ey = ry.end(publish_blocks=6)
            check((ey.already_cached, ey.duplicates, ey.no_parent) == (6, 0, 0),
                  f"y's End counts nothing again ({ey.already_cached}, {ey.duplicates}, {ey.no_parent})")
            check(c.report().duplicate_blocks - dup0 == 4, "4 duplicates counted once")
            check(c.peek_prefix_len("default", py + [1]) == 96, "y's own blocks are cached")

            # Sixteen requests started in one step with a shared prefix, ended in one step.
            shared = [9000 + t for t in range(32)]
            prompts = [shared + [500000 + 1000 * i + t for t in range(33)] for i in range(16)]  # 4 full blocks
            reqs = [StepRequest(f"fan-{i}") for i in range(16)]
            batch = StepBatch()
            for r, p in zip(reqs, prompts):
                batch.start(r, pool="default", prompt=p, max_new_tokens=4)
            res = c.step(batch)
            check(all(x.ok and not x.waiting for x in res), "sixteen starts in one step")
            check(all(r.cached_tokens == 0 for r in reqs), "none finds the prefix the others compute")
            for r, p in zip(reqs, prompts):
                write(c, r, p, 0, len(p))
            end = StepBatch()
            for r in reqs:
                end.end(r, publish_blocks=4)
            res = c.step(end)
            check(all(x.ok for x in res), "sixteen ends in one step")
            check(all((x.duplicates, x.kept, x.no_parent) == (2, 2, 0) for x in res[1:]),
                  "every end after the first: 2 duplicates, 2 kept")
            found = [c.peek_prefix_len("default", p) for p in prompts]
            check(found == [64] * 16, f"every request's own blocks are cached: {found}")

            # A worker that goes away holding copies of duplicates leaks nothing.
            system3 = [11000 + t for t in range(32)]
            pw, pz = system3 + [600000 + t for t in range(33)], system3 + [700000 + t for t in range(33)]
            base = owned(c)  # c's block credit from its steps
            other = Client(daemon.target, worker_name="py-gone")
            rz = other.request("z", "default", pz, max_new_tokens=8)
            rw = c.request("w", "default", pw, max_new_tokens=8)
            write(other, rz, pz, 0, len(pz))
            write(c, rw, pw, 0, len(pw))
            check(rw.end(publish_blocks=4).kept == 4, "w keeps its 4 blocks")
            pubz = rz.publish(pz[:64])
            check(list(pubz.outcomes) == [kvd_pb2.PUBLISH_DUPLICATE] * 2 + [kvd_pb2.PUBLISH_KEPT] * 2,
                  f"z's publish continues past its duplicates: {list(pubz.outcomes)}")
            check(owned(c) - base == 3, f"z holds its 2 copies and its partial block ({owned(c) - base} owned)")
            other.close()  # without ending z
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (c.report().live_requests != 0 or owned(c) != base):
                time.sleep(0.05)
            r = c.report()
            check(r.live_requests == 0 and owned(c) == base,
                  f"nothing live or owned after the worker left ({r.live_requests} live, {owned(c) - base} owned)")
            check(c.peek_prefix_len("default", pz) == 64, "what z published stays cached")
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
