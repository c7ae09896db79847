"""Steps (kvd.proto "Step"; docs/api.md, "Steps"): what one scheduler step decided for every request
it touched, applied in one round trip, or in none when every item is a growth the worker's block
credit covers (kvd learns of it with the next step that goes out).

    batch = StepBatch()
    batch.start(a, pool="default", prompt=tokens, max_new_tokens=64)   # admission + prefix acquire
    batch.grow(b, 1)                                                    # decode
    batch.end(c, publish_blocks=n, more_tokens=generated)
    results = client.step(batch)          # results[i]: the i-th item's StepResult

On a hybrid pool, publish, end, checkpoint and preempt items may carry state checkpoints
(docs/hybrid.md §2.7, §2.9):
`state_checkpoints=[(group index, position_tokens, slot)]`, slots of the request's own state table
holding the state at exactly that position; the item's StepResult has one checkpoint_outcomes
entry each (kvd_pb2.CHECKPOINT_*) and fresh_slots, and a kept slot is swapped for its fresh spare
in req.group_tables (the kept one is the pool's now: cached and immutable).

Growth covered by credit is placed at once (appended to req.blocks) and held back, one item per
request; it goes out at the head of the next step that must (any other item, growth credit does not
cover, or credit below half of what the client asks for). Credit is per (pool, KV group): on a
hybrid pool (docs/hybrid.md §2.4) each attention group has its own, and a grow is placed from it
as kvd would apply it (every group's table drops the window blocks below the new first position and
gains its blocks up to the horizon) once kvd's word on the request's computed tokens is known: the
first grow after a start goes to kvd (it settles a hit's checkpoint slot), as does one a state group
lacks a slot for; held hybrid grows go out one item each, naming their credit `{group, block}`.
A step that fails as a whole is sent again with the same sequence number while the attachment
lasts (kvd answers a repeat from its record). kvd never takes credit back: it asks
(StepCredit.wanted, per group), and the next step that goes out returns that many unplaced blocks
by name. A step whose outcome stays unknown drops the credit list until an answer lists it again.

Publishes and ends given `hold_s` are held back the same way (their StepResult is `deferred`, OK
for now, and filled in when the step carrying them is answered): they go out after the held
growth, before the items of the next step that must go out, or once `hold_s` has passed at a
step, or with Client.step_flush (Client.close does one). Until then their blocks are the
request's own in kvd: a worker that dies first has them released unpublished, as any live
request's. Not on hybrid pools, nor with state checkpoints (their answer changes the tables).

Client.step_submit sends a step without waiting (grpc's future API) and returns a StepFuture:
the engine computes into the blocks it already owns (growth on credit is placed before it
returns) while the round trip is in flight, then takes result() (starts, growth past the credit).
Steps after it that need no round trip (growth the credit covers, publishes and ends held back)
are placed while it is still in flight, so an engine can run decode steps while kvd answers its
starts; the first step that must go out waits for its answer first. kvd's answer lists the credit
as it was when the step was built: blocks placed since are taken off that list.
"""
import select
import socket
import struct
import time

import grpc

from .errors import KvdError, KvdRestarted
from .v1 import kvd_pb2


class GroupTable:
    """One KV group's blocks of a request on a hybrid pool (docs/hybrid.md §2.4), as pool-wide
    indices from the group's range. Full: blocks[i] holds positions [i*bt, (i+1)*bt);
    sliding_window / chunked_local: blocks[i] holds block position first_block_position + i (kvd
    released those below); state: the running slot, then the spare. On a hit, a state group's
    `checkpoint_slot` is the cached slot holding the state at exactly cached_tokens, to copy into the
    running slot before computing (read-only; it stands for the spare until the next grow, which
    hands the spare out); None otherwise."""

    def __init__(self, name, first_block_position=0, blocks=(), checkpoint_slot=None):
        self.name = name
        self.first_block_position = first_block_position
        self.blocks = list(blocks)
        self.checkpoint_slot = checkpoint_slot

    @classmethod
    def from_proto(cls, t):
        return cls(t.group, t.first_block_position, t.blocks,
                   t.checkpoint_slot if t.HasField("checkpoint_slot") else None)

    def __repr__(self):
        return (f"GroupTable({self.name!r}, first_block_position={self.first_block_position}, blocks={self.blocks}, "
                f"checkpoint_slot={self.checkpoint_slot})")


class InFlight:
    """A start's next prompt blocks that another live request of its namespace (tenant salt
    included) is computing now, acquired and not yet published (docs/architecture.md, "Prefixes in
    flight"): `blocks` of them from block position `first_block`, by `request_id`, which has
    published `published_tokens` of its chain and reported `computed_tokens` (hybrid grows; 0
    unknown). Never names another namespace's request."""

    def __init__(self, first_block=0, blocks=0, request_id="", published_tokens=0, computed_tokens=0):
        self.first_block, self.blocks, self.request_id = first_block, blocks, request_id
        self.published_tokens, self.computed_tokens = published_tokens, computed_tokens

    @classmethod
    def from_proto(cls, msg, field="in_flight"):
        """The InFlight in `msg`.`field`, or None when unset."""
        if not msg.HasField(field):
            return None
        f = getattr(msg, field)
        return cls(f.first_block, f.blocks, f.request_id, f.published_tokens, f.computed_tokens)

    def __repr__(self):
        return (f"InFlight(first_block={self.first_block}, blocks={self.blocks}, request_id={self.request_id!r}, "
                f"published_tokens={self.published_tokens}, computed_tokens={self.computed_tokens})")


# How a start's wait for blocks in flight ended (kvd_pb2.InFlightWait), by name.
IN_FLIGHT_WAITS = {kvd_pb2.IN_FLIGHT_NOT_WAITED: "not_waited", kvd_pb2.IN_FLIGHT_PUBLISHED: "published",
                   kvd_pb2.IN_FLIGHT_RELEASED: "released", kvd_pb2.IN_FLIGHT_TIMED_OUT: "timed_out"}


def _state_checkpoints(entries):
    """(group index, position_tokens, slot) tuples as the wire's StateCheckpoint."""
    return [kvd_pb2.StateCheckpoint(group=g, position_tokens=p, slot=s) for g, p, s in entries]


def _swap_kept_slots(tables, entries, outcomes, fresh_slots):
    """A publish's answer applied to a request's state tables: each kept checkpoint's slot (the
    pool's now) is replaced by the fresh spare kvd handed out, or dropped when it handed out none;
    a slot kept in no table, or another outcome, changes nothing."""
    for c, (group, _, slot) in enumerate(entries):
        if c >= len(outcomes) or outcomes[c] != kvd_pb2.CHECKPOINT_KEPT or not 0 <= group < len(tables):
            continue
        slots = tables[group].blocks
        if slot not in slots:
            continue
        fresh = fresh_slots[c] if c < len(fresh_slots) else -1
        if fresh >= 0:
            slots[slots.index(slot)] = fresh
        else:
            slots.remove(slot)


def _apply_group_grow(tables, result):
    """A hybrid pool's grow answer applied to a request's tables: each group drops its blocks below
    the new first position and appends the blocks handed out. Raises KvdError INTERNAL, changing
    nothing, when the answer does not match the tables."""
    if len(result.group_tables) != len(tables) or any(
            d.group != t.name or d.first_block_position < t.first_block_position
            for d, t in zip(result.group_tables, tables)):
        raise KvdError(grpc.StatusCode.INTERNAL,
                       f"kvd answered a grow with groups {[d.group for d in result.group_tables]} for tables {tables}")
    for d, t in zip(result.group_tables, tables):
        drop = min(d.first_block_position - t.first_block_position, len(t.blocks))
        t.blocks = t.blocks[drop:] + list(d.blocks)
        t.first_block_position = d.first_block_position


def _plan_group_grow(pool, req, n, c):
    """A hybrid request's grow to `n` positions, `c` computed, as kvd applies it (docs/hybrid.md §2.4;
    client/client_step.cc PlanGroupGrow): per group (new first block position, blocks dropped, blocks
    appended). None when only kvd can apply it: a state group short of a slot (a hit's checkpoint
    stands for its spare), or tables that do not match the pool's groups."""
    if len(req.group_tables) != len(pool.groups):
        return None
    bt = pool.block_tokens
    horizon = -(-min(n, c + pool.step_tokens) // bt)
    plan = []
    for g, t in zip(pool.groups, req.group_tables):
        first = t.first_block_position
        end = first + len(t.blocks)
        if g.kind == "full":
            lo, hi = 0, -(-n // bt)
        elif g.kind == "sliding_window":
            lo, hi = min(max(0, c - (g.window - 1)) // bt, horizon), horizon
        elif g.kind == "chunked_local":
            lo, hi = min((c // g.chunk) * g.chunk // bt, horizon), horizon
        elif g.kind == "state" and len(t.blocks) >= 2:
            lo, hi = first, end
        else:
            return None
        lo = max(lo, first)
        plan.append((lo, min(lo, end) - first, max(0, hi - max(end, lo))))
    return plan


class StepRequest:
    """A request driven by steps; the engine keeps it, steps update it."""

    def __init__(self, request_id):
        self.id = request_id
        self.pool_id = 0
        self.blocks = []
        # Hybrid pools: a GroupTable per KV group, in the pool's group order (`blocks` is the first
        # full group's); each grow drops the window blocks kvd released. Empty for pools without groups.
        self.group_tables = []
        self.num_tokens = 0
        self.cached_tokens = 0
        self.resumed = False
        self.resumed_tokens = []
        self.engine_state = b""
        self.waiting = False   # started, not admitted yet: start it again in a later step
        # Blocks in flight (InFlight or None): while `waiting` on them, what it waits for; once
        # acquired, what its lookup stopped at (it computes those blocks itself). `in_flight_wait`:
        # how a wait for them ended ("not_waited", "published", "released", "timed_out").
        self.in_flight = None
        self.in_flight_wait = "not_waited"
        self.live = False      # acquired and not ended
        self.error = None      # a KvdError kvd answered for growth placed earlier: End or preempt it
        self.epoch = 0
        # Hybrid pools: the computed tokens kvd holds for the request since its last grow answer
        # (-1: none since the start); a grow is placed from credit only once it is known.
        self.reported_computed = -1

    def group_table(self, name):
        """The GroupTable of group `name`; None when the pool has no such group."""
        return next((t for t in self.group_tables if t.name == name), None)


class StepResult:
    """One item's outcome. Publish and end items on a hybrid pool: `checkpoint_outcomes`, one
    kvd_pb2.CHECKPOINT_* per state checkpoint offered, in order, and `fresh_slots` (the spare that
    replaced a kept slot, -1 otherwise)."""

    def __init__(self, code=grpc.StatusCode.OK, message="", waiting=False, kept=0, already_cached=0,
                 duplicates=0, no_parent=0, checkpoint_outcomes=(), fresh_slots=(), in_flight=None, deferred=False):
        self.code, self.message, self.waiting = code, message, waiting
        # A publish or end held back (hold_s): OK for now; the step that carries it fills in its
        # outcome (code, kept, ...) in this object and clears `deferred`.
        self.deferred = deferred
        self.in_flight = in_flight  # start: the blocks in flight it waits for (`waiting`), or found
        self.kept, self.already_cached, self.duplicates, self.no_parent = kept, already_cached, duplicates, no_parent
        self.checkpoint_outcomes, self.fresh_slots = list(checkpoint_outcomes), list(fresh_slots)

    @property
    def ok(self):
        return self.code == grpc.StatusCode.OK


class StepBatch:
    def __init__(self):
        self.items = []
        self.computed_tokens = {}  # item index -> a grow's computed_tokens (hybrid pools)
        self.hold_s = {}  # item index -> how long a publish or end may be held back
        self.ask_credit = True  # False: the step asks kvd for no block credit (Request.extend's)
        self.credit_pools = []  # pools whose credit the step asks for with no item (Client.step_warm_up)

    def start(self, req, pool, prompt, max_new_tokens=0, session="", resume_from="", cache_salt="", adapter="",
              max_wait_s=30.0, peer="", wait_in_flight_s=0.0):
        """A new request. `wait_in_flight_s` > 0: when another live request of the namespace is
        computing the prompt's next blocks, wait up to that long (at most 30 s) for it to publish
        them before admission; meanwhile the start answers `waiting` with `in_flight` set (send it
        again in a later step, as a start waiting for admission)."""
        ns = kvd_pb2.Namespace(pool=pool, cache_salt=cache_salt, adapter=adapter)
        admit = kvd_pb2.AdmitRequest(namespace=ns, prompt=list(prompt), max_new_tokens=max_new_tokens,
                                     session_id=session, resume_from=resume_from)
        self.items.append(("start", req, kvd_pb2.StartRequest(
            admit=admit, max_wait_ms=max(1, int(max_wait_s * 1000)), peer=peer,
            wait_for_in_flight_ms=int(wait_in_flight_s * 1000))))
        return self

    def grow(self, req, tokens, computed_tokens=0):
        """`tokens` more positions. Hybrid pools: `computed_tokens` is the engine's computed tokens
        after the step that just ran (0: unchanged, which goes to kvd); window blocks below
        computed - (W - 1) are dropped from req.group_tables. Placed from each attention group's
        credit without a round trip once a grow of the request has been answered since its start
        (and its computed tokens do not go back). Ignored on pools without groups."""
        self.items.append(("grow", req, tokens))
        if computed_tokens:
            self.computed_tokens[len(self.items) - 1] = computed_tokens
        return self

    def publish(self, req, tokens, num_blocks, state_checkpoints=(), hold_s=0.0):
        """The request's first `num_blocks` blocks, filled for `tokens`. Hybrid pools:
        `state_checkpoints`, (group index, position_tokens, slot) of the request's state slots,
        published after the blocks (before a grow of the same step releases their window).
        `hold_s` > 0: the publish may be held back that long, to ride the next step that goes out
        anyway (its StepResult is `deferred` until then); not on hybrid pools."""
        self.items.append(("publish", req, kvd_pb2.StepPublish(tokens=list(tokens), num_blocks=num_blocks,
                                                               state_checkpoints=_state_checkpoints(state_checkpoints))))
        if hold_s > 0:
            self.hold_s[len(self.items) - 1] = hold_s
        return self

    def checkpoint(self, req, tokens, engine_state=b"", state_checkpoints=()):
        """A generation checkpoint of `tokens` (the positions with KV). Hybrid pools with a state
        group: `state_checkpoints`, one (group index, len(tokens), slot) per state group, the slot
        holding the state there; the record keeps it and a fresh spare takes its place in the
        request's state table (StepResult.fresh_slots)."""
        self.items.append(("checkpoint", req, kvd_pb2.CheckpointRequest(
            tokens=list(tokens), engine_state=engine_state, state_checkpoints=_state_checkpoints(state_checkpoints))))
        return self

    def end(self, req, publish_blocks=0, more_tokens=(), completed=True, state_checkpoints=(), hold_s=0.0):
        """Publishes the first `publish_blocks` blocks and releases. Hybrid pools:
        `state_checkpoints` as publish's, e.g. the tail (the state at the last full block).
        `hold_s` > 0: held back as publish's; the request is no longer live here at once, its
        blocks stay its own in kvd until the end goes out (a crash first: released unpublished)."""
        self.items.append(("end", req, kvd_pb2.EndRequest(publish_blocks=publish_blocks, more_tokens=list(more_tokens),
                                                          completed=completed,
                                                          state_checkpoints=_state_checkpoints(state_checkpoints))))
        if hold_s > 0:
            self.hold_s[len(self.items) - 1] = hold_s
        return self

    def preempt(self, req, tokens=(), engine_state=b"", state_checkpoints=()):
        """Checkpoints `tokens` (none: no checkpoint) and releases interrupted; a later start with
        resume_from continues it. Hybrid pools: `state_checkpoints` as checkpoint's; a resume
        answers the state as the state group's GroupTable.checkpoint_slot."""
        self.items.append(("preempt", req, kvd_pb2.CheckpointRequest(
            tokens=list(tokens), engine_state=engine_state, state_checkpoints=_state_checkpoints(state_checkpoints))))
        return self


def _blocks_for(tokens, block_tokens):
    return (tokens + block_tokens - 1) // block_tokens


class StepFuture:
    """A step in flight (Client.step_submit): `result()` waits for kvd's answer and applies it (the
    list of StepResult, as Client.step returns); `done()` says whether that would not block. Items
    placed without a round trip (growth on credit, held publishes and ends) already hold their
    outcome. The next step of the same client waits for this one first (its sequence number and
    credit follow from the answer)."""

    def __init__(self, stepper, results, pending=None, call=None):
        self._stepper, self._results, self._pending, self._call = stepper, results, pending, call
        self._error = None
        self._settled = pending is None

    def done(self):
        return self._settled or self._call is None or self._call.done()

    def result(self):
        with self._stepper._client._step_lock:
            self._stepper._settle(self)
        if self._error is not None:
            raise self._error
        return self._results


LANE_MAX_FRAME = 4 << 20  # kvd's limit for one step on a lane (server/rpc/step_lane.cc); larger go by gRPC
LANE_RETRY_S = 5.0        # after kvd refused a lane, steps go by gRPC this long before it is asked again


class StepLane:
    """A worker's steps over one connection of kvd's side socket (docs/api.md, "The step lane"):
    a 4-byte little-endian length and a StepRequest out; a length, a 4-byte status code and the
    StepResponse (or the status message) back. One step at a time, as on gRPC; kvd applies it as
    Step does, so the same seq sent again over gRPC after a broken lane gets the same answer."""

    def __init__(self, path, worker_id, epoch, timeout_s=30.0):
        self.epoch, self.worker_id, self.broken = epoch, worker_id, False
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(timeout_s)
            self.sock.connect(path)
            hello = f"STEP {worker_id}".encode()
            self.sock.sendall(struct.pack("=I", len(hello)) + hello)
            (n,) = struct.unpack("=I", self._read(4))
            greeting = self._read(n)
            if greeting != b"OK":
                raise KvdError(grpc.StatusCode.UNAVAILABLE, "kvd refused a step lane: " + greeting.decode(errors="replace"))
            self.poll = select.poll()  # poll, not select: a CUDA process's fds pass 1024
            self.poll.register(self.sock, select.POLLIN)
        except BaseException:
            self.sock.close()
            raise

    def _read(self, n):
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionResetError("kvd closed the step lane")
            out += chunk
        return bytes(out)

    def send(self, data):
        """Sends one serialized StepRequest; the _LaneCall that takes its answer."""
        self.sock.sendall(struct.pack("<I", len(data)) + data)
        return _LaneCall(self)

    def close(self):
        self.broken = True
        self.sock.close()


class _LaneCall:
    """A step sent on a lane: done() and result() as grpc's future has them."""

    def __init__(self, lane):
        self._lane = lane

    def done(self):
        if self._lane.broken:
            return True
        try:
            return bool(self._lane.poll.poll(0))
        except (OSError, ValueError):
            return True

    def result(self):
        lane = self._lane
        try:
            (n,) = struct.unpack("<I", lane._read(4))
            body = lane._read(n)
        except socket.timeout:
            lane.close()
            raise KvdError(grpc.StatusCode.DEADLINE_EXCEEDED, "kvd did not answer a step on its lane in time") from None
        except (OSError, ValueError) as e:  # kvd went away, or handed over: the step may be applied
            lane.close()
            raise KvdError(grpc.StatusCode.UNAVAILABLE, f"step lane closed: {e}") from None
        (code,) = struct.unpack("<I", body[:4])
        if code != 0:
            raise KvdError(status_code(code), body[4:].decode(errors="replace"))
        resp = kvd_pb2.StepResponse()
        resp.ParseFromString(body[4:])
        return resp


class Stepper:
    """The client's step state: sequence number, credit per pool, growth, publishes and ends held
    back, the step in flight."""

    def __init__(self, client, credit_blocks):
        self._client = client
        self.credit_blocks = credit_blocks
        self.epoch = None
        self.seq = 0
        # Credit is per (pool id, KV group index); a pool without groups is group 0.
        self.credit = {}     # (pool, group) -> [block]
        self.wanted = {}     # (pool, group) -> blocks kvd asked back, returned by the next step
        # Growth placed on credit, in order: [req, tokens, [blocks], [group per block] (hybrid) or
        # None, computed_tokens]. One entry per request on a pool without groups (_held_at), one
        # per grow on a hybrid pool (each has its own window).
        self.held = []
        self._held_at = {}   # StepRequest -> its entry in `held` (pools without groups)
        self.ops = []        # publishes and ends held back: [kind, req, arg, StepResult, send by]
        self.peak = {}       # (pool, group) -> most blocks one step took
        self.inflight = None  # the StepFuture whose answer has not been applied yet
        self.lane = None      # the StepLane of this attachment, once opened
        self.lane_refused = None  # (epoch, when, why) kvd last would not open one: steps go by gRPC

    def _want(self, key):
        if self.credit_blocks <= 0:
            return 0
        want = max(self.credit_blocks, 2 * self.peak.get(key, 0))
        pool = self._client.pool(key[0])
        if pool.groups:  # kvd grants at most an eighth of a group: ask for no more, or credit looks low
            want = min(want, max(1, pool.groups[key[1]].capacity // 8))
        return want

    @staticmethod
    def _keys(pool):
        """A pool's credit keys: group 0, or a hybrid pool's attention groups (state slots come
        from kvd's answers)."""
        if not pool.groups:
            return ((pool.id, 0),)
        return tuple((pool.id, k) for k, g in enumerate(pool.groups) if g.kind != "state")

    def credit_of(self, pool, group=None):
        """Credit blocks held in `pool` (a Pool): in KV group index `group`, or in all of them."""
        if group is not None:
            return len(self.credit.get((pool.id, group), ()))
        return sum(len(self.credit.get(k, ())) for k in self._keys(pool))

    def _place_group_grow(self, pool, req, tokens, computed, need):
        """Places a hybrid grow from each group's credit as kvd would apply it and holds it back;
        False (nothing changed) when kvd must apply it."""
        n, c = req.num_tokens + tokens, computed
        if req.reported_computed < 0 or not 0 < c <= n or c < req.reported_computed:
            return False
        plan = _plan_group_grow(pool, req, n, c)
        if plan is None:
            return False
        for k, (_, _, add) in enumerate(plan):
            if add:
                need[(pool.id, k)] = need.get((pool.id, k), 0) + add
        if any(add > len(self.credit.get((pool.id, k), ())) for k, (_, _, add) in enumerate(plan)):
            return False
        spine = next((k for k, g in enumerate(pool.groups) if g.kind == "full"), -1)  # `blocks`' group
        blocks, groups = [], []
        for k, (lo, drop, add) in enumerate(plan):
            t = req.group_tables[k]
            credit = self.credit.get((pool.id, k), [])
            new = [credit.pop() for _ in range(add)]
            t.blocks = t.blocks[drop:] + new
            t.first_block_position = lo
            blocks += new
            groups += [k] * add
            if k == spine:
                req.blocks += new
        self.held.append([req, tokens, blocks, groups, c])
        req.num_tokens, req.reported_computed = n, c
        return True

    def step(self, batch):
        f = self.submit(batch, overlap=False)
        if f._error is not None:
            raise f._error
        return f._results

    def submit(self, batch, overlap=True, force=False):
        """Places what needs no round trip and sends the rest; a StepFuture. `overlap`: the RPC is
        started and left in flight (grpc's future API); otherwise it is made here. `force`: send
        held items even when nothing else must go."""
        results, pending = self._prepare(batch, force)  # settles the step in flight if this one goes out
        f = StepFuture(self, results, pending)
        if pending is None:
            return f
        if overlap:
            c = pending["client"]
            f._call = self._lane_send(c, pending["epoch"], pending["step"])
            if f._call is not None:
                self.inflight = f
                return f
            try:
                f._call = c._stub.Step.future(pending["step"], timeout=30)
                c.rpc_calls += 1
                self.inflight = f
            except ValueError as e:  # a stub whose channel a re-attach closed under the call
                if "closed channel" not in str(e):
                    raise
                self._settle(f)  # sent (again) the ordinary way, which says what happened
        else:
            self._settle(f)
        return f

    def _prepare(self, batch, force):
        c = self._client
        epoch = c.epoch
        if epoch != self.epoch:  # a new attachment: credit and held items went with the old one
            for _, req, _, out, _ in self.ops:
                out.code, out.message, out.deferred = (grpc.StatusCode.ABORTED,
                                                       f"request {req.id!r} was lost with a kvd restart", False)
            self.epoch, self.seq, self.credit, self.held, self.peak, self.ops = epoch, 0, {}, [], {}, []
            self.wanted, self._held_at = {}, {}
        results = [StepResult() for _ in batch.items]
        send = [False] * len(batch.items)
        must, publishes = False, False
        used, need = set(), {}
        sent_reqs = set()  # requests with an item kvd applies in this step (their grows go with it)
        now = time.monotonic()
        for name in batch.credit_pools:
            used.update(self._keys(c.pool(name)))
            must = True
        for i, (kind, req, arg) in enumerate(batch.items):
            if kind == "start":
                used.update(self._keys(c.pool(arg.admit.namespace.pool)))
                send[i] = must = True
                continue
            withdraw = req.waiting and kind in ("end", "preempt")
            if req.epoch != epoch or (not req.live and not withdraw):
                code = grpc.StatusCode.ABORTED if req.live else grpc.StatusCode.FAILED_PRECONDITION
                results[i] = StepResult(code, f"request {req.id!r} was lost with a kvd restart" if req.live
                                        else f"request {req.id!r} is not live in this client")
                continue
            if req.error is not None and kind not in ("end", "preempt"):
                results[i] = StepResult(req.error.code, req.error.details)
                continue
            if withdraw:
                send[i] = must = True
                sent_reqs.add(req)
                continue
            pool = c.pool(req.pool_id)
            used.update(self._keys(pool))
            hold = batch.hold_s.get(i, 0.0)
            if hold > 0 and kind in ("publish", "end") and not pool.groups and not arg.state_checkpoints:
                # Held back: the blocks stay the request's until the step that carries it (a
                # crash before then releases them as a live request's, unpublished).
                out = results[i] = StepResult(deferred=True)
                self.ops.append([kind, req, arg, out, now + hold])
                if kind == "end":
                    req.live = False
                continue
            if kind != "grow":
                send[i] = must = True
                sent_reqs.add(req)
                publishes |= kind != "end" or arg.publish_blocks != 0 or len(arg.state_checkpoints) > 0
                continue
            if arg < 0 or arg > pool.max_model_len - req.num_tokens:
                send[i] = must = True  # kvd names what is wrong
                sent_reqs.add(req)
                continue
            if pool.groups:
                computed = batch.computed_tokens.get(i, 0)
                if req in sent_reqs or not self._place_group_grow(pool, req, arg, computed, need):
                    send[i] = must = True
                    sent_reqs.add(req)
                continue
            key = (req.pool_id, 0)
            needed = max(0, _blocks_for(req.num_tokens + arg, pool.block_tokens) - len(req.blocks))
            need[key] = need.get(key, 0) + needed
            credit = self.credit.setdefault(key, [])
            if needed > len(credit):
                send[i] = must = True
                sent_reqs.add(req)
                continue
            h = self._held_at.get(req)
            if h is None:
                h = self._held_at[req] = [req, 0, [], None, 0]
                self.held.append(h)
            h[1] += arg
            for _ in range(needed):
                b = credit.pop()
                h[2].append(b)
                req.blocks.append(b)
            req.num_tokens += arg
        for p, n in need.items():
            self.peak[p] = max(self.peak.get(p, 0), n)
        if not batch.ask_credit:
            used = set()
        low = bool(self.wanted) or any(len(self.credit.get(p, [])) < self._want(p) // 2 for p in used)
        due = any(op[4] <= now for op in self.ops)
        # Low credit alone does not wait for a step in flight: that step asked for credit already.
        if not must and not due and not (force and (self.ops or self.held)) and (not low or self.inflight is not None):
            return results, None
        if self.inflight is not None:
            # This one goes out: the one in flight is answered first (the sequence number and the
            # credit follow from it; what was placed meanwhile stays placed, see _apply).
            self._settle(self.inflight)
            if c.epoch != epoch:
                raise KvdRestarted(f"step {self.seq}")

        step = kvd_pb2.StepRequest(worker_id=c.worker_id)
        self.seq += 1
        step.seq = self.seq
        held, self.held, self._held_at = self.held, [], {}
        for req, tokens, blocks, groups, computed in held:
            if groups is None:
                grow = kvd_pb2.StepGrow(tokens=tokens, credit_blocks=blocks)
            else:  # a hybrid pool's {group, block} entries, in the order placed
                grow = kvd_pb2.StepGrow(tokens=tokens, computed_tokens=computed, credit=[
                    kvd_pb2.CreditEntry(group=g, block=b) for g, b in zip(groups, blocks)])
            step.items.add(request_id=req.id, grow=grow)
        ops, self.ops = self.ops, []
        for kind, req, arg, _, _ in ops:  # after the growth held before them, before this batch
            getattr(step.items.add(request_id=req.id), kind).CopyFrom(arg)
            publishes |= kind == "publish" or arg.publish_blocks != 0
        sent = []
        for i, (kind, req, arg) in enumerate(batch.items):
            if not send[i]:
                continue
            item = step.items.add(request_id=req.id)
            if kind == "start":
                item.start.CopyFrom(arg)
                item.start.admit.worker_id = c.worker_id
                item.start.admit.request_id = req.id
            elif kind == "grow":
                item.grow.tokens = arg
                item.grow.computed_tokens = batch.computed_tokens.get(i, 0)
            else:
                getattr(item, kind).CopyFrom(arg)
            sent.append(i)
        if publishes:
            c._await_writes()
        for p in sorted(set(used) | set(self.wanted)):
            owed = self.wanted.get(p, 0)
            if self.credit_blocks <= 0 and owed == 0:
                continue
            mine = self.credit.setdefault(p, [])
            back = [mine.pop() for _ in range(min(owed, len(mine)))]  # off the list before it is sent
            step.credit.add(pool=c.pool(p[0]).name, group=p[1], blocks=self._want(p), returned=back)
        self.wanted = {}
        return results, {"client": c, "epoch": epoch, "step": step, "held": held, "ops": ops, "sent": sent,
                         "batch": batch}

    def _settle(self, f):
        """Waits for f's answer (sending again while kvd is unreachable) and applies it, once."""
        if f._settled:
            return
        f._settled = True
        if self.inflight is f:
            self.inflight = None
        try:
            self._apply(f._results, f._pending, self._exchange(f._pending, f._call))
        except KvdError as e:
            f._error = e

    def _lane_send(self, c, epoch, step):
        """Sends `step` on this attachment's lane (opened the first time); the call, or None when
        it goes by gRPC (no lane, kvd refused one, the step is larger than a lane takes, or the
        lane broke while sending: kvd dropped the partial frame)."""
        if not c.step_lane or (self.lane_refused is not None and self.lane_refused[0] == epoch
                               and time.monotonic() < self.lane_refused[1] + LANE_RETRY_S):
            return None
        if self.lane is not None and (self.lane.broken or self.lane.epoch != epoch or self.lane.worker_id != step.worker_id):
            self.lane.close()
            self.lane = None
        data = step.SerializeToString()
        if len(data) > LANE_MAX_FRAME:
            return None
        if self.lane is None:
            try:
                self.lane = StepLane(c.side_socket, step.worker_id, epoch)
            except (OSError, KvdError) as e:  # tried again after LANE_RETRY_S (kvd busy, starting)
                self.lane_refused = (epoch, time.monotonic(), str(e))
                return None
        try:
            call = self.lane.send(data)
        except OSError:
            self.lane.close()
            return None
        c.rpc_calls += 1
        return call

    def close_lane(self):
        if self.lane is not None:
            self.lane.close()
            self.lane = None

    def _exchange(self, pending, call):
        c, epoch, step, held, ops = (pending[k] for k in ("client", "epoch", "step", "held", "ops"))
        resp = None
        if call is None:
            call = self._lane_send(c, epoch, step)
        for attempt in range(3):
            try:
                if call is not None and attempt == 0:
                    t = time.perf_counter()  # the part of the round trip not overlapped
                    try:
                        resp = call.result()
                    except grpc.RpcError as e:  # pylint: disable=no-member
                        raise KvdError(e.code(), e.details()) from None
                    finally:
                        c.rpc_seconds += time.perf_counter() - t
                else:
                    resp = c._rpc("Step", step)
                break
            except KvdError as e:
                if e.code != grpc.StatusCode.UNAVAILABLE or c.epoch != epoch or attempt == 2:
                    for h in held:  # unknown whether kvd applied it: those requests are unusable
                        h[0].error = e
                    for _, req, _, out, _ in ops:  # and whether these were
                        out.code, out.message, out.deferred = e.code, e.details, False
                    self.credit, self.wanted = {}, {}  # and the credit is re-synced from the next answer
                    if c._lost(e, epoch):
                        raise KvdRestarted(f"step {step.seq}") from None
                    raise
                time.sleep(0.05 * (1 << attempt))
        return resp

    def _apply(self, results, pending, resp):
        epoch, held, ops, sent, batch = (pending[k] for k in ("epoch", "held", "ops", "sent", "batch"))
        for k, h in enumerate(held):
            r = resp.results[k]
            if r.code != 0:
                h[0].error = KvdError(status_code(r.code), r.message)
        for k, (_, req, _, out, _) in enumerate(ops):  # the held items' outcomes, in place
            r = resp.results[len(held) + k]
            out.code, out.message, out.deferred = status_code(r.code), r.message, False
            out.kept, out.already_cached, out.duplicates, out.no_parent = r.kept, r.already_cached, r.duplicates, r.no_parent
        base = len(held) + len(ops)
        for k, i in enumerate(sent):
            r = resp.results[base + k]
            kind, req, arg = batch.items[i]
            out = StepResult(status_code(r.code), r.message, r.waiting, r.kept, r.already_cached, r.duplicates, r.no_parent,
                             r.checkpoint_outcomes, r.fresh_slots,
                             InFlight.from_proto(r) or (InFlight.from_proto(r.acquired) if kind == "start" else None))
            results[i] = out
            if kind in ("publish", "end", "checkpoint") and out.ok and arg.state_checkpoints:
                entries = [(c.group, c.position_tokens, c.slot) for c in arg.state_checkpoints]
                # A generation checkpoint keeps every slot it names (no outcomes on the wire).
                outcomes = out.checkpoint_outcomes if kind != "checkpoint" else [kvd_pb2.CHECKPOINT_KEPT] * len(entries)
                _swap_kept_slots(req.group_tables, entries, outcomes, out.fresh_slots)
            if kind == "start":
                req.waiting, req.epoch = r.waiting, epoch
                req.in_flight, req.in_flight_wait = out.in_flight, IN_FLIGHT_WAITS.get(r.in_flight_wait, "not_waited")
                if out.ok and not r.waiting:
                    a = r.acquired
                    req.pool_id, req.blocks, req.num_tokens = a.pool_id, list(a.blocks), a.num_tokens
                    req.group_tables = [GroupTable.from_proto(t) for t in a.group_tables]
                    req.cached_tokens, req.resumed = a.cached_tokens, a.resumed
                    req.resumed_tokens, req.engine_state = list(a.resumed_tokens), a.engine_state
                    req.live, req.error, req.reported_computed = True, None, -1
            elif kind == "grow" and out.ok:
                try:
                    _apply_group_grow(req.group_tables, r)
                except KvdError as e:  # the tables no longer match kvd's: End it
                    req.error = e
                    results[i] = StepResult(e.code, e.details)
                    continue
                req.blocks += list(r.blocks)
                req.num_tokens += arg
                if req.group_tables:  # what kvd now holds as the request's computed tokens
                    computed = batch.computed_tokens.get(i, 0)
                    req.reported_computed = computed if computed > 0 else max(req.reported_computed, req.cached_tokens)
            elif kind in ("end", "preempt") and out.ok:
                req.live = req.waiting = False
        # kvd's list of the credit held, less what was placed on credit since this step was built
        # (growth held in self.held: kvd learns of it with the next step that goes out).
        placed = {}
        for req, _, blocks, groups, _ in self.held:
            for j, b in enumerate(blocks):
                placed.setdefault((req.pool_id, 0 if groups is None else groups[j]), set()).add(b)
        self.credit = {}
        for cr in resp.credit:
            gone = placed.get((cr.pool_id, cr.group), ())
            self.credit[(cr.pool_id, cr.group)] = [b for b in cr.blocks if b not in gone] if gone else list(cr.blocks)
            if cr.wanted > 0:
                self.wanted[(cr.pool_id, cr.group)] = cr.wanted


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def status_code(value):
    """The grpc.StatusCode of a status's integer value (UNKNOWN for one grpc does not name)."""
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)
