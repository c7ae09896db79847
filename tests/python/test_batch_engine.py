#!/usr/bin/env python3
"""The continuous-batching reference engine (kvd.engine.batch) on a real kvd, through steps:
every generation's tokens and logit digests equal its cold run (nothing reused, one at a time),
with reuse across a batch and across worker processes, under eviction pressure, and through a
preemption resumed from its checkpoint. PatternModel needs no torch: a reused byte that differs
changes every later token.

Usage: test_batch_engine.py KVD_BINARY   (PYTHONPATH=<build>/python:<this dir>)
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

from kvd import Client
from kvd.engine.batch import BatchEngine, _kv_slot
from kvd.engine.local_blocks import LocalBlocks
from kvd_testlib import Daemon, check, finish, slot_bytes


def pool_config(blocks):
    return ("pools:\n  - name: default\n    block_tokens: 4\n    num_layers: 2\n"
            f"    bytes_per_token_per_layer: 16\n    capacity_blocks: {blocks}\n    max_model_len: 256\n")


def prompts(n, shared=12, unique=9, seed=0):
    """n prompts: `shared` tokens in common (in two families), then their own."""
    out = {}
    for i in range(n):
        family = [1000 * (1 + i % 2) + t for t in range(shared)]
        out[f"r{seed}-{i}"] = family + [50000 + seed * 1000 + i * 37 + t for t in range(unique + i % 5)]
    return out


def run(target, work, max_new=10, salt="", **kw):
    with Client(target, worker_name="batch-test") as c:
        e = BatchEngine(c, **kw)
        for rid, p in work.items():
            e.submit(rid, p, max_new=max_new, salt=salt + rid if salt else "")
        res = e.run()
        return res, e


def cold(target, work, max_new=10):
    """One at a time, a salt per request: nothing reused."""
    return run(target, work, max_new=max_new, salt="cold-", max_running=1)[0]


def same(res, ref, what):
    bad = [rid for rid in ref if res[rid]["tokens"] != ref[rid]["tokens"] or res[rid]["digest"] != ref[rid]["digest"]]
    check(not bad and len(res) == len(ref), f"{what}: every generation equals its cold run ({len(bad)} differ)")


def preemption(target, runner, label=""):
    """Room for two requests: the head of the queue waits, the youngest running one is
    checkpointed and released, and resumes later from its checkpoint; every generation equals its
    cold run. `runner(target, work, **kw)` runs a BatchEngine and returns its results first."""
    work = prompts(4, seed=5, shared=4, unique=12)
    ref = cold(target, work, max_new=16)
    res = runner(target, work, max_new=16, max_running=4, chunk=4, preempt_after=2)[0]
    pre = sum(r["preemptions"] for r in res.values())
    check(pre > 0, f"{label}requests were preempted ({pre})")
    same(res, ref, f"{label}through preemption and resume")
    # Again on the warm cache: a request whose prompt block another published first holds its own
    # copy on its reservation, and a decode grow then finds the budget full. The engine preempts
    # it (it used to fail the run) and it resumes.
    for k in range(3):
        again = {f"{rid}-again{k}": p for rid, p in work.items()}
        res = runner(target, again, max_new=16, max_running=4, chunk=4, preempt_after=2)[0]
        same({rid.rsplit("-again", 1)[0]: r for rid, r in res.items()}, ref,
             f"{label}through preemption and resume, warm cache, run {k + 1}")


def child(target, seed):
    res, _ = run(target, prompts(6, seed=seed), max_running=6, chunk=8)
    print(json.dumps(res))
    return 0


def main():
    if sys.argv[1] == "--child":
        return child(sys.argv[2], int(sys.argv[3]))
    kvd = sys.argv[1]
    # PatternModel writes client/examples/kv_pattern.h's bytes (eight from each 64-bit mix), as
    # kvd_testlib's byte-at-a-time copy of that header has them.
    cases = [(t, p, l, n) for t in (0, 7, 49999, 1 << 20) for p in (0, 1, 4095, 70000) for l in (0, 1, 31)
             for n in (1, 8, 13, 16, 64)]
    check(all(_kv_slot(*c) == slot_bytes(*c) for c in cases), "PatternModel's KV bytes are kv_pattern.h's")
    tmp = tempfile.mkdtemp(prefix="kvd-batch-")
    try:
        # Reuse within a batch and from one engine to the next.
        d = Daemon(kvd, tmp, pool_config(512), name="a")
        try:
            work = prompts(8)
            ref = cold(d.target, work)
            res, e = run(d.target, work, max_running=8, chunk=8, token_budget=32)
            same(res, ref, "a batch of 8 with chunked prefill")
            again, e2 = run(d.target, work, max_running=8, chunk=8)
            same(again, ref, "the same batch again, reusing")
            local = BatchEngine(LocalBlocks(capacity_blocks=512, max_model_len=256), max_running=8, chunk=8)
            for rid, p in work.items():
                local.submit(rid, p, max_new=10)
            same(local.run(), ref, "the in-process baseline (LocalBlocks)")
            reused = sum(r["cached_tokens"] for r in again.values())
            check(reused >= 8 * 12, f"the second batch reused its prompts ({reused} tokens)")
            check(e2.prefill_tokens < e.prefill_tokens, f"and computed fewer ({e2.prefill_tokens} < {e.prefill_tokens})")
            # Across worker processes at once.
            kids = [subprocess.Popen([sys.executable, __file__, "--child", d.target, str(s)], stdout=subprocess.PIPE,
                                     text=True) for s in (0, 1)]
            outs = [json.loads(k.communicate(timeout=120)[0]) for k in kids]
            check(all(k.returncode == 0 for k in kids), "two worker processes ran")
            refs = {}
            for s in (0, 1):
                refs.update(cold(d.target, prompts(6, seed=s)))
            same({**outs[0], **outs[1]}, refs, "two worker processes sharing prefixes")
        finally:
            d.stop()

        # Eviction pressure: 16 requests through a pool that holds a few at a time.
        d = Daemon(kvd, tmp, pool_config(40), name="b")
        try:
            work = prompts(16, seed=3)
            ref = cold(d.target, work)
            res, _ = run(d.target, work, max_running=4, chunk=8)
            same(res, ref, "16 requests through 40 blocks")
        finally:
            d.stop()

        d = Daemon(kvd, tmp, pool_config(24), name="c")
        try:
            preemption(d.target, run)
            with Client(d.target, map_slabs=False) as o:
                rep = o.report()
                check(rep.live_requests == 0 and rep.reserved_bytes == 0, "nothing held after")
        finally:
            d.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
