#!/usr/bin/env python3
"""Prefixes in flight (kvd-reuse-2 item 2; docs/architecture.md, "Prefixes in flight") against a
real kvd: a start whose next blocks another live request of its namespace is computing learns it
and may wait for them. Waited for and published: a hit, nothing computed twice. The computing
request ends without publishing, is preempted, or its worker is SIGKILLed: the waiter is answered
and computes them itself. A waiter whose worker dies, a wait that times out, two workers each
waiting on the other's blocks, a tenant probing another's prompt, bad bounds: answered, nothing
leaked, nothing wedged; with nobody waiting, the threads that answer waits sleep. Two starts of a
new prefix admitted together: the one that acquires second waits for the first's blocks (the
acquire decides). Outcomes are asserted, never wall times (bounds are generous).

Usage: test_inflight.py KVD_BINARY   (PYTHONPATH=<build>/python:<this dir>)
"""
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc

from kvd import Client, KvdError, StepBatch, StepRequest
from kvd.engine.batch import BatchEngine
from kvd_testlib import SMALL_POOL, Daemon, check, finish

BT = 4
SHARED = list(range(1000, 1016))  # four blocks nobody has cached


def prompt(shared, own):
    return shared + list(range(own, own + 5))


def wait_until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def start_in_thread(client, rid, p, **kw):
    """Client.request on a thread; returns (thread, box) where box gets the Request or the error."""
    box = {}

    def run():
        try:
            box["req"] = client.request(rid, "default", p, **kw)
        except KvdError as e:
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def idle(c, what):
    """Nothing leaked: no live request, block owned, reservation, in-flight entry or wait."""
    ok = wait_until(lambda: (lambda r: r.live_requests == 0 and r.reserved_bytes == 0 and r.pools[0].owned_blocks == 0
                             and r.in_flight_blocks == 0 and r.in_flight_waiting == 0)(c.report()))
    r = c.report()
    check(ok and r.pools[0].free_blocks + r.pools[0].cached_blocks == r.pools[0].capacity_blocks,
          f"{what}: nothing leaked (live {r.live_requests}, reserved {r.reserved_bytes}, owned "
          f"{r.pools[0].owned_blocks}, in flight {r.in_flight_blocks}, waiting {r.in_flight_waiting})")


# A worker in its own process: starts a request computing `shared`, says STARTED, then waits to be killed.
HOLDER = """
import sys, time
from kvd import Client
c = Client(sys.argv[1], worker_name="doomed")
r = c.request(sys.argv[2], "default", [int(t) for t in sys.argv[3].split(",")])
print("STARTED", flush=True)
time.sleep(120)
"""
# A worker in its own process that waits for blocks in flight (and is killed while it waits).
WAITER = """
import sys
from kvd import Client
c = Client(sys.argv[1], worker_name="doomed-waiter")
print("ATTACHED", flush=True)
c.request(sys.argv[2], "default", [int(t) for t in sys.argv[3].split(",")], wait_in_flight_s=25)
print("ANSWERED", flush=True)
"""


def spawn(code, target, rid, p):
    proc = subprocess.Popen([sys.executable, "-c", code, target, rid, ",".join(map(str, p))],
                            stdout=subprocess.PIPE, text=True)
    return proc


def simultaneous_starts(daemon):
    """Unary starts and step starts, each pair queued for admission behind a full budget."""
    with Client(daemon.target, worker_name="q-a", step_credit_blocks=0) as a, \
            Client(daemon.target, worker_name="q-b", step_credit_blocks=0) as b:
        for how in ("start", "step"):
            shared = list(range(11000 + (0 if how == "start" else 100), 11016 + (0 if how == "start" else 100)))
            # 64 blocks: 50 + 10 reserved leave 4, less than one 21-token start's 6 blocks.
            big = a.request(f"{how}-fill-1", "default", [1, 2, 3, 4], max_new_tokens=196)
            small = a.request(f"{how}-fill-2", "default", [5, 6, 7, 8], max_new_tokens=36)
            p1, p2 = prompt(shared, 100), prompt(shared, 200)
            if how == "start":
                t1, box1 = start_in_thread(a, f"{how}-1", p1, wait_in_flight_s=20, wait_s=20)
                check(wait_until(lambda: a.report().admission_waiting == 1), f"{how}: the first queues for admission")
                t2, box2 = start_in_thread(b, f"{how}-2", p2, wait_in_flight_s=20, wait_s=20)
                check(wait_until(lambda: a.report().admission_waiting == 2), f"{how}: the second queues behind it")
                small.release()
                check(wait_until(lambda: "req" in box1 or "req" in box2 or "error" in box1 or "error" in box2),
                      f"{how}: one is answered once there is room")
                first, fprompt, lbox, lthread = ((box1.get("req"), p1, box2, t2) if "req" in box1
                                               else (box2.get("req"), p2, box1, t1))
                check(first is not None and first.cached_tokens == 0 and first.in_flight is None,
                      f"{how}: the first computes the prefix ({box1.get('error') or box2.get('error')})")
                check(wait_until(lambda: a.report().in_flight_waiting == 1) and not lbox,
                      f"{how}: the other, admitted with it, waits for its blocks instead of computing them")
                if first is not None:
                    first.publish(fprompt)
                lthread.join(20)
                second = lbox.get("req")
                check(second is not None and second.cached_tokens == 16 and second.in_flight_wait == "published"
                      and second.in_flight_seen is not None and second.in_flight_seen.request_id == first.id,
                      f"{how}: then hits what the first published "
                      f"({lbox.get('error') or (second.cached_tokens, second.in_flight_wait, second.in_flight_seen)})")
                for r in (first, second):
                    if r is not None:
                        end = r.end(publish_blocks=5)
                        check(end.duplicates == 0, f"{how}: {r.id} computed nothing twice ({end})")
            else:
                s1, s2 = StepRequest(f"{how}-1"), StepRequest(f"{how}-2")
                r1 = a.step(StepBatch().start(s1, "default", p1, wait_in_flight_s=20))[0]
                r2 = b.step(StepBatch().start(s2, "default", p2, wait_in_flight_s=20))[0]
                check(r1.waiting and r2.waiting and s1.in_flight is None and s2.in_flight is None,
                      f"{how}: both wait for admission, nothing in flight yet")
                small.release()
                check(wait_until(lambda: not a.step(StepBatch().start(s1, "default", p1, wait_in_flight_s=20))[0].waiting)
                      and s1.live and s1.cached_tokens == 0, f"{how}: the first sent again acquires and computes")
                # Sent again until kvd's admission pass has reached it too (answered while it queues).
                wait_until(lambda: b.step(StepBatch().start(s2, "default", p2, wait_in_flight_s=20))[0].ok
                           and (s2.in_flight is not None or not s2.waiting))
                r2 = b.step(StepBatch().start(s2, "default", p2, wait_in_flight_s=20))[0]
                check(r2.ok and r2.waiting and s2.in_flight is not None and s2.in_flight.request_id == s1.id
                      and not s2.live, f"{how}: the second, admitted with it, waits for its blocks ({s2.in_flight})")
                check(a.report().in_flight_waiting == 1 and a.report().live_requests == 2,
                      f"{how}: holding nothing while it waits (only the first and the filler are live)")
                check(a.step(StepBatch().publish(s1, p1, 5))[0].ok, f"{how}: the first publishes")
                ok = wait_until(lambda: not b.step(StepBatch().start(s2, "default", p2, wait_in_flight_s=20))[0].waiting)
                check(ok and s2.live and s2.cached_tokens == 16 and s2.in_flight_wait == "published",
                      f"{how}: then hits them ({s2.cached_tokens}, {s2.in_flight_wait})")
                for w, req in ((a, s1), (b, s2)):
                    check(w.step(StepBatch().end(req, publish_blocks=0))[0].ok, f"{how}: {req.id} ends")
            big.release()
            idle(a, f"{how}: simultaneous starts")


def thread_wakes(pid, names):
    """Context switches so far of kvd's threads named `names` ({name: count}; absent: not found)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                status = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        if name in names:
            out[name] = sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches:" in line)
    return out


def quiet_when_idle(daemon):
    """The threads that answer waits sleep while nobody waits: no timer, no wake per release."""
    names = ("kvd-admit", "kvd-inflight")
    before = thread_wakes(daemon.proc.pid, names)
    check(sorted(before) == sorted(names), f"kvd names its wait threads ({sorted(before)})")
    time.sleep(1.0)
    after = thread_wakes(daemon.proc.pid, names)
    woke = {n: after.get(n, 0) - before.get(n, 0) for n in names}
    check(all(w <= 2 for w in woke.values()), f"with nobody waiting, an idle second wakes neither ({woke})")


def main():
    kvd = sys.argv[1]
    tmp = tempfile.mkdtemp(prefix="kvd-py-inflight-")
    # Room for eight 73-token requests at once (the batch engine's fan-out is not held back by admission).
    daemon = Daemon(kvd, tmp, SMALL_POOL.replace("capacity_blocks: 64", "capacity_blocks: 512"))
    try:
        # No block credit: what a worker holds is what its requests hold (idle() counts it all).
        with Client(daemon.target, worker_name="a", step_credit_blocks=0) as a, \
                Client(daemon.target, worker_name="b", step_credit_blocks=0) as b:
            # --- published while the second waits: a hit, computed once ---------------------------
            pa = prompt(SHARED, 100)
            ra = a.request("a1", "default", pa)
            check(ra.in_flight is None, "the first computes: nothing in flight ahead of it")
            check(a.report().in_flight_blocks == 5, "its five full prompt blocks are in flight")
            t, box = start_in_thread(b, "b1", prompt(SHARED, 200), wait_in_flight_s=20)
            check(wait_until(lambda: b.report().in_flight_waiting == 1), "the second waits for them")
            ra.publish(pa)
            t.join(20)
            rb = box.get("req")
            check(rb is not None, f"the waiter is answered ({box.get('error')})")
            if rb is not None:
                seen = rb.in_flight_seen
                check(seen is not None and seen.request_id == "a1" and seen.first_block == 0 and seen.blocks == 4,
                      f"it learned which blocks, by whom ({seen})")
                check(rb.in_flight_wait == "published", f"answered as published ({rb.in_flight_wait})")
                check(rb.cached_tokens == 16, f"and hit what the first published ({rb.cached_tokens})")
                check(rb.in_flight is None, "nothing in flight ahead of it any more")
                end = rb.end(publish_blocks=5)
                check(end.already_cached == 4 and end.kept == 1 and end.duplicates == 0,
                      f"no block was computed twice ({end})")
            ra.release()
            idle(a, "published")

            # --- the computing request ends without publishing, or is preempted ---------------------
            for how in ("released", "preempted"):
                shared = list(range(2000 + (0 if how == "released" else 100), 2016 + (0 if how == "released" else 100)))
                if how == "released":
                    holder = a.request("a2", "default", prompt(shared, 300))
                else:
                    holder = StepRequest("a2")
                    sb = StepBatch().start(holder, "default", prompt(shared, 300))
                    check(a.step(sb)[0].ok and holder.live, "a step starts the computing request")
                t, box = start_in_thread(b, "b2", prompt(shared, 400), wait_in_flight_s=20)
                check(wait_until(lambda: b.report().in_flight_waiting == 1), f"{how}: the second waits")
                if how == "released":
                    holder.release(completed=False)
                else:
                    res = a.step(StepBatch().preempt(holder))  # no checkpoint: nothing stays behind
                    check(res[0].ok, f"preempted in a step ({res[0].message})")
                t.join(20)
                rb = box.get("req")
                check(rb is not None and rb.in_flight_wait == "released" and rb.cached_tokens == 0,
                      f"{how}: the waiter is answered and computes them itself "
                      f"({box.get('error') or (rb.in_flight_wait, rb.cached_tokens)})")
                if rb is not None:
                    rb.end(publish_blocks=5)
                idle(a, how)

            # --- the computing request's worker is killed ---------------------------------------
            shared = list(range(3000, 3016))
            proc = spawn(HOLDER, daemon.target, "k1", prompt(shared, 500))
            check(proc.stdout.readline().startswith("STARTED"), "a worker process computes a prefix")
            t, box = start_in_thread(b, "b3", prompt(shared, 600), wait_in_flight_s=20)
            check(wait_until(lambda: b.report().in_flight_waiting == 1), "killed: the second waits")
            proc.kill()
            proc.wait()
            t.join(20)
            rb = box.get("req")
            check(rb is not None and rb.in_flight_wait == "released" and rb.cached_tokens == 0,
                  f"killed: the waiter is answered and computes them "
                  f"({box.get('error') or (rb.in_flight_wait, rb.cached_tokens)})")
            if rb is not None:
                rb.end(publish_blocks=5)
            idle(a, "computing worker killed")

            # --- the waiter's worker dies while it waits --------------------------------------------
            shared = list(range(4000, 4016))
            holder = a.request("a4", "default", prompt(shared, 700))
            proc = spawn(WAITER, daemon.target, "w4", prompt(shared, 800))
            check(proc.stdout.readline().startswith("ATTACHED"), "a waiter process attached")
            check(wait_until(lambda: a.report().in_flight_waiting == 1), "it waits")
            proc.kill()
            proc.wait()
            check(wait_until(lambda: a.report().in_flight_waiting == 0), "its wait ends with it")
            r = a.report()
            check(r.live_requests == 1 and r.admission_waiting == 0, f"it left nothing behind (live {r.live_requests})")
            holder.end(publish_blocks=5)
            idle(a, "waiter killed")

            # --- a wait that times out ----------------------------------------------------------
            shared = list(range(5000, 5016))
            holder = a.request("a5", "default", prompt(shared, 900))
            rb = b.request("b5", "default", prompt(shared, 1000), wait_in_flight_s=0.3)
            check(rb.in_flight_wait == "timed_out" and rb.cached_tokens == 0 and rb.in_flight is not None
                  and rb.in_flight.request_id == "a5",
                  f"timed out: it computes them, told who still does ({rb.in_flight_wait}, {rb.in_flight})")
            check(rb.in_flight_waited_s < 10, f"the wait ended within its bound ({rb.in_flight_waited_s:.2f} s)")
            t0 = time.monotonic()
            try:
                b.request("a5", "default", prompt(shared, 1000), wait_in_flight_s=20)
                check(False, "a start with the computing request's own id is refused")
            except KvdError as e:
                # Not after its 20 s bound (a wait on itself would last until a5 ends, past it).
                check(e.code == grpc.StatusCode.ALREADY_EXISTS and time.monotonic() - t0 < 10,
                      f"a start with the computing request's own id never waits on it: refused at once ({e.code})")
            for bad in (-0.001, 31):
                try:
                    b.request("bad", "default", prompt(shared, 1100), wait_in_flight_s=bad)
                    check(False, f"wait_in_flight_s={bad} refused")
                except KvdError as e:
                    check(e.code == grpc.StatusCode.INVALID_ARGUMENT and "wait_for_in_flight_ms" in e.details,
                          f"wait_in_flight_s={bad}: INVALID_ARGUMENT naming the field ({e.details})")
            rb.end(publish_blocks=5)
            holder.end(publish_blocks=5)
            idle(a, "timed out")

            # --- two workers, each waiting on the other's blocks, in steps ----------------------------
            p_shared, q_shared = list(range(6000, 6016)), list(range(7000, 7016))
            a1, b1, a2, b2 = StepRequest("x-a1"), StepRequest("x-b1"), StepRequest("x-a2"), StepRequest("x-b2")
            check(a.step(StepBatch().start(a1, "default", prompt(p_shared, 1)))[0].ok, "a computes P")
            check(b.step(StepBatch().start(b1, "default", prompt(q_shared, 2)))[0].ok, "b computes Q")
            ra2 = a.step(StepBatch().start(a2, "default", prompt(q_shared, 3), wait_in_flight_s=20))[0]
            rb2 = b.step(StepBatch().start(b2, "default", prompt(p_shared, 4), wait_in_flight_s=20))[0]
            check(ra2.waiting and a2.in_flight is not None and a2.in_flight.request_id == "x-b1",
                  f"a's second start waits on b's blocks ({a2.in_flight})")
            check(rb2.waiting and b2.in_flight is not None and b2.in_flight.request_id == "x-a1",
                  f"b's second start waits on a's blocks ({b2.in_flight})")
            # Neither wait blocks its worker's steps: each publishes, then sends its start again.
            check(a.step(StepBatch().publish(a1, prompt(p_shared, 1), 5))[0].ok, "a publishes P")
            check(b.step(StepBatch().publish(b1, prompt(q_shared, 2), 5))[0].ok, "b publishes Q")
            for w, req, p in ((a, a2, prompt(q_shared, 3)), (b, b2, prompt(p_shared, 4))):
                ok = wait_until(lambda: not w.step(StepBatch().start(req, "default", p, wait_in_flight_s=20))[0].waiting)
                check(ok and req.live and req.cached_tokens == 16 and req.in_flight_wait == "published",
                      f"{req.id}: answered, a hit on the other's blocks ({req.cached_tokens}, {req.in_flight_wait})")
            for w, req in ((a, a1), (a, a2), (b, b1), (b, b2)):
                check(w.step(StepBatch().end(req, publish_blocks=0))[0].ok, f"{req.id} ends")
            idle(a, "mutual waits")

            # --- two starts of a new prefix admitted together: the second's acquire waits ---------
            # Both queue for admission, so both find nothing in flight before it; admitted in one
            # pass, the first to acquire computes the prefix and the other, which asked to wait,
            # gives its admission back and waits for it then (the check is in the acquire).
            small = Daemon(kvd, tmp, SMALL_POOL, name="small")
            try:
                simultaneous_starts(small)
            finally:
                small.stop()

            # --- another tenant never learns of it ----------------------------------------------
            shared = list(range(8000, 8016))
            holder = a.request("t1", "default", prompt(shared, 1200), cache_salt="tenant-1")
            other = b.request("t2", "default", prompt(shared, 1300), cache_salt="tenant-2", wait_in_flight_s=20)
            alone = b.request("t3", "default", prompt(shared, 1400), cache_salt="tenant-3", wait_in_flight_s=20)
            same = [(r.in_flight_seen, r.in_flight_wait, r.in_flight, r.cached_tokens, r.in_flight_waited_s)
                    for r in (other, alone)]
            check(same[0] == same[1] == (None, "not_waited", None, 0, 0.0),
                  f"another salt: the same answer as with nothing in flight ({same})")
            mine = a.request("t4", "default", prompt(shared, 1500), cache_salt="tenant-1")
            check(mine.in_flight is not None and mine.in_flight.request_id == "t1", "the same tenant learns it")
            for r in (holder, other, alone, mine):
                r.release()
            idle(a, "tenants")

            # --- the reference batch engine defers starts whose prefix is in flight ---------------
            # Eight requests on a new 64-token context, started together: one computes the context,
            # the others wait for its publish, then hit it (S + N x own prefill tokens, not N x S).
            ctx, own, n = 64, 6, 8
            runs = {}
            for label, wait, salt in (("deferring", 5.0, "eng-1"), ("computing", 0.0, "eng-2")):
                e = BatchEngine(a, max_running=n, chunk=16, wait_in_flight_s=wait)
                for i in range(n):
                    e.submit(f"{label}-{i}", list(range(9000, 9000 + ctx)) + [50000 + 10 * i + t for t in range(own)],
                             max_new=3, salt=salt)
                runs[label] = (e.run(), e.prefill_tokens, e.deferred_in_flight)
            (res_w, pre_w, def_w), (res_c, pre_c, def_c) = runs["deferring"], runs["computing"]
            check(pre_w == ctx + n * own and def_w > 0,
                  f"the engine computed the context once ({pre_w} prefill tokens, {def_w} deferrals)")
            check(pre_c == n * (ctx + own) and def_c == 0, f"without the wait each computes it ({pre_c})")
            same = all(res_w[f"deferring-{i}"]["tokens"] == res_c[f"computing-{i}"]["tokens"] and
                       res_w[f"deferring-{i}"]["digest"] == res_c[f"computing-{i}"]["digest"] for i in range(n))
            check(same, "deferred or not, every request gives the same tokens and KV digests")
            idle(a, "batch engine")
            quiet_when_idle(daemon)
    finally:
        daemon.stop()
    return finish()


if __name__ == "__main__":
    sys.exit(main())
