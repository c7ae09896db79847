#!/usr/bin/env python3
"""The step lane (docs/api.md, "The step lane") against a real kvd: a Client's steps go over one
connection of the side socket and not gRPC; and the lane as a careless or hostile process would
drive it, on the raw socket: a hello for another process's worker or for no worker is refused; a
frame that is not a StepRequest, or a step naming another worker, is answered INVALID_ARGUMENT and
the lane goes on; a length past the limit is answered RESOURCE_EXHAUSTED and the lane closed; a
frame cut off mid-way changes nothing, and one left unfinished is closed after 5 s; a step applied on a lane that closed before its answer is
answered (replayed) when the same seq comes over gRPC; one process opens at most 16 lanes; more
lanes than the side socket serves handshakes at once do not lock new workers out of their slabs;
Client.step_warm_up opens the lane and takes the credit before the first step (a pool kvd does not
have is named, and nothing is sent).
Afterwards nothing is leaked; and a hot handoff (kvd --takeover) cuts the client's lane, and it
steps on a new one to the successor.

Usage: test_step_lane.py KVD_BINARY   (PYTHONPATH=<build>/python:<this dir>)
"""
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time

import grpc

from kvd import Client, KvdError, StepBatch, StepRequest
from kvd.v1 import kvd_pb2
from kvd_testlib import SMALL_POOL, Daemon, check, finish

OTHER = """
import sys, time
from kvd import Client
c = Client(sys.argv[1], worker_name="other")
print(c.worker_id, flush=True)
time.sleep(60)
"""


# A process that attaches and opens step lanes until kvd refuses one; prints how many, waits.
HOG = """
import sys, time
from kvd import Client
from test_step_lane import hello
c = Client(sys.argv[1], worker_name="hog")
lanes = []
while len(lanes) < 40:
    s, greeting = hello(c.side_socket, c.worker_id)
    if greeting != "OK":
        break
    lanes.append(s)
print(len(lanes), flush=True)
time.sleep(60)
"""


def hello(path, worker_id):
    """A raw lane: (socket, kvd's greeting)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    h = f"STEP {worker_id}".encode()
    s.sendall(struct.pack("=I", len(h)) + h)
    (n,) = struct.unpack("=I", read(s, 4))
    return s, read(s, n).decode()


def read(s, n):
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionResetError("closed")
        out += chunk
    return out


def exchange(s, body):
    """Sends one frame; (status code, message or StepResponse)."""
    s.sendall(struct.pack("<I", len(body)) + body)
    (n,) = struct.unpack("<I", read(s, 4))
    payload = read(s, n)
    (code,) = struct.unpack("<I", payload[:4])
    if code != 0:
        return code, payload[4:].decode()
    resp = kvd_pb2.StepResponse()
    resp.ParseFromString(payload[4:])
    return 0, resp


class NoGrpcSteps:
    """Stands in for the client's stub: any Step over gRPC fails the test's step."""

    def __init__(self, stub):
        self._stub = stub

    def __getattr__(self, name):
        if name == "Step":
            raise AssertionError("a step went over gRPC")
        return getattr(self._stub, name)


def idle(obs, what, credit):
    r = obs.report()
    p = r.pools[0]
    check(r.live_requests == 0 and p.owned_blocks == credit and p.free_blocks + p.cached_blocks + credit == p.capacity_blocks,
          f"{what}: nothing leaked (live {r.live_requests}, owned {p.owned_blocks}, credit {credit})")


def warm_up(daemon, obs):
    """Client.step_warm_up opens the lane and takes the credit before the first step, which then
    goes out on that lane; a pool kvd does not have is named and nothing is sent; warming up again
    takes no more credit."""
    with Client(daemon.target, worker_name="warm", step_credit_blocks=8) as c:
        calls = c.rpc_calls
        try:
            c.step_warm_up(["default", "no-such-pool"])
            check(False, "a warm-up naming no pool of kvd's is refused")
        except KvdError as e:
            check(e.code == grpc.StatusCode.NOT_FOUND and "no-such-pool" in e.details,
                  f"a warm-up naming no pool of kvd's is refused, naming it ({e.code.name}: {e.details})")
        check(c.rpc_calls == calls and c._stepper.lane is None and c.step_credit("default") == 0,
              "the refused warm-up sent nothing, opened no lane, took no credit")
        c.step_warm_up(["default"])
        lane = c._stepper.lane
        check(lane is not None and c.rpc_calls == calls + 1 and c.step_credit("default") == 8,
              f"a warm-up opens the lane and takes the credit in one step ({c.rpc_calls - calls} round "
              f"trips, credit {c.step_credit('default')})")
        c.step_warm_up(["default"])
        c.step_warm_up([0])
        check(c.step_credit("default") == 8 and obs.report().pools[0].owned_blocks == 8,
              f"warming up again takes no more credit ({c.step_credit('default')} held)")
        r = StepRequest("warm-a")
        calls = c.rpc_calls
        res = c.step(StepBatch().start(r, "default", list(range(300, 317))))
        check(res[0].ok and c._stepper.lane is lane and c.rpc_calls == calls + 1,
              "the first start after a warm-up goes out on the lane already open, in one round trip")
        c.step(StepBatch().end(r, completed=False))
        idle(obs, "after a warmed-up client's request", 8)


def run(daemon, obs):
    with Client(daemon.target, worker_name="lane", step_credit_blocks=8) as c:
        # --- a client's steps go over the lane --------------------------------------------
        real_stub, c._stub = c._stub, NoGrpcSteps(c._stub)
        try:
            r = StepRequest("a")
            prompt = list(range(100, 117))
            res = c.step(StepBatch().start(r, "default", prompt))
            f = c.step_submit(StepBatch().grow(r, 40).publish(r, prompt, 4).end(r))
            res += f.result()
            check(all(x.ok for x in res) and c._stepper.lane is not None,
                  f"steps and an overlapped step went over the lane ({[x.message for x in res if not x.ok]})")
        finally:
            c._stub = real_stub
        r = StepRequest("b")
        c.step(StepBatch().start(r, "default", prompt))
        check(r.cached_tokens == 16, f"what was published on the lane is a hit ({r.cached_tokens} cached tokens)")
        c.step(StepBatch().end(r))

        path, me = c.side_socket, c.worker_id
        # --- hellos kvd refuses --------------------------------------------------------------
        other = subprocess.Popen([sys.executable, "-c", OTHER, daemon.target], stdout=subprocess.PIPE, text=True)
        try:
            theirs = other.stdout.readline().strip()
            s, greeting = hello(path, theirs)
            s.close()
            check(greeting.startswith("ERR") and theirs in greeting,
                  f"a lane for another process's worker is refused ({greeting})")
        finally:
            other.kill()
            other.wait()
        s, greeting = hello(path, "no-such-worker")
        s.close()
        check(greeting.startswith("ERR"), f"a lane for no worker is refused ({greeting})")

        # --- bad frames on a lane of its own ----------------------------------------------
        s, greeting = hello(path, me)
        check(greeting == "OK", f"a lane of its own opens ({greeting})")
        code, msg = exchange(s, b"\xff\xff\xff not a protobuf")
        check(code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "not a StepRequest" in msg,
              f"garbage is answered INVALID_ARGUMENT ({msg})")
        code, msg = exchange(s, kvd_pb2.StepRequest(worker_id=theirs, seq=1).SerializeToString())
        check(code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and theirs in msg,
              f"a step naming another worker is refused ({msg})")
        code, msg = exchange(s, kvd_pb2.StepRequest(worker_id=me, seq=0).SerializeToString())
        check(code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "seq" in msg, f"seq 0 is refused as on gRPC ({msg})")
        # The client's own steps and this lane share the worker's seq: send the next one here.
        seq = c._stepper.seq + 1
        code, resp = exchange(s, kvd_pb2.StepRequest(worker_id=me, seq=seq).SerializeToString())
        check(code == 0 and resp.seq == seq, f"after all that, the lane answers a step ({code})")
        s.sendall(struct.pack("<I", 64 << 20))
        (n,) = struct.unpack("<I", read(s, 4))
        payload = read(s, n)
        check(struct.unpack("<I", payload[:4])[0] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and b"at most" in payload,
              f"a 64 MiB length is refused ({payload[4:].decode()})")
        try:
            closed = s.recv(1) == b""
        except OSError:
            closed = True
        check(closed, "and that lane is closed")
        s.close()
        # Cut off mid-frame.
        s, _ = hello(path, me)
        s.sendall(struct.pack("<I", 100) + b"x" * 10)
        s.close()
        # Started and left unfinished: kvd gives a frame 5 s, then closes the lane.
        s, _ = hello(path, me)
        s.sendall(struct.pack("<I", 1 << 20) + b"x" * 10)
        t = time.monotonic()
        s.settimeout(20)
        try:
            closed = s.recv(1) == b""
        except OSError:
            closed = True
        waited = time.monotonic() - t
        s.close()
        check(closed and 4 < waited < 15, f"a frame left unfinished: kvd closes the lane after {waited:.1f} s")

        # --- a step applied whose answer the lane never delivered --------------------------
        s, _ = hello(path, me)
        seq += 1
        step = kvd_pb2.StepRequest(worker_id=me, seq=seq)
        item = step.items.add(request_id="lost")
        item.start.admit.namespace.pool = "default"
        item.start.admit.prompt.extend(range(300, 309))
        item.start.admit.worker_id, item.start.admit.request_id = me, "lost"
        s.sendall(struct.pack("<I", step.ByteSize()) + step.SerializeToString())
        s.close()  # the answer is never read
        again = c._stub.Step(step, timeout=10)
        check(again.seq == seq and again.results[0].code == 0 and again.results[0].acquired.num_tokens == 9,
              f"the same seq over gRPC gets the step's answer (replayed {again.replayed})")
        end = kvd_pb2.StepRequest(worker_id=me, seq=seq + 1)
        end.items.add(request_id="lost").end.SetInParent()
        c._stepper.seq = seq + 1
        check(c._stub.Step(end, timeout=10).results[0].code == 0, "and it ends")

        # --- lanes per process, and more lanes than handshakes at once -------------------------
        mine, greeting = [], "OK"
        while greeting == "OK" and len(mine) < 40:
            x, greeting = hello(path, me)
            mine.append(x)
        check(len(mine) == 16 and "busy" in greeting,
              f"one process opens 16 lanes (its client's among them), then is refused ({greeting})")
        hogs = [subprocess.Popen([sys.executable, "-c", HOG, daemon.target], stdout=subprocess.PIPE, text=True)
                for _ in range(4)]
        try:
            opened = [int(h.stdout.readline() or 0) for h in hogs]
            with Client(daemon.target, worker_name="late") as late:
                ok = all(m is not None for p in late.pools for m in p.maps)
                r = StepRequest("late")
                late.step(StepBatch().start(r, "default", list(range(500, 509))))
                late.step(StepBatch().end(r))
            check(opened == [16] * 4 and ok and r.cached_tokens == 0,
                  f"with {sum(opened) + 16} lanes open ({opened} from four other processes), a new worker still maps "
                  "its slabs and steps")
        finally:
            for h in hogs:
                h.kill()
                h.wait()
            for x in mine:
                x.close()
        r = StepRequest("c")
        c.step(StepBatch().start(r, "default", prompt))
        c.step(StepBatch().end(r))
        check(r.cached_tokens == 16, "the client's own lane still serves its steps")
        idle(obs, "after the hostile lanes", c.step_credit("default"))

        # --- a hot handoff cuts the lane; the client steps on the successor's ---------------
        x = StepRequest("x")
        c.step(StepBatch().start(x, "default", list(range(700, 709))))
        old_lane = c._stepper.lane
        os.remove(daemon.ready)
        successor = Daemon(daemon.kvd, daemon.tmp, SMALL_POOL, extra=["--takeover"])
        check(successor.started, "the takeover serves")
        c.wait_attached(10)
        try:
            c.step(StepBatch().grow(x, 40))
            lost = False
        except KvdError:
            lost = True
        res = c.step(StepBatch().end(x))
        y = StepRequest("y")
        c.step(StepBatch().start(y, "default", list(range(700, 709))))
        lane = c._stepper.lane
        check(c.epoch == 2 and old_lane.broken and lane is not None and lane is not old_lane and lane.epoch == 2 and y.live,
              f"after the handoff a request starts on a new lane to the successor (x lost {lost}, its end "
              f"{res[0].code.name})")
        c.step(StepBatch().end(y))
        return successor


def main():
    kvd = sys.argv[1]
    tmp = tempfile.mkdtemp(prefix="kvd-py-lane-")
    daemon = Daemon(kvd, tmp, SMALL_POOL)
    daemon.kvd, daemon.tmp, daemon.ready = kvd, tmp, os.path.join(tmp, "kvd.ready")
    successor = None
    try:
        with Client(daemon.target, worker_name="observer", map_slabs=False) as obs:
            try:
                warm_up(daemon, obs)
                successor = run(daemon, obs)
            except (KvdError, OSError, AssertionError) as e:
                check(False, f"the lane test ran through ({e!r})")
    finally:
        for d in (successor, daemon):
            if d is not None and d.proc.poll() is None:
                d.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
