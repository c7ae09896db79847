"""TinyDecoder: a decoder-only transformer with grouped-query attention, rotary positions and
RMSNorm, random float32 weights from a fixed seed (no download).

It computes one position at a time (every projection is a row vector times a matrix, and the
attention of position p sees exactly keys 0..p), so the float32 result at a position depends
only on the KV of earlier positions, never on how many positions are computed together. That
makes "a cached prefix gives bit-for-bit the same logits as recomputing it" a property kvd must
earn (layout, block tables, prefix cap), not one that rounding could blur.

The KV of every layer lives in a `kv` object (paged_kv.PagedKv) with write(layer, pos, k, v) and
read(layer, n) -> (K, V) of positions 0..n-1.
"""
import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Config:
    vocab: int = 97
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    seed: int = 1234

    @property
    def dim(self):
        return self.heads * self.head_dim

    @property
    def kv_inner_shape(self):
        """What one token of one layer holds in a kvd block: K and V, each [kv_heads][head_dim]."""
        return (2, self.kv_heads, self.head_dim)

    @property
    def bytes_per_token_per_layer(self):
        return 2 * self.kv_heads * self.head_dim * 4  # float32

    def expectation(self, pool):
        """What this model's kernels assume about `pool` (a kvd_pb2.PoolExpectation's fields):
        kvd refuses the worker's Attach when the pool was declared otherwise."""
        return {"pool": pool, "dtype": "float32", "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "kv_arrangement": "token_kv_head_dim"}


class TinyDecoder:
    def __init__(self, cfg=Config(), adapter="", device="cpu"):
        """Weights drawn on the CPU from the seed (the same on every device), then moved to
        `device` ("cuda:N" when the pool's slabs are on a GPU)."""
        self.cfg = cfg
        self.device = device
        g = torch.Generator().manual_seed(cfg.seed)
        d, kvd = cfg.dim, cfg.kv_heads * cfg.head_dim

        def w(*shape):
            return torch.randn(*shape, generator=g, dtype=torch.float32) / (shape[0] ** 0.5)

        self.embed = torch.randn(cfg.vocab, d, generator=g, dtype=torch.float32)
        self.layers = [dict(wq=w(d, d), wk=w(d, kvd), wv=w(d, kvd), wo=w(d, d), w1=w(d, 4 * d), w2=w(4 * d, d))
                       for _ in range(cfg.layers)]
        self.head = w(d, cfg.vocab)
        # An adapter changes the model (like a LoRA would): a bias on every embedding, derived from
        # its name. KV computed under one adapter is wrong under another.
        self.bias = torch.zeros(d, dtype=torch.float32)
        if adapter:
            seed = int.from_bytes(hashlib.sha256(adapter.encode()).digest()[:8], "little")
            self.bias = torch.randn(d, generator=torch.Generator().manual_seed(seed), dtype=torch.float32) * 0.5
        half = cfg.head_dim // 2
        self.inv_freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
        if device != "cpu":
            self.embed, self.head, self.bias, self.inv_freq = (
                t.to(device) for t in (self.embed, self.head, self.bias, self.inv_freq))
            self.layers = [{k: v.to(device) for k, v in p.items()} for p in self.layers]

    def _rope(self, x, pos):
        """Rotary position embedding of x [heads][head_dim] at position pos."""
        angle = pos * self.inv_freq
        cos, sin = torch.cos(angle), torch.sin(angle)
        a, b = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    @staticmethod
    def _norm(x):
        return x * torch.rsqrt((x * x).mean() + 1e-6)

    @torch.no_grad()
    def forward(self, kv, tokens, start, end):
        """Computes positions [start, end) of `tokens`, writing their K and V into `kv` and reading
        positions [0, p] for each p; returns the logits of those positions [end-start][vocab].
        Positions before `start` must already be in `kv` (kvd's cached prefix)."""
        cfg = self.cfg
        group = cfg.heads // cfg.kv_heads
        out = []
        for pos in range(start, end):
            h = self.embed[tokens[pos]] + self.bias
            for layer, p in enumerate(self.layers):
                x = self._norm(h)
                q = self._rope((x @ p["wq"]).view(cfg.heads, cfg.head_dim), pos)
                k = self._rope((x @ p["wk"]).view(cfg.kv_heads, cfg.head_dim), pos)
                v = (x @ p["wv"]).view(cfg.kv_heads, cfg.head_dim)
                kv.write(layer, pos, k, v)
                keys, values = kv.read(layer, pos + 1)  # [pos+1][kv_heads][head_dim]
                heads = []
                for hd in range(cfg.heads):
                    g = hd // group
                    scores = (keys[:, g, :] @ q[hd]) / (cfg.head_dim ** 0.5)
                    heads.append(torch.softmax(scores, dim=0) @ values[:, g, :])
                h = h + torch.cat(heads) @ p["wo"]
                h = h + torch.nn.functional.gelu(self._norm(h) @ p["w1"]) @ p["w2"]
            out.append(self._norm(h) @ self.head)
        return torch.stack(out) if out else torch.empty(0, cfg.vocab, device=self.device)
