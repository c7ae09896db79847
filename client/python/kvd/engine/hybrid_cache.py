"""HybridPrefixCache: an in-process simulator of kvd's hybrid prefix cache (docs/hybrid.md
§2.4–2.7), pure Python over torch tensors, no daemon. It exists to prove the model side of the
design: that a hit served by §2.6's rule — full blocks [0, d), window blocks [d − w, d) with
w = ceil((W − 1) / bt), a state checkpoint at exactly L = d·bt — gives TinyHybrid's logits bit for
bit, and that serving anything else (a wrong window, a foreign block, a stale or foreign or
damaged checkpoint) does not.

Memory, as kvd lays a hybrid pool out per group (§2.2):
  pages[g]  attention group g: [layers of g][capacity_blocks][bt][2][kv_heads][head_dim]
  slots[g]  state group g:     [layers of g][capacity_slots][state_numel]
A request runs on a PagedHybridKv over these very tensors (cached blocks are read in place, as
kvd's tables name them); only a hit's checkpoint is copied, into the request's running slot.

The spine: one node per block position of a cached chain, keyed by (parent key, the block's
tokens), carrying one component per group: the full block, the window block (None: a tombstone),
and at checkpoint positions a state slot. Node n_d covers positions [(d−1)·bt, d·bt); a
checkpoint on n_d is the state at d·bt.

Not simulated: eviction (nothing is ever evicted but what a test tombstones), admission, salts,
refcounts. Thread-compatible; one caller.
"""
import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .hybrid_model import FULL, SLIDING_WINDOW, STATE, HybridConfig, PagedHybridKv

_ROOT = b""


@dataclass
class _Node:
    key: bytes
    depth: int                                        # d: this node is n_d
    blocks: Dict[str, Optional[int]] = field(default_factory=dict)
    checkpoints: Dict[str, int] = field(default_factory=dict)


@dataclass
class Hit:
    blocks: int                   # d: the hit is L = d·bt tokens
    full_hit_blocks: int          # F: the chain's nodes along the prompt (capped)
    limited_by: Optional[str]     # the group that made d < F, None when d = F
    nodes: list                   # n_1 .. n_F


class HybridRequest:
    """One request's tables and slots, and the PagedHybridKv the model runs on (`kv`)."""

    def __init__(self, cache, prompt, hit, kv, running):
        self.cache = cache
        self.prompt = list(prompt)
        self.hit = hit
        self.kv = kv
        self.running = running                 # state group -> slot
        self.grid = []                         # (group, length, slot) written on the k-grid
        self.tail = {}                         # state group -> (length, slot): the last block boundary
        self.outcomes = []                     # (group, length, outcome) of every checkpoint offered

    @property
    def cached_tokens(self):
        return self.hit.blocks * self.cache.block_tokens

    def _checkpoint(self, group, length):
        c = self.cache
        if length % c.block_tokens:
            return None
        if (length // c.block_tokens) % c.k == 0:
            slot = c._take_slot(group)
            self.grid.append((group, length, slot))
        elif c.checkpoint_at_end:
            slot = self.tail[group][1] if group in self.tail else c._take_slot(group)
            self.tail[group] = (length, slot)
        else:
            return None
        return c.slots[group][:, slot]

    def publish(self, tokens, final=False):
        """Attaches the full blocks of `tokens` (the positions computed so far) to the spine with
        the window blocks the request still holds, then offers its checkpoints (§2.7): the grid
        ones at or below the published length, and at `final` (End) the tail."""
        c = self.cache
        bt = c.block_tokens
        n = len(tokens) // bt
        parent = _ROOT
        for d in range(n):
            key = c._key(parent, tokens[d * bt:(d + 1) * bt])
            node = c._nodes.get(key)
            if node is None:
                node = c._nodes[key] = _Node(key, d + 1)
                node.blocks[c.full_group] = self.kv.tables[c.full_group][d]
            for g in c.window_groups:
                held = self.kv.tables[g][d]
                if node.blocks.get(g) is None and held is not None:
                    node.blocks[g] = held
                    c._cached[g].add(held)
            c._cached[c.full_group].add(node.blocks[c.full_group])
            parent = key
        offered = [x for x in self.grid if x[1] <= n * bt]
        self.grid = [x for x in self.grid if x[1] > n * bt]
        if final:
            offered += [(g, length, slot) for g, (length, slot) in self.tail.items()]
            self.tail = {}
        for g, length, slot in offered:
            outcome = c._attach_checkpoint(tokens, g, length, slot, tail=final and length == n * bt)
            self.outcomes.append((g, length, outcome))
            if outcome != "kept":
                c._free_slots[g].append(slot)

    def release_window(self, computed):
        """Drops the window groups' blocks wholly below computed − (W − 1) from the table (§2.4):
        the model must never read them again. Published ones stay cached on the spine."""
        c = self.cache
        below = max(0, computed - (c.cfg.window - 1)) // c.block_tokens
        for g in c.window_groups:
            for b in self.kv.tables[g][:below]:
                if b is not None and b not in c._cached[g]:
                    c._free_blocks[g].append(b)
            self.kv.release_below(g, below)

    def end(self, tokens):
        """Publishes everything (with the tail) and gives back what the spine did not keep."""
        self.publish(tokens, final=True)
        c = self.cache
        for g, slot in self.running.items():
            c._free_slots[g].append(slot)
        for g, length, slot in self.grid:
            c._free_slots[g].append(slot)
        self.grid, self.running = [], {}


class HybridPrefixCache:
    def __init__(self, cfg: HybridConfig, block_tokens: int = 4, checkpoint_every_blocks: int = 2,
                 checkpoint_at_end: bool = True, capacity_blocks: int = 512, capacity_slots: int = 128):
        self.cfg = cfg
        self.block_tokens = block_tokens
        self.k = checkpoint_every_blocks
        self.checkpoint_at_end = checkpoint_at_end
        self.w = cfg.window_blocks(block_tokens)
        self.pages, self.slots = {}, {}
        self._free_blocks, self._free_slots, self._cached = {}, {}, {}
        for name, kind, layers in cfg.groups:
            if kind == STATE:
                self.slots[name] = torch.zeros(len(layers), capacity_slots, cfg.state_numel, dtype=torch.float32)
                self._free_slots[name] = list(range(capacity_slots - 1, -1, -1))
            else:
                self.pages[name] = torch.zeros(len(layers), capacity_blocks, block_tokens, *cfg.kv_inner_shape,
                                               dtype=torch.float32)
                self._free_blocks[name] = list(range(capacity_blocks - 1, -1, -1))
                self._cached[name] = set()
        self.full_group = next(n for n, kind, _ in cfg.groups if kind == FULL)
        self.window_groups = [n for n, kind, _ in cfg.groups if kind == SLIDING_WINDOW]
        self.state_groups = [n for n, kind, _ in cfg.groups if kind == STATE]
        self._nodes = {}

    @staticmethod
    def _key(parent, tokens):
        return hashlib.blake2b(repr((parent, tuple(tokens))).encode(), digest_size=16).digest()

    def _take_block(self, g):
        return self._free_blocks[g].pop()

    def _take_slot(self, g):
        return self._free_slots[g].pop()

    def _chain(self, tokens, limit):
        nodes, parent, bt = [], _ROOT, self.block_tokens
        for d in range(limit):
            node = self._nodes.get(self._key(parent, tokens[d * bt:(d + 1) * bt]))
            if node is None:
                break
            nodes.append(node)
            parent = node.key
        return nodes

    def _serves(self, nodes, d):
        """The group that cannot serve a hit of d blocks over `nodes`, or None (§2.6)."""
        for g in self.window_groups:
            if any(n.blocks.get(g) is None for n in nodes[d - min(d, self.w):d]):
                return g
        for g in self.state_groups:
            if d > 0 and g not in nodes[d - 1].checkpoints:
                return g
        return None

    def lookup(self, prompt) -> Hit:
        """§2.6: the largest d ≤ F whose every group serves it; at most (len − 1) // bt blocks, so
        one token is left to compute."""
        nodes = self._chain(prompt, (len(prompt) - 1) // self.block_tokens)
        limited_by = self._serves(nodes, len(nodes))
        for d in range(len(nodes), -1, -1):
            if self._serves(nodes, d) is None:
                return Hit(d, len(nodes), limited_by if d < len(nodes) else None, nodes)
        raise AssertionError("d = 0 always serves")

    def _attach_checkpoint(self, tokens, g, length, slot, tail):
        d = length // self.block_tokens
        if length % self.block_tokens or (d % self.k and not (tail and self.checkpoint_at_end)):
            return "not_aligned"
        nodes = self._chain(tokens, d)
        if len(nodes) < d:
            return "no_chain"
        if any(n.blocks.get(wg) is None for wg in self.window_groups for n in nodes[d - min(d, self.w):d]):
            return "no_window"
        if d == 0 or g in nodes[d - 1].checkpoints:
            return "already_cached"
        nodes[d - 1].checkpoints[g] = slot
        return "kept"

    def start(self, prompt, max_new: int) -> HybridRequest:
        """Looks the prompt up and returns a request holding the hit and fresh blocks for the rest
        of prompt + max_new − 1 computed positions, its running slots holding the hit's
        checkpoint (zeros for a hit of 0)."""
        return self._start(prompt, max_new, self.lookup(prompt))

    def start_with_fault_for_testing(self, prompt, max_new: int, *, window_block_chain=None, checkpoint_blocks=None,
                                     checkpoint_chain=None, zero_conv=False) -> HybridRequest:
        """Serves the hit start() would, damaged on purpose (the negative controls):
        window_block_chain  the oldest window block of the hit comes from this other prompt's chain
        checkpoint_blocks   the checkpoint copied is the one at this many blocks, not the hit's
        checkpoint_chain    the checkpoint copied is this other prompt's at the same length
        zero_conv           the conv inputs of the copied state are zeroed"""
        hit = self.lookup(prompt)
        d = hit.blocks
        if window_block_chain is not None:
            other = self._chain(window_block_chain, d)
            assert len(other) >= d and d >= self.w > 0, "the other chain must cover the window"
            hit.nodes = list(hit.nodes)
            i = d - self.w
            hit.nodes[i] = _Node(hit.nodes[i].key, i + 1, dict(hit.nodes[i].blocks), hit.nodes[i].checkpoints)
            for g in self.window_groups:
                hit.nodes[i].blocks[g] = other[i].blocks[g]
        source = None
        if checkpoint_blocks is not None:
            source = hit.nodes[checkpoint_blocks - 1]
        if checkpoint_chain is not None:
            source = self._chain(checkpoint_chain, d)[d - 1]
        return self._start(prompt, max_new, hit, checkpoint_source=source, zero_conv=zero_conv)

    def _start(self, prompt, max_new, hit, checkpoint_source=None, zero_conv=False):
        bt, d = self.block_tokens, hit.blocks
        total_blocks = -(-(len(prompt) + max_new - 1) // bt)
        tables = {self.full_group: [n.blocks[self.full_group] for n in hit.nodes[:d]]}
        ww = min(d, self.w)
        for g in self.window_groups:
            tables[g] = [None] * (d - ww) + [n.blocks[g] for n in hit.nodes[d - ww:d]]
        for g, table in tables.items():
            table += [self._take_block(g) for _ in range(total_blocks - d)]
        running, states = {}, {}
        for g in self.state_groups:
            running[g] = self._take_slot(g)
            states[g] = self.slots[g][:, running[g]]
            states[g].zero_()
            source = checkpoint_source or (hit.nodes[d - 1] if d else None)
            if source is not None:
                states[g].copy_(self.slots[g][:, source.checkpoints[g]])
            if zero_conv:
                states[g][:, self.cfg.ssm_numel:] = 0
        req = None
        kv = PagedHybridKv(bt, self.pages, tables, states, checkpoint=lambda g, length: req._checkpoint(g, length))
        req = HybridRequest(self, prompt, hit, kv, running)
        return req

    def checkpoint_lengths(self, prompt) -> List[int]:
        """The lengths along `prompt`'s cached chain that hold a checkpoint (any state group)."""
        nodes = self._chain(prompt, len(prompt) // self.block_tokens)
        return [n.depth * self.block_tokens for n in nodes if n.checkpoints]

    def drop_component_for_testing(self, prompt, blocks, group):
        """Tombstones `group`'s component of n_blocks on `prompt`'s chain (a window block or a
        checkpoint), as eviction under that group's pressure would."""
        node = self._chain(prompt, blocks)[blocks - 1]
        if group in node.checkpoints:
            del node.checkpoints[group]
        else:
            node.blocks[group] = None


def run(cache: HybridPrefixCache, model, prompt, max_new: int, request: Optional[HybridRequest] = None,
        release: bool = True):
    """Runs `prompt` as an engine on the cache would: starts it (or takes `request`, already
    started), prefills in chunks that end on the k-grid, publishes after each forward and then,
    with `release`, releases the window by the cache's W (publish first, as §2.7 orders), ends
    with the tail. Returns (logits of the computed positions, new tokens, the request)."""
    req = request or cache.start(prompt, max_new)

    def step(tokens, computed):
        req.publish(tokens[:computed])
        if release:
            req.release_window(computed)

    logits, new = model.generate(req.kv, prompt, req.cached_tokens, max_new, chunk=cache.k * cache.block_tokens,
                                 step=step)
    req.end((list(prompt) + new)[:len(prompt) + max_new - 1])
    return logits, new, req
