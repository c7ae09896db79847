#!/usr/bin/env python3
"""kvd.native.NativeClient (the C++ client's step path under a pybind11 binding) on a real kvd:
the reference batch engine gives every generation the tokens and logit digests of its cold run
(reused within a batch and from one engine to the next, under eviction pressure, through
preemption and resume, with its round trips in flight under the model); bad steps get a clear
status per item and change nothing; kvd stopped and then killed under a step in flight fails the
step without a hang, and a worker that exits holding requests and credit gives them all back.

Usage: test_native_step.py KVD_BINARY   (PYTHONPATH=<build>/python:<this dir>)
"""
import os
import shutil
import signal
import sys
import tempfile
import time

import grpc

from kvd import Client
from kvd.engine.batch import BatchEngine
from kvd.errors import KvdError
from kvd.native import NativeClient
from kvd.step import StepBatch, StepRequest
from kvd_testlib import Daemon, check, finish, stop_process
from test_batch_engine import cold, pool_config, preemption, prompts, same


def run_native(target, work, max_new=10, **kw):
    with NativeClient(target, worker_name="native-test") as c:
        e = BatchEngine(c, **kw)
        for rid, p in work.items():
            e.submit(rid, p, max_new=max_new)
        res = e.run()
        return res, e, c.rpc_calls


def idle(target):
    """Waits until kvd holds nothing for any request or credit; the last report."""
    with Client(target, map_slabs=False) as o:
        deadline = time.monotonic() + 10
        while True:
            rep = o.report()
            if (rep.live_requests == 0 and rep.reserved_bytes == 0) or time.monotonic() > deadline:
                return rep
            time.sleep(0.05)


def engine_cases(kvd, tmp):
    d = Daemon(kvd, tmp, pool_config(512), name="a")
    try:
        work = prompts(8)
        ref = cold(d.target, work)
        res, e, calls = run_native(d.target, work, max_running=8, chunk=8, token_budget=32)
        same(res, ref, "native: a batch of 8 with chunked prefill, steps in flight under the model")
        check(calls < e.steps, f"growth on credit made no round trip ({calls} round trips in {e.steps} steps)")
        again, e2, _ = run_native(d.target, work, max_running=8, chunk=8, overlap=False)
        same(again, ref, "native: the same batch again, synchronous, reusing")
        check(e2.prefill_tokens < e.prefill_tokens, f"and computed fewer ({e2.prefill_tokens} < {e.prefill_tokens})")
        rep = idle(d.target)
        check(rep.live_requests == 0 and rep.reserved_bytes == 0, "native: nothing held after the engines closed")
    finally:
        d.stop()

    d = Daemon(kvd, tmp, pool_config(40), name="b")
    try:
        work = prompts(16, seed=3)
        res, _, _ = run_native(d.target, work, max_running=4, chunk=8)
        same(res, cold(d.target, work), "native: 16 requests through 40 blocks")
    finally:
        d.stop()

    d = Daemon(kvd, tmp, pool_config(24), name="c")
    try:
        preemption(d.target, run_native, "native: ")
        rep = idle(d.target)
        check(rep.live_requests == 0 and rep.reserved_bytes == 0, "native: nothing held after preemption")
    finally:
        d.stop()


def hostile_cases(kvd, tmp):
    d = Daemon(kvd, tmp, pool_config(64), name="h")
    try:
        c = NativeClient(d.target, worker_name="careless", step_credit_blocks=8)
        a, ghost, nopool = StepRequest("a"), StepRequest("ghost"), StepRequest("nopool")
        r = c.step(StepBatch().start(a, pool="default", prompt=list(range(8)), max_new_tokens=8))
        check(r[0].ok and a.live and len(a.blocks) == 2, "native: a start acquires two blocks")
        b = StepBatch().grow(ghost, 1).start(nopool, pool="nope", prompt=[1, 2, 3]).grow(a, 1)
        r = c.step(b)
        check(r[0].code == grpc.StatusCode.FAILED_PRECONDITION and "ghost" in r[0].message,
              f"native: growth of a request never started is refused naming it ({r[0].code} {r[0].message})")
        check(r[1].code == grpc.StatusCode.NOT_FOUND and "nope" in r[1].message,
              f"native: a start in an unknown pool is refused naming it ({r[1].code} {r[1].message})")
        check(r[2].ok and a.num_tokens == 9 and len(a.blocks) == 3, "native: the good item of that step applied")
        r = c.step(StepBatch().publish(a, list(range(9)), 5))
        check(not r[0].ok and "5" in r[0].message, f"native: a publish past the table is refused ({r[0].message})")
        with Client(d.target, map_slabs=False) as o:
            check(o.report().live_requests == 1, "native: the refused items changed nothing")
        bad = StepBatch()
        bad.items.append(("teleport", a, b""))
        try:
            c.step(bad)
            check(False, "native: an unknown item kind is refused")
        except KeyError:
            check(True, "native: an unknown item kind is refused before anything is sent")

        # The binding itself, handed what no StepBatch builds: refused, nothing sent.
        from kvd import _native
        for items, what in (([(0, _native.Request("z"), b"\xff\xff\xff", "z")], "does not parse"),
                            ([(9, _native.Request("z"), b"", 0)], "unknown step item kind")):
            try:
                c._native.submit(items)
                check(False, f"native: the binding refuses an item that {what}")
            except ValueError as e:
                check(what in str(e), f"native: the binding refuses an item that {what} ({e})")
        with Client(d.target, map_slabs=False) as o:
            check(o.report().live_requests == 1, "native: and nothing was started")

        # kvd stopped under a step in flight: the step stays in flight; killed: it fails, no hang.
        late = StepRequest("late")
        stop_process(d.proc.pid)
        f = c.step_submit(StepBatch().grow(a, 1).start(late, pool="default", prompt=list(range(4))))
        time.sleep(0.3)
        check(not f.done(), "native: a step to a stopped kvd stays in flight")
        os.kill(d.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        try:
            f.result()
            check(False, "native: the step fails when kvd is killed under it")
        except KvdError as e:
            check(time.monotonic() - t0 < 20, f"native: the step failed in {time.monotonic() - t0:.1f} s ({e.code})")
        check(not late.live, "native: the start it carried did not start")
        c.close()
    finally:
        d.stop()

    # A worker that exits holding requests and credit: kvd gets everything back.
    d = Daemon(kvd, tmp, pool_config(64), name="x")
    try:
        c = NativeClient(d.target, worker_name="leaver", step_credit_blocks=8)
        reqs = [StepRequest(f"q{i}") for i in range(4)]
        b = StepBatch()
        for q in reqs:
            b.start(q, pool="default", prompt=list(range(10)), max_new_tokens=8)
        check(all(r.ok for r in c.step(b)), "native: four requests started")
        c.close()
        rep = idle(d.target)
        check(rep.live_requests == 0 and rep.reserved_bytes == 0,
              f"native: a closed worker's requests and credit went back ({rep.live_requests}, {rep.reserved_bytes})")
    finally:
        d.stop()


def main():
    kvd = sys.argv[1]
    tmp = tempfile.mkdtemp(prefix="kvd-native-")
    try:
        engine_cases(kvd, tmp)
        hostile_cases(kvd, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
