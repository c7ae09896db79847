"""BatchEngine: continuous batching on kvd's memory through the step protocol (kvd.step).

One scheduler step: finished requests end (publishing their full blocks), running requests are
scheduled within a per-step token budget (a prefill chunk, or one decode position), waiting
requests are started while there is room in the batch; the whole step goes to kvd in one
Client.step (none, when every item is decode growth the block credit covers); then the model runs
every scheduled position. A request whose pool cannot grow is preempted: checkpointed (the
positions with KV, the next token in engine_state) and released, and put back at the head of the
waiting queue, which starts it again with resume_from. A start kvd answers `waiting` stays at
the head of the queue and keeps its place in kvd's admission FIFO. With `wait_in_flight_s`, a
start whose prompt's next blocks another request of the namespace is computing (this engine's or
another's) is deferred: kvd parks it, answering `waiting` with the blocks in flight, until they
are published (then it starts with them as a hit) or the computing request ends or the bound
passes; meanwhile the engine runs its other work and sends the start again each step
(docs/integration.md, "Prefixes in flight").

The step's round trip (docs/performance.md, "The continuous-batching engine on a trace"): ends
and publishes go with `hold_s` (kvd.step), so they ride the next step that must go out anyway (a
start, growth past the block credit) instead of making one of their own, and go out within
hold_s, when the engine idles, or at the end of run(). With `overlap` (and a client that has
step_submit), the step is sent and the model runs, while kvd answers, every scheduled position
whose blocks the request already holds: prefill chunks of admitted prompts and decode positions
the credit placed; what waits for the answer is growth past the credit (computed after it) and
the starts. New arrivals' prefill was already one step after their start (the plan is made
before the step), so they lose nothing to the overlap; the tokens are those of the synchronous
path, bit for bit (tests/python/test_step_pipeline.py).

The model is pluggable: `forward(kv_io, tokens, start, end)` computes positions [start, end)
(writing their KV through kv_io) and returns one bytes "logit row" per position. PatternModel
needs no weights and no torch: the KV of position p is the kv_pattern.h bytes of (token, p), and
its logit row is a running SHA-256 over every KV byte of positions [0, p] as read back from
kvd's memory, so a reused byte that differs changes every later token. Each position's result
depends only on earlier positions' KV, never on what else is in the batch: a reused prefix gives
the same tokens and digests bit for bit as a cold run.
"""
import collections
import hashlib
import struct
import time

import grpc

from kvd.step import StepBatch, StepRequest

M = (1 << 64) - 1


def _kv_slot(token, pos, layer, n):
    """The n kv_pattern.h bytes of (token, pos, layer): byte j is byte j % 8 (little-endian) of the
    mix of word j // 8, so one mix gives eight bytes."""
    out = bytearray()
    for k in range((n + 7) // 8):
        x = ((token << 32) ^ (pos << 12) ^ layer ^ (k << 48)) & M
        x = (x + 0x9E3779B97F4A7C15) & M
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M
        out += (x ^ (x >> 31)).to_bytes(8, "little")
    return bytes(out[:n])


class KvIo:
    """A request's KV slots in the pool's memory (shard 0, host backend): position p, layer l is
    slot p % block_tokens of block table[p // block_tokens]. Writes are for attachment `epoch`
    (the one the request started in): refused once the client has re-attached since."""

    def __init__(self, client, pool, table, epoch=None):
        self.client = client
        self.epoch = epoch
        self.pool = client.pool(pool)
        self.mem = memoryview(self.pool.maps[0])
        self.table = table

    def _at(self, pos, layer):
        bt = self.pool.block_tokens
        return self.pool.offset(self.table[pos // bt], layer) + (pos % bt) * self.pool.bytes_per_token_per_layer

    def write(self, pos, layer, data):
        if not self.client.may_write(self.epoch):  # lost, or a request of an earlier attachment
            raise RuntimeError("the lease is lost: writing stopped")
        at = self._at(pos, layer)
        self.mem[at:at + len(data)] = data

    def read(self, pos, layer):
        at = self._at(pos, layer)
        return bytes(self.mem[at:at + self.pool.bytes_per_token_per_layer])


class PatternModel:
    vocab = 50000

    def __init__(self):
        self._chain = {}  # id(kv_io) -> (positions hashed, running digest)

    def forward(self, kv, tokens, start, end):
        pool = kv.pool
        for pos in range(start, end):
            for layer in range(pool.num_layers):
                kv.write(pos, layer, _kv_slot(tokens[pos], pos, layer, pool.bytes_per_token_per_layer))
        done, h = self._chain.get(id(kv), (0, hashlib.sha256()))
        rows = []
        for pos in range(done, end):
            for layer in range(pool.num_layers):
                h.update(kv.read(pos, layer))  # reused positions too: what kvd served is checked
            if pos >= start:
                rows.append(h.copy().digest())
        self._chain[id(kv)] = (end, h)
        return rows

    def forget(self, kv):
        self._chain.pop(id(kv), None)

    def sample(self, row):
        return struct.unpack("<I", row[:4])[0] % self.vocab


class _Gen:
    def __init__(self, rid, prompt, max_new, salt):
        self.rid, self.prompt, self.max_new, self.salt = rid, list(prompt), max_new, salt
        self.req = StepRequest(rid)
        self.tokens = list(prompt)   # the prompt, then each sampled token once it has a position
        self.computed = 0            # positions whose KV is written
        self.generated = []          # sampled tokens (the last has no KV yet)
        self.digest = hashlib.sha256()
        self.cached_tokens = None
        self.resume = False
        self.publish = False         # the prompt's blocks go out with the next step
        self.preemptions = 0
        self.kv = None
        self.t_submit = time.perf_counter()
        self.t_sent = None           # when its first start went out (from t_submit)
        self.sent_step = None        # the engine step it went out in, and whether the engine was idle
        self.sent_idle = None
        self.start_steps = None      # engine steps from its first start going out to its answer taken
        self.t_started = None        # when kvd's answer to its first start was taken (from t_submit)
        self.ttft = None
        self.t_last = None           # when the last token was sampled (from t_submit)


class BatchEngine:
    """`preempt_after`: when the head of the waiting queue has waited this many steps (kvd answered
    `waiting` for admission), the youngest running request is preempted to make room (0: never).
    `wait_in_flight_s`: how long a start may be deferred while its prefix is in flight (0: never).
    `hold_s`: how long an end or publish may be held back for a step that goes out anyway (0: sent
    with its own step). `overlap`: run the model while the step's round trip is in flight.
    `carry`: a step whose starts kvd has not answered by the time the model ran stays in flight
    while later steps decode the running requests on credit (no new start meanwhile)."""

    def __init__(self, client, pool="default", model=None, token_budget=256, max_running=32, chunk=64,
                 max_wait_s=30.0, preempt_after=0, wait_in_flight_s=0.0, hold_s=0.05, overlap=True, carry=True):
        self.client, self.pool = client, pool
        self.model = model or PatternModel()
        self.token_budget, self.max_running, self.chunk = token_budget, max_running, chunk
        self.max_wait_s, self.preempt_after = max_wait_s, preempt_after
        self.block_tokens = client.pool(pool).block_tokens
        self.waiting = collections.deque()
        self.running = []
        self.finished = []   # generations whose End goes out with the next step
        self.results = {}
        self.steps = 0
        self.head_waited = 0
        self.prefill_tokens = 0  # positions computed for prompts (reuse lowers it)
        self.wait_in_flight_s = wait_in_flight_s
        self.deferred_in_flight = 0  # start answers deferred for a prefix in flight
        self.hold_s = hold_s
        self.overlap = overlap and hasattr(client, "step_submit")
        # Carry a step's starts across engine steps (its round trip in flight while the running
        # requests decode on credit): needs a client that places steps while one is in flight.
        self.carry = self.overlap and carry and getattr(client, "steps_while_in_flight", False)
        self.carried = None  # (future, batch, ending, starting) of the step whose starts are unanswered
        self.carried_steps = 0  # engine steps that ran while a step's starts were unanswered
        self.held = []  # (kind, rid, StepResult) of publishes and ends held back, not yet answered
        warm_up = getattr(client, "step_warm_up", None)
        if warm_up is not None:  # the lane and the credit now, not in the first requests' TTFT
            warm_up([pool])

    def submit(self, rid, prompt, max_new=8, salt=""):
        self.waiting.append(_Gen(rid, prompt, max_new, salt))

    def run(self, arrivals=None):
        """Steps until every submitted request is done. `arrivals`: (seconds from now, id, prompt,
        max_new, salt) in time order, submitted when their time comes (idle until then)."""
        pending = collections.deque(arrivals or ())
        t0 = time.perf_counter()
        while pending or self.waiting or self.running or self.finished or self.carried:
            now = time.perf_counter() - t0
            while pending and pending[0][0] <= now:
                _, rid, prompt, max_new, salt = pending.popleft()
                self.submit(rid, prompt, max_new, salt)
            if not (self.waiting or self.running or self.finished or self.carried):
                self.flush()  # idle: what is held back goes out now (a round trip on kvd)
                time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - t0)))
                continue
            self.step()
        self.flush()
        return self.results

    def flush(self):
        """Sends the publishes and ends held back; RuntimeError naming one kvd refused."""
        if self.held and hasattr(self.client, "step_flush"):
            self.client.step_flush()
        self._check_held()

    def _check_held(self):
        left = []
        for kind, rid, r in self.held:
            if r.deferred:
                left.append((kind, rid, r))
            elif not r.ok:
                raise RuntimeError(f"{rid}: held {kind} failed: {r.code} {r.message}")
        self.held = left

    def step(self):
        self.steps += 1
        self.carried_steps += self.carried is not None
        self._take_carried(wait=not self.running)  # answered, or nothing else to run: take it now
        bt = self.block_tokens
        batch = StepBatch()
        ending, self.finished = self.finished, []
        for g in ending:  # every full block with KV, then the end
            batch.publish(g.req, g.tokens[:g.computed], g.computed // bt, hold_s=self.hold_s)
            batch.end(g.req, completed=True, hold_s=self.hold_s)
        for g in self.running:
            if g.publish:
                batch.publish(g.req, g.prompt, len(g.prompt) // bt, hold_s=self.hold_s)
                g.publish = False
        # Running requests within the token budget: a prefill chunk, or the next decode position.
        budget, plan = self.token_budget, []
        for g in self.running:
            if budget <= 0:
                break
            if g.computed < len(g.prompt):
                n = min(self.chunk, len(g.prompt) - g.computed, budget)
            else:  # decode: the last sampled token takes a position
                n = 1
                g.tokens.append(g.generated[-1])
                batch.grow(g.req, 1)
            plan.append((g, g.computed, g.computed + n, n == 1 and g.computed >= len(g.prompt)))
            budget -= n
        starting = []
        # New starts wait while carried ones are unanswered (one step with starts in flight).
        starts_open = self.carried is None
        while starts_open and self.waiting and len(self.running) + len(starting) < self.max_running:
            g = self.waiting.popleft()
            batch.start(g.req, pool=self.pool, prompt=g.prompt, max_new_tokens=g.max_new, cache_salt=g.salt,
                        resume_from=g.rid if g.resume else "", max_wait_s=self.max_wait_s,
                        wait_in_flight_s=0.0 if g.resume else self.wait_in_flight_s)
            starting.append(g)
            if g.t_sent is None:
                g.t_sent, g.sent_step, g.sent_idle = time.perf_counter() - g.t_submit, self.steps, not plan
        if self.overlap and plan:
            # In flight: meanwhile, every position whose blocks the request holds already. (With
            # nothing planned, the plain call waits for the answer with less thread hand-off.)
            future = self.client.step_submit(batch)
            self._take_carried()  # when this step went out, the carried one was answered first
            plan = [p for p in plan if not self._forward(p, None)]
            if self.carry and starting and not plan and not future.done():
                # Everything planned ran: the starts' answer can wait for a later step.
                self.carried = (future, batch, ending, starting)
            else:
                self._absorb(None, batch, ending, starting, future.result(), plan, counts=starts_open)
        else:
            self._absorb(None, batch, ending, starting, self.client.step(batch), plan, counts=starts_open)
        # After every position planned ran (a preemption replaces the request's StepRequest).
        if self.preempt_after and self.head_waited >= self.preempt_after and self.running:
            self._preempt(self.running[-1])
            self.head_waited = 0

    def _take_carried(self, wait=False):
        """Absorbs the carried step once it is answered (at once with `wait`)."""
        if self.carried is not None and (wait or self.carried[0].done()):
            carried, self.carried = self.carried, None
            self._absorb(*carried)

    def _absorb(self, future, batch, ending, starting, results=None, plan=(), counts=True):
        """Takes a step's answer: held items, ends, starts, then the planned positions left.
        `counts`: the step could start requests (it does not count toward preempt_after else)."""
        if results is None:
            results = future.result()
        for k, (kind, req, _) in enumerate(batch.items):
            if kind in ("publish", "end") and results[k].deferred:
                self.held.append((kind, req.id, results[k]))
            elif kind in ("publish", "end") and not results[k].ok:
                raise RuntimeError(f"{kind} failed: {results[k].code} {results[k].message}")
        self._check_held()
        for g in ending:
            self._finish(g)
        by_item = {id(item[1]): r for item, r in zip(batch.items, results) if item[0] == "grow"}
        starts = results[len(results) - len(starting):]
        head = []  # kvd keeps their place in the pool's FIFO (or their wait); so does the queue here
        admission_waits = False
        for g, r in zip(starting, starts):
            if r.waiting:
                head.append(g)
                if r.in_flight is not None:
                    self.deferred_in_flight += 1
                else:
                    admission_waits = True
            elif not r.ok:
                raise RuntimeError(f"{g.rid}: start failed: {r.code} {r.message}")
            else:
                self._started(g)
        self.waiting.extendleft(reversed(head))
        # Only a wait for room makes preemption worth it (a prefix in flight comes by itself).
        if counts:
            self.head_waited = self.head_waited + 1 if admission_waits else 0
        # The model: every scheduled position (left), each from the KV before it.
        for p in plan:
            self._forward(p, by_item)

    def _forward(self, p, by_item):
        """Runs planned positions [start, end) of g. by_item None (the step in flight): only when
        the request holds their blocks already; False when it does not (nothing done)."""
        g, start, end, grew = p
        if grew:
            if by_item is None:
                if g.req.num_tokens < end or g.req.error is not None:
                    return False  # growth past the credit: its blocks come with the answer
            else:
                r = by_item[id(g.req)]
                if not r.ok:
                    g.tokens.pop()
                    if r.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        # The pool cannot grow it now (its reservation also pays for its own
                        # copies of blocks another request published first): preempted, it
                        # resumes from its checkpoint with a reservation of its own again. When
                        # the refused grow was one placed on credit (req.error), kvd never took
                        # the positions computed since: no checkpoint, it starts over.
                        self._preempt(g, checkpoint=g.req.error is None)
                        return True
                    raise RuntimeError(f"{g.rid}: grow failed: {r.code} {r.message}")
        g.kv.table = g.req.blocks
        rows = self.model.forward(g.kv, g.tokens, start, end)
        if not grew:
            self.prefill_tokens += end - start
        g.computed = end
        if end == len(g.tokens):  # the prompt is complete, or a decode position: sample
            if not g.generated:
                g.publish = True
                g.ttft = time.perf_counter() - g.t_submit
            g.digest.update(rows[-1])
            g.generated.append(self.model.sample(rows[-1]))
            if len(g.generated) >= g.max_new:
                g.t_last = time.perf_counter() - g.t_submit
                self.running.remove(g)
                self.finished.append(g)
        return True

    def _started(self, g):
        req = g.req
        if g.cached_tokens is None:
            g.cached_tokens = req.cached_tokens
            g.t_started = time.perf_counter() - g.t_submit
            g.start_steps = self.steps - g.sent_step
        g.kv = KvIo(self.client, self.pool, req.blocks, req.epoch)
        g.computed = req.cached_tokens
        if g.resume and not req.resumed:
            # kvd no longer holds its checkpoint (evicted under pressure): it starts over from
            # whatever prefix is cached, and samples again what it had sampled.
            g.tokens, g.generated, g.digest = list(g.prompt), [], hashlib.sha256()
        if req.resumed:
            # Positions with KV, then the token sampled next (engine_state).
            g.tokens = list(req.resumed_tokens)
            g.generated = g.tokens[len(g.prompt):] + [struct.unpack("<I", req.engine_state)[0]]
            if g.computed < len(g.tokens):
                # kvd handed back a fresh tail block: recompute it (its rows were sampled already).
                self.model.forward(g.kv, g.tokens, g.computed, len(g.tokens))
                g.computed = len(g.tokens)
        self.running.append(g)

    def _preempt(self, g, checkpoint=True):
        """Checkpoint what has KV (the next sampled token as state), release, queue for resume."""
        self.running.remove(g)
        batch = StepBatch()
        if checkpoint and g.generated and g.computed == len(g.tokens):
            batch.preempt(g.req, g.tokens[:g.computed], struct.pack("<I", g.generated[-1]))
            g.resume = True
        else:  # nothing sampled yet: start over
            batch.preempt(g.req)
            g.tokens, g.generated, g.digest = list(g.prompt), [], hashlib.sha256()
            g.resume = False
        r = self.client.step(batch)[0]
        if not r.ok:
            raise RuntimeError(f"{g.rid}: preempt failed: {r.code} {r.message}")
        self.model.forget(g.kv)
        g.req, g.publish = StepRequest(g.rid), False
        g.preemptions += 1
        self.waiting.append(g)

    def _finish(self, g):
        self.model.forget(g.kv)
        self.results[g.rid] = {"id": g.rid, "tokens": g.generated, "digest": g.digest.hexdigest(),
                               "cached_tokens": g.cached_tokens, "preemptions": g.preemptions, "ttft_s": g.ttft,
                               "started_s": g.t_started, "sent_s": g.t_sent, "sent_idle": g.sent_idle,
                               "start_steps": g.start_steps, "done_s": time.perf_counter() - g.t_submit,
                               "last_token_s": g.t_last, "prompt_tokens": len(g.prompt)}
