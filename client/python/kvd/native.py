"""NativeClient: kvd's steps through the C++ client (kvd._native, a pybind11 module over
client/client.h's Client::Step and Client::StepSubmit), for Python engines whose model holds the
GIL (docs/api.md, "Steps from Python: the native path").

It offers the step part of kvd.Client, so kvd.engine.batch.BatchEngine and other engines written
against kvd.step run on it unchanged:

    client = NativeClient(target, worker_name="engine-0")
    pool = client.pool("default")            # a kvd.client.Pool; pool.maps[0]: the host slab
    future = client.step_submit(batch)       # a kvd.step.StepBatch; growth on credit is placed
    ...                                      # compute into blocks the requests hold
    results = future.result()                # [kvd.step.StepResult]
    client.close()

What differs from kvd.Client's steps: the round trip (its protobuf, its gRPC call, its answer) is
C++ on a client thread with the GIL released, so a Python model runs beside it; Python pays only
for handing the items over (serialized bytes) and reading the answers back. Publishes and ends
given `hold_s` are held back as kvd.Client holds them (their StepResult is `deferred` until the
step that carries them is answered): they go out at the head of the next step with an item that
must go (a start, a checkpoint, a publish or end not held), once `hold_s` has passed at a step, or
with step_flush (close does one); not on hybrid pools, nor with state checkpoints. Growth past the
credit goes out without them (only the C++ client knows it needs a round trip). Host backend only (a CUDA slab is mapped
with kvd.cuda). A kvd restart with new memory (not a handoff, not the fd store) moves the slabs:
requests of the old attachment fail as restarted, may_write(epoch) is False for them, and the engine
takes `client.pool(name)` again for the new mapping. No control-plane calls besides the steps:
use a kvd.Client beside it for those.
"""
import time

import grpc

try:
    from . import _native
except ImportError as e:  # built with kvd when pybind11-dev is installed (client/python/CMakeLists.txt)
    raise ImportError("kvd.native needs kvd._native, the C++ step path, which the kvd build makes when "
                      "pybind11-dev is installed (scripts/setup.sh installs it for the tests)") from e
from .client import Pool
from .errors import KvdError
from .step import IN_FLIGHT_WAITS, GroupTable, InFlight, StepResult, status_code
from .v1 import kvd_pb2

_KINDS = {"start": 0, "grow": 1, "publish": 2, "checkpoint": 3, "end": 4, "preempt": 5}


def _call(fn, *args):
    """fn(*args) on the binding; its ValueError "code:message" raised as a KvdError."""
    try:
        return fn(*args)
    except ValueError as e:
        code, _, message = str(e).partition(":")
        if not code.isdigit():
            code, message = grpc.StatusCode.INVALID_ARGUMENT.value[0], str(e)
        raise KvdError(status_code(int(code)), message) from None


def _items(held):
    """Held (kind, req, arg, StepResult) entries as the items they send."""
    return [(kind, req, arg) for kind, req, arg, _ in held]


def _in_flight(t):
    return None if t is None else InFlight(*t)


class NativeStepFuture:
    """A step in flight (NativeClient.step_submit); as kvd.step.StepFuture."""

    def __init__(self, client, items, results=None):
        self._client, self._items, self._results = client, items, results

    def done(self):
        return self._results is not None or self._client._native.ready()

    def result(self):
        if self._results is None:
            self._results = self._client._finish(self._items)
        return self._results


class _Merged:
    """A step whose results are not one to one with what went out: `slots` holds, per batch item,
    the StepResult of one held back (deferred) or None (the next of the sent ones); `held`, the
    held items sent at its head, whose deferred StepResults take their outcomes."""

    def __init__(self, future, slots, held=()):
        self._future, self._slots, self._held = future, slots, held
        self._results = None

    def done(self):
        return self._future.done()

    def result(self):
        if self._results is None:
            try:
                sent = iter(self._future.result())
            except KvdError as e:
                for *_, r in self._held:  # they went out with a step whose outcome is unknown
                    r.code, r.message, r.deferred = e.code, e.details, False
                raise
            for *_, r in self._held:
                got = next(sent)
                r.code, r.message, r.kept, r.already_cached = got.code, got.message, got.kept, got.already_cached
                r.duplicates, r.no_parent, r.deferred = got.duplicates, got.no_parent, False
            self._results = [s if s is not None else next(sent) for s in self._slots]
        return self._results


class NativeClient:
    """The C++ client attached to kvd at `target` as `worker_name`, asking for
    `step_credit_blocks` of block credit per pool it steps in."""

    def __init__(self, target, worker_name="python-native", step_credit_blocks=128):
        self._native = _call(_native.Client, target, worker_name, step_credit_blocks)
        self.rpc_calls = 0  # steps that made a round trip
        self.rpc_seconds = 0.0  # time spent taking their answers (waiting included)
        self._inflight = None
        self._held = []  # publishes and ends held back: (kind, req, arg, StepResult), in order
        self._held_until = 0.0  # monotonic time by which they go out
        self._load_pools()

    def _load_pools(self):
        self.pools = []
        for k, info in enumerate(self._native.pools()):
            p = Pool(kvd_pb2.PoolInfo.FromString(info))
            p.maps = [self._slab(k, s) for s in range(len(p.slab_sizes))]
            self.pools.append(p)

    def _slab(self, pool, shard):
        try:
            return self._native.slab(pool, shard)
        except (IndexError, ValueError):
            return None  # not mapped here (another rank's shard, a CUDA slab)

    def pool(self, pool):
        """The Pool named `pool` (or with that id)."""
        for p in self.pools:
            if p.name == pool or p.id == pool:
                return p
        raise KvdError(grpc.StatusCode.NOT_FOUND, f"no pool '{pool}'")

    def may_write(self, epoch=None):
        """Whether this process may write into kvd's memory now (for a request of attachment
        `epoch`: False for good once the client has re-attached since)."""
        return self._native.may_write(-1 if epoch is None else epoch)

    def step(self, batch):
        """Applies a kvd.step.StepBatch: a list of StepResult, one per item, in order. Made on
        this thread (no hand-off to the client's): for an engine with nothing to compute meanwhile."""
        return self.step_submit(batch, wait=True).result()

    def step_submit(self, batch, wait=False):
        """The step with its round trip in flight: growth on credit is placed (req.blocks has its
        blocks) before it returns; result() applies the rest. The next step takes this one's
        answer first. `wait`: made and answered before it returns (step())."""
        if self._inflight is not None:
            self._inflight.result()
        holdable = [kind in ("publish", "end") and i in batch.hold_s and not arg.state_checkpoints
                    and not req.group_tables for i, (kind, req, arg) in enumerate(batch.items)]
        must = any(kind != "grow" and not h for (kind, _, _), h in zip(batch.items, holdable))
        now = time.monotonic()
        if must or (self._held and now >= self._held_until):  # what is held goes at the head
            held, self._held = self._held, []
            if not held:
                return self._send(batch.items, batch.computed_tokens, wait)
            f = self._send(_items(held) + list(batch.items),
                           {len(held) + i: c for i, c in batch.computed_tokens.items()}, wait)
            return self._track(_Merged(f, [None] * len(batch.items), held))
        slots, rest, computed = [], [], {}
        for i, (kind, req, arg) in enumerate(batch.items):
            if holdable[i]:
                self._held_until = min(self._held_until, now + batch.hold_s[i]) if self._held else now + batch.hold_s[i]
                slots.append(StepResult(deferred=True))
                self._held.append((kind, req, arg, slots[-1]))
                continue
            if i in batch.computed_tokens:
                computed[len(rest)] = batch.computed_tokens[i]
            slots.append(None)
            rest.append((kind, req, arg))
        return self._track(_Merged(self._send(rest, computed, wait), slots))

    def _track(self, merged):
        """A step still in flight is taken through its merged results, so that the held items it
        carries get their outcomes whoever takes it."""
        if self._inflight is not None:
            self._inflight = merged
        return merged

    def _send(self, items, computed_tokens, wait=False):
        """Hands `items` ((kind, StepRequest, arg)) to the C++ client; a NativeStepFuture (`wait`:
        answered)."""
        native_items = []
        for i, (kind, req, arg) in enumerate(items):
            native = getattr(req, "_native", None)
            if native is None or kind == "start":
                native = req._native = _native.Request(req.id)
                req._native_blocks = 0
            if kind == "start":
                native_items.append((0, native, arg.SerializeToString(), req.id))
            elif kind == "grow":
                native_items.append((1, native, arg, computed_tokens.get(i, 0)))
            else:
                native_items.append((_KINDS[kind], native, arg.SerializeToString(), 0))
        if wait:
            t0 = time.perf_counter()
            try:
                sent, answers = _call(self._native.step, native_items)
            finally:
                self.rpc_seconds += time.perf_counter() - t0
            self.rpc_calls += sent
            return NativeStepFuture(self, items, self._results(items, answers))
        sent = _call(self._native.submit, native_items)
        if not sent:
            return NativeStepFuture(self, items, self._finish(items))
        self.rpc_calls += 1
        for kind, req, _ in items:  # growth placed on credit: its blocks are the request's now
            if kind == "grow":
                self._sync(req)
        f = self._inflight = NativeStepFuture(self, items)
        return f

    def _finish(self, items):
        self._inflight = None
        t0 = time.perf_counter()
        try:
            answers = _call(self._native.result)
        finally:
            self.rpc_seconds += time.perf_counter() - t0
        return self._results(items, answers)

    def _results(self, items, answers):
        """The StepResults of `answers` (the binding's tuples), each request synced."""
        results = []
        for (kind, req, _), a in zip(items, answers):
            code, message, waiting, kept, cached, dups, no_parent, outcomes, fresh, in_flight = a
            self._sync(req)
            results.append(StepResult(status_code(code), message, waiting, kept, cached, dups,
                                      no_parent, outcomes, fresh, _in_flight(in_flight)))
        return results

    @staticmethod
    def _sync(req):
        """The Python StepRequest takes the C++ one's state (only the table's new entries when it
        grew; all of it after a start)."""
        (blocks, req.num_tokens, req.live, req.waiting, req.epoch, req.cached_tokens, req.resumed,
         req.resumed_tokens, req.engine_state, in_flight, wait, code, message, tables, req.reported_computed,
         req.pool_id) = req._native.state(req._native_blocks)
        if req._native_blocks == 0:
            req.blocks = blocks
        else:
            req.blocks += blocks
        req._native_blocks = len(req.blocks)
        req.in_flight = _in_flight(in_flight)
        req.in_flight_wait = IN_FLIGHT_WAITS.get(wait, "not_waited")
        req.error = None if code == 0 else KvdError(status_code(code), message)
        if tables:
            req.group_tables = [GroupTable(*t) for t in tables]

    def step_flush(self):
        """Sends the publishes and ends held back and tells kvd of growth placed on credit, after
        the step in flight."""
        if self._inflight is not None:
            self._inflight.result()
        if self._held:
            held, self._held = self._held, []
            _Merged(self._send(_items(held), {}), [], held).result()
        _call(self._native.flush)

    def step_credit(self, pool, group=0):
        """Credit blocks held now in `pool` (name or id), in KV group index `group`."""
        return self._native.credit(self.pool(pool).id, group)

    def close(self):
        """Takes the step in flight's answer, then detaches: kvd releases what this worker still holds."""
        if self._native is not None:
            try:  # what is held back goes out before the attachment ends (best effort)
                self.step_flush()
            except KvdError:
                pass
            self.pools = []
            self._native.close()
            self._native = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
