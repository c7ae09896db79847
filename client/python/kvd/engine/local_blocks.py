"""LocalBlocks: the in-process block manager BatchEngine is measured against: what an engine has
without kvd. Its own free list and prefix cache over its own memory (a bytearray), with kvd's block
size and policy — admission against a reservation of prompt + max_new_tokens in FIFO order, the
longest cached prefix of a namespace (cache salt) capped to leave one token to compute, publish of
full blocks, LRU eviction of unreferenced cached blocks — and no daemon, no round trips, nothing
shared with another process.

Duplicates (`chains`): a block another request cached first under the same key. "continue" (the
default) keeps the chain going as vLLM does (its block pool keeps a second block under an existing
hash, and the request's later blocks are cached after it), as kvd does since kvd-reuse-2: the
request's own copy stays private to it and is freed at its end. "stop" is the old rule, kvd's
before kvd-reuse-2: the chain stops at the duplicate and the request's later blocks are not cached,
which is what overlapping requests lost (the benchmarks run both to show it). `duplicates` and
`no_parent` count each published position's outcome once, as kvd's Report does.

It answers the calls BatchEngine makes of a kvd.Client (pool, layer_view, step) with the same
StepResult shapes, so the engine runs unchanged on either."""
import collections
import hashlib

import grpc

from kvd.step import StepResult


class _Pool:
    def __init__(self, name, block_tokens, num_layers, bytes_per_token_per_layer, capacity_blocks, max_model_len):
        self.id, self.name = 0, name
        self.block_tokens, self.num_layers = block_tokens, num_layers
        self.bytes_per_token_per_layer, self.capacity_blocks = bytes_per_token_per_layer, capacity_blocks
        self.max_model_len = max_model_len
        self.layer_block_bytes = block_tokens * bytes_per_token_per_layer
        self.maps = []

    def offset(self, block, layer):  # layer-major, as kvd's default layout
        return (layer * self.capacity_blocks + block) * self.layer_block_bytes


class LocalBlocks:
    def __init__(self, pool="default", block_tokens=4, num_layers=2, bytes_per_token_per_layer=16,
                 capacity_blocks=256, max_model_len=1024, chains="continue"):
        if chains not in ("continue", "stop"):
            raise ValueError(f"chains must be 'continue' or 'stop', not {chains!r}")
        self.chains = chains
        self.duplicates = self.no_parent = 0     # publish outcomes, once per position
        self._pool = _Pool(pool, block_tokens, num_layers, bytes_per_token_per_layer, capacity_blocks, max_model_len)
        self._mem = bytearray(capacity_blocks * num_layers * self._pool.layer_block_bytes)
        self._pool.maps = [self._mem]  # as kvd.Client's pools: layer-major, one shard
        self._free = list(range(capacity_blocks - 1, -1, -1))
        self._refs = [0] * capacity_blocks
        self._key_of = {}                          # cached block -> key
        self._cache = {}                           # key -> block
        self._lru = collections.OrderedDict()      # unreferenced cached blocks, oldest first
        self._reserved = 0
        self._live = {}                            # request id -> [salt, reserved blocks, table, outcomes]
        self.rpc_calls = 0                         # never any: the same field kvd.Client has

    @staticmethod
    def may_write(epoch=None):  # no daemon, no lease
        return True

    def pool(self, _name):
        return self._pool

    def layer_view(self, _pool, block, layer):
        start = self._pool.offset(block, layer)
        return memoryview(self._mem)[start:start + self._pool.layer_block_bytes]

    @staticmethod
    def _key(salt, parent, tokens):
        return hashlib.blake2b(repr((salt, parent, tuple(tokens))).encode(), digest_size=16).digest()

    def _blocks_for(self, n):
        return -(-n // self._pool.block_tokens)

    def _take(self, n):
        while len(self._free) < n and self._lru:
            victim, _ = self._lru.popitem(last=False)
            del self._cache[self._key_of.pop(victim)]
            self._free.append(victim)
        if len(self._free) < n:
            return None
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def _unref(self, b):
        self._refs[b] -= 1
        if self._refs[b] == 0:
            if b in self._key_of:
                self._lru[b] = True
            else:
                self._free.append(b)

    def step(self, batch):
        out = []
        for kind, req, arg in batch.items:
            out.append(getattr(self, "_" + kind)(req, arg))
        return out

    def _start(self, req, arg):
        p, bt = self._pool, self._pool.block_tokens
        prompt, salt = list(arg.admit.prompt), arg.admit.namespace.cache_salt
        need = self._blocks_for(len(prompt) + arg.admit.max_new_tokens)
        if self._reserved + need > p.capacity_blocks:
            req.waiting = True
            return StepResult(waiting=True)
        table, parent = [], b""
        for i in range((len(prompt) - 1) // bt):
            k = self._key(salt, parent, prompt[i * bt:(i + 1) * bt])
            b = self._cache.get(k)
            if b is None:
                break
            table.append(b)
            parent = k
        fresh = self._take(self._blocks_for(len(prompt)) - len(table))
        if fresh is None:
            req.waiting = True
            return StepResult(waiting=True)
        for b in table:
            self._refs[b] += 1
            self._lru.pop(b, None)
        self._reserved += need
        self._live[req.id] = [salt, need, table + fresh, {}]
        req.blocks, req.num_tokens, req.cached_tokens = table + fresh, len(prompt), len(table) * bt
        req.resumed, req.waiting, req.live, req.pool_id = False, False, True, 0
        return StepResult()

    def _grow(self, req, n):
        live = self._live[req.id]
        need = self._blocks_for(req.num_tokens + n) - len(live[2])
        got = self._take(need) if need > 0 else []
        if got is None:
            return StepResult(grpc.StatusCode.RESOURCE_EXHAUSTED, "the pool is full")
        live[2] += got
        req.blocks, req.num_tokens = live[2], req.num_tokens + n
        return StepResult()

    def _publish(self, req, arg):
        salt, _, table, outcomes = self._live[req.id]
        bt, parent, kept = self._pool.block_tokens, b"", 0
        tokens = list(arg.tokens)
        for i in range(arg.num_blocks):
            k = self._key(salt, parent, tokens[i * bt:(i + 1) * bt])
            b = self._cache.get(k)
            if b is None and table[i] not in self._key_of:
                self._cache[k], self._key_of[table[i]] = table[i], k
                kept += 1
            elif b != table[i]:
                # Another request cached it first (or, after a stop, an earlier position was not ours).
                if i not in outcomes:
                    outcomes[i] = "duplicate" if b is not None else "no_parent"
                    self.duplicates += b is not None
                    self.no_parent += b is None
                if self.chains == "stop":
                    for j in range(i + 1, arg.num_blocks):  # the rest of the chain is not cached
                        if j not in outcomes:
                            outcomes[j] = "no_parent"
                            self.no_parent += 1
                    break
                # vLLM's rule: the request's copy stays its own (freed at its end), its later
                # blocks are cached after the cached one (the chained key is the same either way).
            parent = k
        return StepResult(kept=kept)

    def _end(self, req, arg):
        _, need, table, _ = self._live.pop(req.id)
        for b in reversed(table):
            self._unref(b)
        self._reserved -= need
        req.live = False
        return StepResult()

    def _preempt(self, req, arg):
        return self._end(req, arg)  # no checkpoints in-process: the engine starts it over
