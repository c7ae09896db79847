"""HybridBatchEngine: continuous batching of TinyHybrid (hybrid_model.py) with every KV group in
kvd's memory, through the step protocol (kvd.step; docs/hybrid.md §2.4-2.7, §5):

  full group      the full-attention layers' K/V in the group's blocks (the request's full table)
  sliding_window  the window layer's K/V in the group's table; blocks before first_block_position
                  are gone (kvd released them, or a hit never had them): the model reads only
                  the window, and reading outside it raises BlockNotHeld
  state           the recurrent state in the request's running slot (state table [running,
                  spare]); on a hit the checkpoint (GroupTable.checkpoint_slot, the state at
                  exactly cached_tokens) is copied into the running slot before anything runs

One scheduler step, for every running request within the token budget: a publish of the full
blocks computed so far with the state checkpoint the last compute left in the spare slot (on the
pool's k-grid, checkpoint_every_blocks × block_tokens), then a grow reporting computed_tokens (kvd
releases the window blocks below computed - (W - 1) and hands out the next step's), then the
model computes a prefill chunk (ending on the k-grid, at most step_tokens) or one decode position.
Publish comes before the grow so a checkpoint's window is attached before it is released
(§2.7). A request that ends publishes every full block and, as End's tail, the state at its last
full block when that is off the grid. Waiting starts keep their place, as in BatchEngine.

Each request's result has its tokens and the float32 logit rows of every position it computed,
so a test compares them bit for bit (torch.equal) with a run on an engine with no cache.

Preemption: preempt(rid) checkpoints a request between decode positions with its running slot as
the state at its positions (§2.9), releases it and queues it; the resume copies the state kvd
answers (the state group's checkpoint_slot) into its new running slot and continues.

Negative controls (tests only): `window_fault_blocks` = +1 / -1 reads one window block more /
fewer than W (a block the request does not hold reads as zeros, as a null block would);
`skip_checkpoint_copy` leaves a hit's running slot zeroed instead of copying the checkpoint.
"""
import collections
import struct

import torch

from kvd.step import StepBatch, StepRequest

from .hybrid_model import FULL, SLIDING_WINDOW, STATE, PagedHybridKv


def expectation(cfg, pool, checkpoint_every_blocks):
    """The attach expectation (kvd_pb2.PoolExpectation fields) of a worker running TinyHybrid
    `cfg` on `pool`: its KV format and groups; kvd refuses the attach if the pool differs."""
    groups = []
    for g in cfg.pool_groups(checkpoint_every_blocks):
        e = {"name": g["name"], "kind": g["kind"], "layers": g["layers"]}
        for key in ("window", "checkpoint_every_blocks", "bytes_per_token", "bytes_per_state"):
            if key in g:
                e[key] = g[key]
        groups.append(e)
    return {"pool": pool, "dtype": "float32", "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "kv_arrangement": "token_kv_head_dim", "groups": groups}


class _FaultyWindowKv(PagedHybridKv):
    """Reads `shift` blocks more (> 0) or fewer (< 0) of a window group than the model asks for;
    positions in blocks the request does not hold read as zeros."""

    def __init__(self, shift, window_groups, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shift, self.window_groups = shift, window_groups

    def read(self, group, j, lo, hi):
        if group not in self.window_groups:
            return super().read(group, j, lo, hi)
        bt = self.block_tokens
        lo = max(0, lo - self.shift * bt) if self.shift > 0 else min(hi - 1, lo - self.shift * bt)
        pages, table = self.pages[group], self.tables[group]
        rows = torch.zeros(hi - lo, *pages.shape[3:], dtype=pages.dtype, device=pages.device)
        for pos in range(lo, hi):
            i = pos // bt
            if i < len(table) and table[i] is not None:
                rows[pos - lo] = pages[j, table[i], pos % bt]
        return rows[:, 0], rows[:, 1]


class _Gen:
    def __init__(self, rid, prompt, max_new, salt):
        self.rid, self.prompt, self.max_new, self.salt = rid, list(prompt), max_new, salt
        self.req = StepRequest(rid)
        self.tokens = list(prompt)   # the prompt, then each sampled token once it has a position
        self.computed = 0            # positions whose KV (and state) is written
        self.generated = []
        self.rows = []               # logit rows of the positions computed, in order
        self.first_computed = None   # the first position this request computed (its hit)
        self.cached_tokens = None
        self.known = len(prompt)     # tokens kvd knows for the request (prompt, then published)
        self.published = 0           # full blocks published
        self.grid = None             # (length, slot): a k-grid checkpoint in the spare, to publish
        self.tail = None             # (length, slot): the state at the last block boundary, for End
        self.outcomes = []           # (length, CheckpointOutcome) of every checkpoint offered
        self.window_at_start = None  # the window table's first_block_position at the start
        self.max_first_window = 0    # the window table's largest first_block_position seen
        self.resume = False
        self.preemptions = 0
        self.resumed_at = None       # the positions a resume continued from


class HybridBatchEngine:
    def __init__(self, client, pool, model, token_budget=24, max_running=8, max_wait_s=30.0, peer="",
                 window_fault_blocks=0, skip_checkpoint_copy=False):
        """`peer`: a peer kvd (a name in kvd's transfer.peers) each start pulls the prompt's
        cached prefix from first (docs/transfer.md)."""
        self.client, self.pool, self.model, self.peer = client, pool, model, peer
        p = client.pool(pool)
        self.block_tokens = p.block_tokens
        self.step_tokens = p.step_tokens or p.max_model_len
        self.group_index = {g.name: i for i, g in enumerate(p.groups)}
        self.first = {g.name: g.first_block for g in p.groups}
        self.kinds = {g.name: g.kind for g in p.groups}
        want = {name: kind for name, kind, _ in model.cfg.groups}
        if want != self.kinds:
            raise ValueError(f"pool {pool} has groups {self.kinds}; the model needs {want}")
        self.pages = {n: client.kv_tensor(pool, group=n, dtype=torch.float32, inner_shape=model.cfg.kv_inner_shape)
                      for n, k in self.kinds.items() if k != STATE}
        self.slots = {n: client.kv_tensor(pool, group=n, dtype=torch.float32)
                      for n, k in self.kinds.items() if k == STATE}
        self.window_groups = [n for n, k in self.kinds.items() if k == SLIDING_WINDOW]
        (state,) = [g for g in p.groups if g.kind == STATE]
        self.state = state.name
        self.grid_tokens = state.checkpoint_every_blocks * p.block_tokens
        self.at_end = state.checkpoint_at_end
        self.token_budget, self.max_running, self.max_wait_s = token_budget, max_running, max_wait_s
        self.window_fault_blocks, self.skip_checkpoint_copy = window_fault_blocks, skip_checkpoint_copy
        self.waiting = collections.deque()
        self.running = []
        self.finished = []
        self.results = {}
        self.steps = 0
        self.prefill_tokens = 0

    def submit(self, rid, prompt, max_new=4, salt=""):
        self.waiting.append(_Gen(rid, prompt, max_new, salt))

    def run(self, until=None):
        """Steps until every submitted request is done (or `until(engine)` is true)."""
        while self.waiting or self.running or self.finished:
            if until is not None and until(self):
                return self.results
            self.step()
        return self.results

    # --- one step --------------------------------------------------------------------------

    def step(self):
        self.steps += 1
        bt = self.block_tokens
        batch = StepBatch()
        ending, self.finished = self.finished, []
        for g in ending:
            n = g.computed // bt
            cps = [c for c in (g.grid, g.tail) if c is not None and (c is g.grid or c[0] == n * bt)]
            batch.end(g.req, publish_blocks=n, more_tokens=g.tokens[g.known:g.computed], completed=True,
                      state_checkpoints=[(self.group_index[self.state], length, slot) for length, slot in cps])
        budget, plan = self.token_budget, []
        for g in self.running:
            if budget <= 0:
                break
            if g.computed // bt > g.published or g.grid is not None:
                cps = [(self.group_index[self.state], *g.grid)] if g.grid is not None else []
                batch.publish(g.req, g.tokens[:g.computed], g.computed // bt, state_checkpoints=cps)
            if g.computed < len(g.prompt):
                grid_end = (g.computed // self.grid_tokens + 1) * self.grid_tokens
                end = min(len(g.prompt), grid_end, g.computed + self.step_tokens, g.computed + budget)
                batch.grow(g.req, 0, computed_tokens=g.computed)
            else:
                g.tokens.append(g.generated[-1])
                end = g.computed + 1
                batch.grow(g.req, 1, computed_tokens=g.computed)
            plan.append((g, g.computed, end))
            budget -= end - g.computed
        starting = []
        while self.waiting and len(self.running) + len(starting) < self.max_running:
            g = self.waiting.popleft()
            batch.start(g.req, pool=self.pool, prompt=g.prompt, max_new_tokens=g.max_new, cache_salt=g.salt,
                        resume_from=g.rid if g.resume else "", max_wait_s=self.max_wait_s, peer=self.peer)
            starting.append(g)
        results = self.client.step(batch)
        self._apply(batch, results, ending)
        starts = results[len(results) - len(starting):]
        head = []
        for g, r in zip(starting, starts):
            if r.waiting:
                head.append(g)
            elif not r.ok:
                raise RuntimeError(f"{g.rid}: start failed: {r.code} {r.message}")
            else:
                self._started(g)
        self.waiting.extendleft(reversed(head))
        for g in ending:
            self.results[g.rid] = self._result(g)
        for g, start, end in plan:
            self._compute(g, start, end)

    def _apply(self, batch, results, ending):
        """Checks every item's answer and applies publishes' checkpoint outcomes."""
        by_req = {}
        for (kind, req, arg), r in zip(batch.items, results):
            if kind == "start":
                continue
            if not r.ok:
                raise RuntimeError(f"{req.id}: {kind} failed: {r.code} {r.message}")
            by_req.setdefault(req.id, []).append((kind, arg, r))
        for g in self.running + ending:
            for kind, arg, r in by_req.get(g.rid, ()):
                if kind in ("publish", "end"):
                    g.outcomes += [(c.position_tokens, o) for c, o in zip(arg.state_checkpoints, r.checkpoint_outcomes)]
                if kind == "publish":
                    g.published = max(g.published, arg.num_blocks)
                    g.known = max(g.known, len(arg.tokens))
                    g.grid = None  # kept (the table has a fresh spare) or the slot is the spare again
                if kind == "grow":
                    t = g.req.group_table(self.window_groups[0]) if self.window_groups else None
                    if t is not None:
                        g.max_first_window = max(g.max_first_window, t.first_block_position)

    def _started(self, g):
        req = g.req
        if g.cached_tokens is None:
            g.cached_tokens = req.cached_tokens
        g.computed = req.cached_tokens
        g.grid = g.tail = None
        g.published = g.computed // self.block_tokens
        if self.window_groups and g.window_at_start is None:
            g.window_at_start = req.group_table(self.window_groups[0]).first_block_position
        table = req.group_table(self.state)
        slots = self.slots[self.state]
        running = self._local(self.state, table.blocks[0])
        slots[:, running].zero_()  # the initial state; a slot keeps its last user's bytes
        # A hit's checkpoint, or a resume's state at its checkpoint: the state at cached_tokens.
        if table.checkpoint_slot is not None and not self.skip_checkpoint_copy:
            slots[:, running].copy_(slots[:, self._local(self.state, table.checkpoint_slot)])
        if req.resumed:
            # The positions with KV, then the token sampled next (engine_state). The state is the
            # one at exactly those positions: nothing before them can be recomputed.
            g.tokens = list(req.resumed_tokens)
            g.known, g.published, g.resumed_at = len(g.tokens), 0, g.computed
            g.generated = g.tokens[len(g.prompt):] + [struct.unpack("<I", req.engine_state)[0]]
            if g.computed != len(g.tokens) or table.checkpoint_slot is None:
                raise RuntimeError(f"{g.rid}: resumed at {g.computed} of {len(g.tokens)} tokens, state slot "
                                   f"{table.checkpoint_slot}: the state is not the one at its positions")
        self.running.append(g)

    def _local(self, group, index):
        return index - self.first[group]

    def _kv(self, g):
        tables = {}
        for t in g.req.group_tables:
            if self.kinds[t.name] == STATE:
                continue
            tables[t.name] = [None] * t.first_block_position + [self._local(t.name, b) for b in t.blocks]
        table = g.req.group_table(self.state).blocks
        running = self._local(self.state, table[0])
        states = {self.state: self.slots[self.state][:, running]}
        bt, grid = self.block_tokens, self.grid_tokens

        def checkpoint(group, length):
            # The spare slot receives the state at a k-grid position (published by the next step)
            # or, when the pool keeps End's tail, at any other block boundary (offered by End).
            if length % bt or len(table) < 2 or g.grid is not None:
                return None
            spare = table[1]
            if length % grid == 0:
                g.grid, g.tail = (length, spare), None
            elif self.at_end:
                g.tail = (length, spare)
            else:
                return None
            return self.slots[group][:, self._local(group, spare)]

        args = (self.block_tokens, self.pages, tables, states, checkpoint)
        if self.window_fault_blocks:
            return _FaultyWindowKv(self.window_fault_blocks, self.window_groups, *args)
        return PagedHybridKv(*args)

    def _compute(self, g, start, end):
        if g.first_computed is None:
            g.first_computed = start
        rows = self.model.forward(self._kv(g), g.tokens, start, end)
        g.rows.append(rows)
        if start < len(g.prompt):
            self.prefill_tokens += end - start
        g.computed = end
        if end == len(g.tokens):
            g.generated.append(int(rows[-1].argmax()))
            if len(g.generated) >= g.max_new:
                self.running.remove(g)
                self.finished.append(g)

    def preempt(self, rid):
        """Checkpoints running request `rid` (its positions with KV, the sampled-next token as
        engine_state, its running slot as the state there: docs/hybrid.md §2.9), releases it
        and queues it to resume (resume_from), as BatchEngine does under pressure."""
        g = next(x for x in self.running if x.rid == rid)
        if not g.generated or g.computed != len(g.tokens):
            raise ValueError(f"{rid}: preempted between decode positions only")
        self.running.remove(g)
        running = g.req.group_table(self.state).blocks[0]
        batch = StepBatch().preempt(g.req, g.tokens[:g.computed], struct.pack("<I", g.generated[-1]),
                                    state_checkpoints=[(self.group_index[self.state], g.computed, running)])
        r = self.client.step(batch)[0]
        if not r.ok:
            raise RuntimeError(f"{rid}: preempt failed: {r.code} {r.message}")
        g.req, g.resume, g.grid, g.tail = StepRequest(rid), True, None, None
        g.preemptions += 1
        self.waiting.append(g)

    def _result(self, g):
        return {"id": g.rid, "tokens": g.generated, "cached_tokens": g.cached_tokens,
                "first_computed": g.first_computed, "logits": torch.cat(g.rows) if g.rows else None,
                "checkpoints": g.outcomes, "window_at_start": g.window_at_start,
                "max_first_window": g.max_first_window, "preemptions": g.preemptions, "resumed_at": g.resumed_at}
