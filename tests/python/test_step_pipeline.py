#!/usr/bin/env python3
"""The Python step path without its own round trips (kvd.step, kvd-reuse-2 item 6) against a real
kvd: publishes and ends held back (hold_s) ride the next step that goes out and answer there; a
worker killed while holding them has its blocks released unpublished (nothing cached from them,
nothing leaked); a step submitted with its round trip in flight (Client.step_submit) answers as
Client.step does; and the reference batch engine gives the same tokens and digests synchronous,
holding back, and overlapping its model with the round trip, with fewer round trips and nothing
held after, and carrying a step's unanswered starts across engine steps; growth on credit is
placed while a step is in flight (kvd stopped) and kvd's answer does not hand those blocks out
again; a step in flight when kvd dies under it fails with a KvdError, and so do the held items it
carried.

Usage: test_step_pipeline.py KVD_BINARY   (PYTHONPATH=<build>/python:<this dir>)
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from kvd import Client, KvdError, StepBatch, StepRequest
from kvd.engine.batch import BatchEngine
from kvd_testlib import SMALL_POOL, Daemon, check, finish, stop_process

BT = 4

# A worker in its own process: computes a prompt, holds its publish and end back, says HELD, waits.
HOLDER = """
import sys, time
from kvd import Client, StepBatch, StepRequest
c = Client(sys.argv[1], worker_name="holder", step_credit_blocks=0)  # no refill step
r = StepRequest("held-1")
prompt = [int(t) for t in sys.argv[2].split(",")]
assert c.step(StepBatch().start(r, "default", prompt))[0].ok
res = c.step(StepBatch().publish(r, prompt, len(prompt) // 4, hold_s=60).end(r, hold_s=60))
assert all(x.deferred for x in res)
print("HELD", flush=True)
time.sleep(60)
"""


def wait_until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def idle(c, what, credit=0):
    """Nothing leaked: no live request; the only blocks owned and reserved are the `credit` a
    worker holds for its steps."""
    ok = wait_until(lambda: (lambda r: r.live_requests == 0 and r.pools[0].owned_blocks == credit)(c.report()))
    r = c.report()
    p = r.pools[0]
    check(ok and p.free_blocks + p.cached_blocks + credit == p.capacity_blocks,
          f"{what}: nothing leaked (live {r.live_requests}, owned {p.owned_blocks}, credit {credit})")


def prompts(n, shared=12, seed=0):
    return {f"p{seed}-{i}": [700 + t for t in range(shared)] + [9000 + 100 * i + t + seed for t in range(5 + i % 4)]
            for i in range(n)}


class LateAnswers:
    """A Client whose submitted steps say they are not answered for their first `polls` done()
    calls: an engine sees a round trip longer than its model's step, whatever this machine's
    timing (the client's own state, a step in flight, is real)."""

    def __init__(self, client, polls=4):
        self._client, self._polls = client, polls

    def __getattr__(self, name):
        return getattr(self._client, name)

    def step_submit(self, batch):
        f = self._client.step_submit(batch)
        late = {"left": self._polls}

        class Late:
            def done(self):
                late["left"] -= 1
                return late["left"] < 0 and f.done()

            def result(self):
                return f.result()
        return Late()


def engine_run(target, work, late=False, step_lane=True, **kw):
    with Client(target, worker_name="pipeline", step_credit_blocks=16, step_lane=step_lane) as c:
        e = BatchEngine(LateAnswers(c) if late else c, max_running=4, chunk=8, token_budget=24, **kw)
        for rid, p in work.items():
            e.submit(rid, p, max_new=9)
        before = c.rpc_calls
        res = e.run()
        return res, c.rpc_calls - before, e.carried_steps


def main():
    kvd = sys.argv[1]
    tmp = tempfile.mkdtemp(prefix="kvd-py-pipeline-")
    daemon = Daemon(kvd, tmp, SMALL_POOL.replace("capacity_blocks: 64", "capacity_blocks: 256"))
    try:
        with Client(daemon.target, worker_name="held", step_credit_blocks=8) as c, \
                Client(daemon.target, map_slabs=False) as obs:
            # --- a publish and an end held back ride the next step that goes out ----------------
            prompt = list(range(300, 313))
            a = StepRequest("a")
            check(c.step(StepBatch().start(a, "default", prompt))[0].ok, "a starts")
            calls = c.rpc_calls
            pub, end = c.step(StepBatch().publish(a, prompt, 3, hold_s=30).end(a, hold_s=30))
            check(pub.deferred and end.deferred and pub.ok and c.rpc_calls == calls and not a.live,
                  "a's publish and end are held back: no round trip, a no longer live here")
            r = obs.report()
            check(r.live_requests == 1 and r.pools[0].cached_blocks == 0,
                  f"kvd still holds a as live, nothing cached yet (live {r.live_requests})")
            check(not c.step(StepBatch().grow(a, 1))[0].ok, "a held-back end: a's growth is refused here")
            b = StepRequest("b")
            rb = c.step(StepBatch().start(b, "default", prompt))[0]
            check(not pub.deferred and pub.ok and pub.kept == 3 and not end.deferred and end.ok,
                  f"they went with b's start and answered there (kept {pub.kept})")
            check(rb.ok and b.cached_tokens == 12, f"b's start came after them: a hit of 12 ({b.cached_tokens})")
            # Held past hold_s: the next step goes out for it even with nothing else to send.
            c.step(StepBatch().end(b, hold_s=0.05))
            time.sleep(0.1)
            calls = c.rpc_calls
            c.step(StepBatch())
            check(c.rpc_calls == calls + 1 and obs.report().live_requests == 0, "an end held past hold_s goes out")
            # Client.step_flush sends them at once.
            d = StepRequest("d")
            c.step(StepBatch().start(d, "default", prompt))
            held = c.step(StepBatch().end(d, hold_s=30))[0]
            c.step_flush()
            check(not held.deferred and held.ok and obs.report().live_requests == 0, "step_flush sends a held end")

            # --- a step in flight ------------------------------------------------------------
            e1, e2 = StepRequest("e1"), StepRequest("e2")
            f1 = c.step_submit(StepBatch().start(e1, "default", prompt))
            f2 = c.step_submit(StepBatch().start(e2, "default", list(range(400, 409))))
            r2, r1 = f2.result(), f1.result()
            check(r1[0].ok and r2[0].ok and e1.cached_tokens == 12 and e2.live and f1.done(),
                  "two steps submitted back to back: the second waits for the first's answer, both apply")
            g = c.step_submit(StepBatch().grow(e2, 1).end(e1))
            check(e2.num_tokens == 10, "growth on credit is placed before the answer")
            check(all(x.ok for x in g.result()) and not e1.live, "and the end answers with it")
            c.step(StepBatch().end(e2))
            idle(obs, "held items and steps in flight", c.step_credit("default"))

            # --- steps placed on credit while one is in flight --------------------------------
            # kvd is stopped: the start's step cannot be answered, yet growth on credit is placed
            # at once; kvd's answer then lists the credit as it was, less what was placed meanwhile.
            h1, h2 = StepRequest("h1"), StepRequest("h2")
            c.step(StepBatch().start(h1, "default", list(range(600, 609))))
            calls = c.rpc_calls
            stop_process(daemon.proc.pid)
            try:
                f = c.step_submit(StepBatch().start(h2, "default", list(range(650, 659))))
                grown = [c.step(StepBatch().grow(h1, 4))[0] for _ in range(3)]
                check(all(g.ok for g in grown) and h1.num_tokens == 21 and not f.done() and c.rpc_calls == calls + 1,
                      f"kvd stopped: growth on credit placed while a start's step is in flight ({h1.num_tokens} tokens)")
            finally:
                os.kill(daemon.proc.pid, signal.SIGCONT)
            check(f.result()[0].ok and h2.live, "the start is answered once kvd runs again")
            held_blocks = list(h1.blocks)
            free_credit = c._stepper.credit.get((h1.pool_id, 0), [])
            check(len(set(held_blocks)) == len(held_blocks) and not set(free_credit) & set(held_blocks),
                  "no credit block is both placed and free after the answer")
            r = c.step(StepBatch().grow(h1, 40).grow(h2, 40))  # past the credit: goes out with the held growth
            check(all(x.ok for x in r) and len(set(h1.blocks) | set(h2.blocks)) == len(h1.blocks) + len(h2.blocks),
                  f"kvd takes the growth placed meanwhile as sent ({[x.message for x in r]})")
            c.step(StepBatch().end(h1).end(h2))
            idle(obs, "growth placed while a step is in flight", c.step_credit("default"))

            # --- a worker killed while holding a publish and an end ---------------------------
            killed = list(range(500, 513))
            p = subprocess.Popen([sys.executable, "-c", HOLDER, daemon.target, ",".join(map(str, killed))],
                                 stdout=subprocess.PIPE, text=True, env=os.environ)
            line = p.stdout.readline().strip()
            check(line == "HELD" and wait_until(lambda: obs.report().live_requests == 1),
                  "a worker holds its publish and end back, its request live in kvd")
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)
            idle(obs, "the holder SIGKILLed", c.step_credit("default"))
            k = StepRequest("k")
            c.step(StepBatch().start(k, "default", killed))
            check(k.live and k.cached_tokens == 0,
                  f"what it held back was never published: no hit ({k.cached_tokens} cached tokens)")
            c.step(StepBatch().end(k))
            idle(obs, "after", c.step_credit("default"))

        # --- the batch engine: synchronous, holding back, overlapping -----------------------
        work = prompts(10)
        runs = {label: engine_run(daemon.target, work, **kw) for label, kw in
                (("sync", {"hold_s": 0.0, "overlap": False}), ("held", {"hold_s": 30.0, "overlap": False}),
                 ("overlap", {"hold_s": 30.0, "overlap": True}),
                 ("overlap over gRPC", {"hold_s": 30.0, "overlap": True, "step_lane": False}))}
        ref = runs["sync"][0]
        # Late answers, on prompts nobody cached (so requests end apart and later ones start while
        # others run): the engine decodes while a step's starts are unanswered.
        cold = prompts(10, seed=1)
        late, _, carried = engine_run(daemon.target, cold, hold_s=30.0, overlap=True, late=True)
        late_ref = engine_run(daemon.target, cold, hold_s=0.0, overlap=False)[0]
        bad = [rid for rid in cold if late[rid]["tokens"] != late_ref[rid]["tokens"] or late[rid]["digest"] != late_ref[rid]["digest"]]
        check(carried > 0 and len(late) == len(cold) and not bad,
              f"late answers: {carried} engine steps ran while starts were unanswered; the same tokens and "
              f"digests as sync ({len(bad)} differ)")
        for label in ("held", "overlap", "overlap over gRPC"):
            res = runs[label][0]
            bad = [rid for rid in work if res[rid]["tokens"] != ref[rid]["tokens"] or res[rid]["digest"] != ref[rid]["digest"]]
            check(len(res) == len(work) and not bad, f"batch engine {label}: the same tokens and digests as sync ({len(bad)} differ)")
        reused = [sum(r["cached_tokens"] for r in runs[k][0].values()) for k in runs]
        check(all(x >= 12 * 6 for x in reused), f"every run reused the shared prompt ({reused} tokens)")
        check(runs["held"][1] < runs["sync"][1] and runs["overlap"][1] <= runs["held"][1],
              f"round trips: sync {runs['sync'][1]}, held {runs['held'][1]}, overlap {runs['overlap'][1]}")
        with Client(daemon.target, map_slabs=False) as obs:
            idle(obs, "batch engine runs")

        # --- a step in flight when kvd stops answering, then dies under it --------------------
        dies = Daemon(kvd, tmp, SMALL_POOL, name="kvd-dies")
        try:
            with Client(dies.target, worker_name="dies", step_credit_blocks=0) as c:
                x, y = StepRequest("x"), StepRequest("y")
                check(c.step(StepBatch().start(x, "default", list(range(800, 809))))[0].ok, "x starts")
                held = c.step(StepBatch().end(x, hold_s=30))[0]
                stop_process(dies.proc.pid)
                f = c.step_submit(StepBatch().start(y, "default", list(range(900, 909))))
                time.sleep(0.05)
                check(not f.done() and held.deferred, "kvd stopped: the step (with x's held end) stays in flight")
                dies.proc.send_signal(signal.SIGKILL)
                dies.proc.wait(timeout=15)
                t = time.monotonic()
                try:
                    f.result()
                    err = None
                except KvdError as e:
                    err = e
                check(err is not None and f.done() and time.monotonic() - t < 10,
                      f"kvd killed under it: result() fails with a KvdError ({err!r})")
                check(not held.deferred and not held.ok and not y.live,
                      f"the held end it carried failed with it ({held.code}), y never started")
        finally:
            dies.stop()
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
