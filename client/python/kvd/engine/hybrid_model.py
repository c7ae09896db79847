"""TinyHybrid: the reference hybrid model of docs/hybrid.md §2.10 — four layers of three kinds,
random float32 weights from a fixed seed, computed one position at a time (as TinyDecoder), so a
position's logits depend only on what it reads from the cache, never on how positions are batched.

    layer 0  full attention            group "full" (layer 0 of the group)
    layer 1  sliding-window attention  group "swa"  (window W, itself included: vLLM's convention)
    layer 2  gated linear recurrence   group "rec"  (a `state` group: one fixed-size state)
    layer 3  full attention            group "full" (layer 1 of the group)

The recurrent layer, per head, after a causal depthwise convolution of width 4:

    u_t = x_t W_in;   c_t = silu(sum_{i<4} conv_w[i] * u_{t-3+i} + conv_b)
    q_t, k_t, v_t, g_t = c_t W_q, normalize(c_t W_k), c_t W_v, c_t W_g + g_bias
    h_t = sigmoid(g_t) * h_{t-1} + outer(k_t, v_t);   out_t = (q_t h_t) W_o

Its state at length L (after positions [0, L)) is h_{L-1} and the conv inputs u_{L-3..L-1}: one
flat float32 vector of `state_numel` elements, laid out as

    [0, H)              h, row-major [rec_heads][rec_key_dim][rec_value_dim]; H = the product
    [H, state_numel)    the last conv_width - 1 conv inputs, oldest first, [conv_width - 1][dim]

The initial state (L = 0) is all zeros, which is also what an empty conv window means.

The model reads every cache through a HybridKv (below): paged K/V per attention group and a running
state slot per state group. PagedHybridKv implements it over plain tensors — fresh ones for the
no-cache reference, a prefix cache's pages (hybrid_cache.py), or kvd's per-group slab views — so
the arithmetic is the same code on all of them and only the storage differs.
"""
import hashlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Protocol, Tuple

import torch

from .model import TinyDecoder

FULL, SLIDING_WINDOW, STATE = "full", "sliding_window", "state"


@dataclass(frozen=True)
class HybridConfig:
    vocab: int = 97
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    window: int = 6            # W of the sliding-window layer: positions one token attends to
    rec_heads: int = 2
    rec_key_dim: int = 8
    rec_value_dim: int = 8
    conv_width: int = 4
    seed: int = 4321           # the weights do not depend on `window`: W = 7 is the same model otherwise

    @property
    def dim(self):
        return self.heads * self.head_dim

    @property
    def layer_kinds(self):
        return (FULL, SLIDING_WINDOW, STATE, FULL)

    @property
    def groups(self):
        """KV groups in declaration order: (name, kind, model layers in the group's order)."""
        return (("full", FULL, (0, 3)), ("swa", SLIDING_WINDOW, (1,)), ("rec", STATE, (2,)))

    @property
    def layer_group(self):
        """Model layer -> (group name, index of the layer within its group)."""
        return {layer: (name, j) for name, _, layers in self.groups for j, layer in enumerate(layers)}

    @property
    def kv_inner_shape(self):
        """One token of one attention layer in a block: K and V, each [kv_heads][head_dim]."""
        return (2, self.kv_heads, self.head_dim)

    @property
    def bytes_per_token(self):
        return 2 * self.kv_heads * self.head_dim * 4

    @property
    def ssm_numel(self):
        return self.rec_heads * self.rec_key_dim * self.rec_value_dim

    @property
    def state_numel(self):
        return self.ssm_numel + (self.conv_width - 1) * self.dim

    @property
    def bytes_per_state(self):
        return self.state_numel * 4

    def window_blocks(self, block_tokens):
        """w = ceil((W - 1) / bt): the blocks before a hit at a block boundary that its first
        computed position reads (docs/hybrid.md §2.6)."""
        return -(-(self.window - 1) // block_tokens)

    def pool_groups(self, checkpoint_every_blocks):
        """The pool's `groups` as docs/hybrid.md §2.1 declares them for this model."""
        out = []
        for name, kind, layers in self.groups:
            g = {"name": name, "kind": kind, "layers": list(layers)}
            if kind == STATE:
                g.update(bytes_per_state=self.bytes_per_state, checkpoint_every_blocks=checkpoint_every_blocks)
            else:
                g.update(bytes_per_token=self.bytes_per_token, dtype="float32", kv_heads=self.kv_heads,
                         head_dim=self.head_dim, kv_arrangement="token_kv_head_dim")
                if kind == SLIDING_WINDOW:
                    g["window"] = self.window
            out.append(g)
        return out


class HybridKv(Protocol):
    """Where TinyHybrid keeps one request's cache, per KV group.

    Attention groups: write(g, j, pos, k, v) stores position pos of the group's j-th layer; read(g,
    j, lo, hi) returns K and V of positions [lo, hi), each [hi - lo][kv_heads][head_dim]. The model
    reads a full group from 0 and a window group from pos + 1 - W only.

    State groups: state(g) is the running slot, [layers of g][state_numel]; the model reads it at
    the start of forward() (it must then hold the state at exactly `start`) and writes it at the
    end. checkpoint_slot(g, length) is asked after each computed position: a tensor of the same
    shape to receive the state at `length`, or None."""

    def write(self, group: str, j: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def read(self, group: str, j: int, lo: int, hi: int) -> Tuple[torch.Tensor, torch.Tensor]: ...

    def state(self, group: str) -> torch.Tensor: ...

    def checkpoint_slot(self, group: str, length: int) -> Optional[torch.Tensor]: ...


class BlockNotHeld(LookupError):
    """A read reached a block the request's table does not hold: before a window group's first
    block, or released. The model never does this unless the window rule is broken."""


class PagedHybridKv:
    """A HybridKv over paged tensors, kvd's layout per group (docs/hybrid.md §2.2):

    pages[g]  attention group g: [layers of g][blocks][block_tokens][2][kv_heads][head_dim]; position
              p of layer j lives in pages[g][j, tables[g][p // bt], p % bt]
    tables[g] the request's block table of g; None where the request holds no block (a window
              group's blocks before its first block, or released ones)
    states[g] state group g: the running slot, [layers of g][state_numel]
    checkpoint(g, length) -> a slot view to copy the state at `length` into, or None

    Borrows every tensor: nothing is copied but the rows attention reads. Over kvd's memory,
    pages[g] and the slot views are the group's slab region (Client.kv_tensor(pool, group=g))
    viewed as float32, and the tables are the step results' tables."""

    def __init__(self, block_tokens: int, pages: Dict[str, torch.Tensor], tables: Dict[str, List[Optional[int]]],
                 states: Dict[str, torch.Tensor],
                 checkpoint: Optional[Callable[[str, int], Optional[torch.Tensor]]] = None):
        self.block_tokens = block_tokens
        self.pages = pages
        self.tables = {g: list(t) for g, t in tables.items()}
        self.states = states
        self._checkpoint = checkpoint

    def _block(self, group, index):
        table = self.tables[group]
        block = table[index] if index < len(table) else None
        if block is None:
            raise BlockNotHeld(f"group {group}: block {index} is not held by the request")
        return block

    def write(self, group, j, pos, k, v):
        bt = self.block_tokens
        page = self.pages[group][j, self._block(group, pos // bt), pos % bt]
        page[0] = k
        page[1] = v

    def read(self, group, j, lo, hi):
        bt = self.block_tokens
        first, last = lo // bt, (hi - 1) // bt
        blocks = [self._block(group, i) for i in range(first, last + 1)]
        pages = self.pages[group]
        rows = pages[j, blocks].reshape(-1, *pages.shape[3:])[lo - first * bt:hi - first * bt]
        return rows[:, 0], rows[:, 1]

    def state(self, group):
        return self.states[group]

    def checkpoint_slot(self, group, length):
        return self._checkpoint(group, length) if self._checkpoint else None

    def release_below(self, group, block):
        """Drops the table's blocks before `block` (a window group's release as it advances)."""
        table = self.tables[group]
        for i in range(min(block, len(table))):
            table[i] = None


def local_hybrid_kv(cfg: HybridConfig, block_tokens: int, num_tokens: int, checkpoint=None,
                    device="cpu") -> PagedHybridKv:
    """Fresh zeroed storage for `num_tokens` positions, identity tables, zero states: the cache of
    an engine with no prefix cache (the reference every cached run is compared with)."""
    blocks = -(-num_tokens // block_tokens)
    pages, tables, states = {}, {}, {}
    for name, kind, layers in cfg.groups:
        if kind == STATE:
            states[name] = torch.zeros(len(layers), cfg.state_numel, dtype=torch.float32, device=device)
        else:
            pages[name] = torch.zeros(len(layers), blocks, block_tokens, *cfg.kv_inner_shape, dtype=torch.float32,
                                      device=device)
            tables[name] = list(range(blocks))
    return PagedHybridKv(block_tokens, pages, tables, states, checkpoint)


def row_digests(logits: torch.Tensor) -> List[str]:
    """SHA-256 of each float32 logit row's bytes."""
    return [hashlib.sha256(row.contiguous().cpu().numpy().tobytes()).hexdigest() for row in logits]


class TinyHybrid:
    def __init__(self, cfg: HybridConfig = HybridConfig(), device="cpu"):
        """Weights drawn on the CPU from the seed (the same on every device), then moved to
        `device` ("cuda:N" when the pool's slabs are on a GPU)."""
        self.cfg = cfg
        self.device = device
        g = torch.Generator().manual_seed(cfg.seed)
        d, kvd = cfg.dim, cfg.kv_heads * cfg.head_dim
        rk, rv = cfg.rec_heads * cfg.rec_key_dim, cfg.rec_heads * cfg.rec_value_dim

        def w(*shape):
            return torch.randn(*shape, generator=g, dtype=torch.float32) / (shape[0] ** 0.5)

        self.embed = torch.randn(cfg.vocab, d, generator=g, dtype=torch.float32)
        self.layers = []
        for kind in cfg.layer_kinds:
            if kind == STATE:
                p = dict(w_in=w(d, d), conv_w=torch.randn(cfg.conv_width, d, generator=g) / cfg.conv_width ** 0.5,
                         conv_b=torch.randn(d, generator=g) * 0.1, wq=w(d, rk), wk=w(d, rk), wv=w(d, rv),
                         wg=w(d, cfg.rec_heads), wo=w(rv, d))
                # Decay near 0.9: the state remembers far back, so a stale or foreign one shows.
                p["g_bias"] = torch.full((cfg.rec_heads,), 2.0)
            else:
                p = dict(wq=w(d, d), wk=w(d, kvd), wv=w(d, kvd), wo=w(d, d))
            p.update(w1=w(d, 4 * d), w2=w(4 * d, d))
            self.layers.append(p)
        self.head = w(d, cfg.vocab)
        half = cfg.head_dim // 2
        self.inv_freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
        self.kv_of_head = torch.arange(cfg.heads) // (cfg.heads // cfg.kv_heads)
        self.state_groups = [name for name, kind, _ in cfg.groups if kind == STATE]
        if device != "cpu":
            self.embed, self.head, self.inv_freq, self.kv_of_head = (
                t.to(device) for t in (self.embed, self.head, self.inv_freq, self.kv_of_head))
            self.layers = [{k: v.to(device) for k, v in p.items()} for p in self.layers]

    # The reference decoder's rotary embedding and RMS norm, the same arithmetic bit for bit.
    _rope = TinyDecoder._rope
    _norm = staticmethod(TinyDecoder._norm)

    def _attend(self, kv, group, j, p, x, pos, window):
        cfg = self.cfg
        q = self._rope((x @ p["wq"]).view(cfg.heads, cfg.head_dim), pos)
        k = self._rope((x @ p["wk"]).view(cfg.kv_heads, cfg.head_dim), pos)
        v = (x @ p["wv"]).view(cfg.kv_heads, cfg.head_dim)
        kv.write(group, j, pos, k, v)
        lo = 0 if window is None else max(0, pos + 1 - window)
        keys, values = kv.read(group, j, lo, pos + 1)             # [n][kv_heads][head_dim]
        keys, values = keys[:, self.kv_of_head], values[:, self.kv_of_head]  # [n][heads][head_dim]
        scores = torch.einsum("nhd,hd->hn", keys, q) / (cfg.head_dim ** 0.5)
        out = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=1), values)
        return out.reshape(-1) @ p["wo"]

    def _recur(self, state, p, x):
        """One step of the recurrent layer; updates `state` (one layer's flat slot) in place."""
        cfg = self.cfg
        n = cfg.ssm_numel
        h = state[:n].view(cfg.rec_heads, cfg.rec_key_dim, cfg.rec_value_dim)
        window = torch.cat([state[n:].view(cfg.conv_width - 1, cfg.dim), (x @ p["w_in"])[None]])
        c = torch.nn.functional.silu((window * p["conv_w"]).sum(0) + p["conv_b"])
        q = (c @ p["wq"]).view(cfg.rec_heads, cfg.rec_key_dim)
        k = (c @ p["wk"]).view(cfg.rec_heads, cfg.rec_key_dim)
        k = k / (k.norm(dim=-1, keepdim=True) + 1e-6)
        v = (c @ p["wv"]).view(cfg.rec_heads, cfg.rec_value_dim)
        decay = torch.sigmoid(c @ p["wg"] + p["g_bias"])
        h = decay[:, None, None] * h + k[:, :, None] * v[:, None, :]
        out = torch.einsum("hk,hkv->hv", q, h).reshape(-1) @ p["wo"]
        state[:n] = h.reshape(-1)
        state[n:] = window[1:].reshape(-1)
        return out

    @torch.no_grad()
    def forward_position(self, kv: HybridKv, tokens, pos: int, states: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Computes position `pos`: writes its K/V through `kv`, advances `states` (working copies
        of the state groups' slots, [layers of g][state_numel], holding the state at `pos`) to
        pos + 1 in place, and returns its logits [vocab]."""
        cfg = self.cfg
        h = self.embed[tokens[pos]].clone()
        for layer, p in enumerate(self.layers):
            group, j = cfg.layer_group[layer]
            kind = cfg.layer_kinds[layer]
            x = self._norm(h)
            if kind == STATE:
                h = h + self._recur(states[group][j], p, x)
            else:
                h = h + self._attend(kv, group, j, p, x, pos, cfg.window if kind == SLIDING_WINDOW else None)
            h = h + torch.nn.functional.gelu(self._norm(h) @ p["w1"]) @ p["w2"]
        return self._norm(h) @ self.head

    @torch.no_grad()
    def forward(self, kv: HybridKv, tokens, start: int, end: int) -> torch.Tensor:
        """Computes positions [start, end) of `tokens` and returns their logits [end - start][vocab].
        REQUIRES: positions before `start` are readable through `kv` as the model reads them (all
        of a full group, the last W - 1 of a window group) and kv.state(g) holds the state at
        exactly `start`. Reads the running states once, offers the state at every length in
        (start, end] to kv.checkpoint_slot, and writes the running states back at the end."""
        states = {g: kv.state(g).clone() for g in self.state_groups}
        out = []
        for pos in range(start, end):
            out.append(self.forward_position(kv, tokens, pos, states))
            for g in self.state_groups:
                slot = kv.checkpoint_slot(g, pos + 1)
                if slot is not None:
                    slot.copy_(states[g])
        for g in self.state_groups:
            kv.state(g).copy_(states[g])
        return torch.stack(out) if out else torch.empty(0, self.cfg.vocab, device=self.device)

    def generate(self, kv: HybridKv, prompt, start: int, max_new: int, chunk: Optional[int] = None, step=None):
        """Greedy decoding: prefill [start, len(prompt)) in chunks that end on multiples of `chunk`
        (one chunk when None), then max_new tokens one position at a time. `step(tokens,
        computed)`, if given, runs after each forward with the tokens so far and how many have
        been computed (a publish, a window release).
        Returns (logits of every computed position [n][vocab], the new tokens)."""
        tokens = list(prompt)
        rows, pos = [], start
        while pos < len(tokens):
            end = len(tokens) if chunk is None else min(len(tokens), (pos // chunk + 1) * chunk)
            rows.append(self.forward(kv, tokens, pos, end))
            pos = end
            if step:
                step(tokens, pos)
        new = []
        for _ in range(max_new):
            new.append(int(rows[-1][-1].argmax()))
            if len(new) == max_new:
                break
            tokens.append(new[-1])
            rows.append(self.forward(kv, tokens, len(tokens) - 1, len(tokens)))
            if step:
                step(tokens, len(tokens))
        return torch.cat(rows), new
