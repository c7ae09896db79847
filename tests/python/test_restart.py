#!/usr/bin/env python3
"""The Python client rides through kvd restarts: a real daemon SIGKILLed and started again on the
same socket, five times, under one client. Each time the client re-attaches by itself, calls
on_remap (a plain restart is new memory), the live request raises KvdRestarted (never a hang,
never a write into memory kvd no longer owns), and the next request works on the new memory,
byte for byte (checked by the C++ example worker).

Usage: test_restart.py KVD_BINARY EXAMPLE_WORKER_BINARY   (PYTHONPATH=<build>/python)
"""
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from kvd_testlib import SMALL_POOL, Daemon, check, finish, run_worker, slot_bytes  # noqa: E402

from kvd import Client, KvdError, KvdRestarted  # noqa: E402


def restart(kvd, tmp, daemon):
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait(timeout=10)
    os.remove(os.path.join(tmp, "kvd.ready"))
    return Daemon(kvd, tmp, SMALL_POOL)


def write(c, r, prompt):
    pool = c.pool(r.pool)
    n = pool.bytes_per_token_per_layer
    for pos in range(r.num_tokens):
        for layer in range(pool.num_layers):
            view = c.layer_view(r.pool, r.blocks[pos // pool.block_tokens], layer)
            view[(pos % pool.block_tokens) * n:(pos % pool.block_tokens + 1) * n] = slot_bytes(prompt[pos], pos, layer, n)


def race_restarts(kvd, tmp, daemon, attempt, settled=lambda: True):
    """Calls attempt(i, restarted) for i = 1, 2, ... on another thread while kvd is SIGKILLed and
    restarted three times under it (`restarted`, an Event, is set after the third), then until
    settled() (10 s at most). Returns (daemon, failures): what attempt raised other than
    KvdRestarted or KvdError, plus a line if the thread did not end."""
    errors, done, restarted = [], threading.Event(), threading.Event()

    def loop():
        i = 0
        while not done.is_set():
            i += 1
            try:
                attempt(i, restarted)
            except (KvdRestarted, KvdError):
                time.sleep(0.01)
            except Exception as e:  # noqa: BLE001 - the point of the tests
                errors.append(repr(e))

    t = threading.Thread(target=loop)
    t.start()
    for _ in range(3):
        time.sleep(0.3)
        daemon = restart(kvd, tmp, daemon)
    restarted.set()
    deadline = time.monotonic() + 10
    time.sleep(0.5)
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.05)
    done.set()
    t.join(timeout=30)
    return daemon, errors + (["the racing thread did not end"] if t.is_alive() else [])


def racing_calls(kvd, tmp, daemon):
    """Requests started and extended in a loop on another thread while kvd is SIGKILLed and
    restarted under them: every failure is KvdRestarted or a KvdError, never anything else (a
    call racing the re-attach once raised ValueError from a closed channel). And a KV tensor taken
    before a restart stays usable after the remap and after close(): its mapping is kept while
    the tensor lives."""
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    with Client(daemon.target, worker_name="py-race") as c:
        tensor = c.kv_tensor("default", dtype=torch.uint8, inner_shape=(16,)) if have_torch else None

        def attempt(i, _):
            with c.request(f"race-{i}", pool="default", prompt=list(range(9)), wait_s=5) as r:
                r.extend(1)

        daemon, errors = race_restarts(kvd, tmp, daemon, attempt)
        check(not errors, f"calls racing 3 restarts fail only as KvdRestarted/KvdError ({errors[:3]})")
        if tensor is not None:
            tensor[0, 0, 0, :] = 7  # the old mapping: kept alive by the tensor, not unmapped
            check(int(tensor[0, 0, 0, 0]) == 7, "a KV tensor from before a remap is still mapped")
    if tensor is not None:
        tensor[0, 0, 1, :] = 9  # and after close()
        check(int(tensor[0, 0, 1, 0]) == 9, "a KV tensor outlives close() without a fault")
    return daemon


def racing_steps(kvd, tmp, daemon):
    """Overlapped steps (step_submit, the round trip left in flight) started and ended in a loop
    on another thread while kvd is SIGKILLed and restarted under them: every failure is
    KvdRestarted or a KvdError, never anything else (a call racing the re-attach can meet a
    closed channel) and never a hang; and steps are answered again on the new daemon."""
    from kvd.step import StepBatch, StepRequest
    answered = [0, 0]  # steps answered: in all, started after the last restart
    with Client(daemon.target, worker_name="py-step-race", step_credit_blocks=4) as c:

        def attempt(i, restarted):
            req = StepRequest(f"srace-{i}")
            after = restarted.is_set()
            if c.step_submit(StepBatch().start(req, "default", list(range(100, 109)), max_new_tokens=4)).result()[0].ok:
                c.step(StepBatch().grow(req, 1).end(req, completed=False))
                answered[0] += 1
                answered[1] += after

        daemon, errors = race_restarts(kvd, tmp, daemon, attempt, settled=lambda: answered[1] >= 3)
        check(not errors, f"overlapped steps racing 3 restarts fail only as KvdRestarted/KvdError ({errors[:3]})")
        check(answered[1] >= 3,
              f"overlapped steps are answered again after the restarts ({answered[0]} in all, {answered[1]} after)")
    return daemon


def lease(kvd, tmp):
    """The lease as the client proves it: kvd's acks keep may_write() true past half a lease; when
    kvd goes away the client quiesces (fences, then on_lease_lost) before it re-attaches."""
    d = Daemon(kvd, tmp, SMALL_POOL, name="lease", extra=["--lease-ttl=4"])
    seen = []
    try:
        c = Client(d.target, worker_name="py-lease",
                   on_lease_lost=lambda: seen.append((c.epoch, c.may_write(), c.attached.is_set())))
        c.add_write_fence(lambda: seen.append("fence"))
        try:
            check(c.may_write(), "lease: may write once attached")
            r = c.request("lease-r", pool="default", prompt=list(range(9)), wait_s=5)
            check(r.may_write() and c.may_write(1), "lease: a request of the attachment may write")
            time.sleep(2.6)  # past half a lease (2 s): only acknowledged heartbeats keep it
            check(c.may_write(), "lease: kvd's acks keep the lease provable past half a lease")
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait(timeout=10)
            deadline = time.monotonic() + 5
            while len(seen) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            check(seen[:1] == ["fence"] and len(seen) == 2 and seen[1] == (1, False, False),
                  f"lease: kvd gone, the client stops writing, runs the fences, then on_lease_lost ({seen})")
            check(not c.may_write(), "lease: no writes while detached")
            os.remove(os.path.join(tmp, "lease.ready"))
            d = Daemon(kvd, tmp, SMALL_POOL, name="lease", extra=["--lease-ttl=4"])
            c.wait_attached(10)
            check(c.epoch == 2 and c.may_write(), "lease: re-attached (quiesced), it may write again")
            # The write gate is per attachment: never again for a request from before the re-attach.
            check(not r.may_write() and not c.may_write(1) and c.may_write(2),
                  "lease: a request of the lost attachment never may write again")
            check(c._hello.hello.quiesced and c._hello.hello.previous_worker_id != "",
                  "lease: the re-attach names the lost attachment and, with a hook, says quiesced")
            quiet = Client(d.target, worker_name="py-no-hook")
            check(not quiet._vouches and not quiet._hello.hello.quiesced,
                  "lease: a client with no hook and no no_async_writes vouches for nothing")
            quiet.close()
        finally:
            c.close()
    finally:
        if d.proc.poll() is None:
            d.stop()


def careless_engine(kvd, worker, tmp):
    """kvd-hardening-4's reproduction: an engine whose writer thread is gated by the client's
    may_write() alone (it waits while False and writes on once True), with no on_lease_lost hook,
    across `kvd --takeover`. Before, the client re-attached saying `quiesced`, kvd lifted the fences
    of the process and another tenant's prompt was overwritten (every byte). Now the client cannot
    vouch for the writer, so kvd keeps its blocks fenced; the request's own gate says no."""
    d = Daemon(kvd, tmp, SMALL_POOL, name="careless")
    c = Client(d.target, worker_name="py-careless")
    try:
        r = c.request("careless", pool="default", prompt=list(range(64)), wait_s=5)
        pool = c.pool(r.pool)
        n = pool.bytes_per_token_per_layer

        def write():
            for pos in range(r.num_tokens):
                time.sleep(0.04)
                deadline = time.monotonic() + 30
                while not c.may_write() and time.monotonic() < deadline:
                    time.sleep(0.001)
                for layer in range(pool.num_layers):
                    view = c.layer_view(r.pool, r.blocks[pos // pool.block_tokens], layer)
                    slot = pos % pool.block_tokens
                    view[slot * n:(slot + 1) * n] = slot_bytes(pos, pos, layer, n)

        t = threading.Thread(target=write)
        t.start()
        time.sleep(0.3)
        os.remove(os.path.join(tmp, "careless.ready"))
        successor = Daemon(kvd, tmp, SMALL_POOL, name="careless", extra=["--takeover"])
        check(successor.started, "careless: the takeover serves")
        c.wait_attached(10)
        check(c.epoch == 2 and not r.may_write(), "careless: the request of the lost attachment may not write")
        code, b = run_worker(worker, successor.target, "b", "5000:64")
        check(code == 0, f"careless: another tenant computes its prompt ({b})")
        t.join(timeout=30)
        time.sleep(0.5)
        code, reader = run_worker(worker, successor.target, "reader", "5000:64")
        check(code == 0 and reader.get("cached_tokens") == 60 and reader.get("mismatches") == 0,
              f"careless: its bytes are all there after the careless writer finished ({reader})")
    finally:
        c.close()
        for p in ("successor", "d"):
            daemon = locals().get(p)
            if daemon is not None and daemon.proc.poll() is None:
                daemon.stop()


def main():
    kvd, worker = sys.argv[1], sys.argv[2]
    tmp = tempfile.mkdtemp(prefix="kvd-pyrestart-")
    lease(kvd, tmp)
    careless_engine(kvd, worker, tmp)
    daemon = Daemon(kvd, tmp, SMALL_POOL)
    remaps = []
    try:
        daemon = racing_calls(kvd, tmp, daemon)
        daemon = racing_steps(kvd, tmp, daemon)
        with Client(daemon.target, worker_name="py-ride", on_remap=lambda: remaps.append(1)) as c:
            for i in range(5):
                live = c.request(f"live-{i}", pool="default", prompt=list(range(22)))
                epoch = c.epoch
                daemon = restart(kvd, tmp, daemon)
                deadline = time.monotonic() + 10
                while c.epoch == epoch and time.monotonic() < deadline:
                    time.sleep(0.01)
                check(c.epoch == epoch + 1 and c.attached.is_set(), f"restart {i}: the client re-attached by itself")
                check(len(remaps) == i + 1, f"restart {i}: on_remap said the slabs moved")
                try:
                    live.extend(1)
                    check(False, f"restart {i}: the live request raises KvdRestarted")
                except KvdRestarted as e:
                    check("live-" in str(e), f"restart {i}: the live request raises KvdRestarted ({e})")
                prompt = list(range(500 + 100 * i, 522 + 100 * i))
                with c.request(f"next-{i}", pool="default", prompt=prompt) as r:
                    write(c, r, prompt)
                    check(r.publish(prompt).kept == 5, f"restart {i}: the next request publishes on the new memory")
                rc, res = run_worker(worker, daemon.target, f"cpp-{i}", f"{500 + 100 * i}:22")
                check(rc == 0 and res.get("cached_tokens") == 20 and res.get("mismatches") == 0,
                      f"restart {i}: C++ reads what Python wrote after the restart ({res})")
            # kvd away for longer than a request may wait: request() says why.
            daemon.proc.send_signal(signal.SIGKILL)
            daemon.proc.wait(timeout=10)
            try:
                c.request("late", pool="default", prompt=list(range(9)), wait_s=0.3)
                check(False, "request() while kvd is away fails after wait_s")
            except KvdError as e:
                check("not attached" in e.details and "kvd" in e.details,
                      f"request() while kvd is away fails after wait_s, naming why ({e.details})")
    finally:
        if daemon.proc.poll() is None:
            daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
