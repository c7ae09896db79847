"""Engine: serves one generation at a time on kvd's memory, following exactly the protocol an
inference engine must follow (docs/api.md):

  admit + acquire (Client.request)  ->  compute only positions [cached_tokens, len(prompt))
  -> publish the prompt's full blocks  ->  per generated token: extend by one position, compute it
  -> checkpoint every N generated tokens (tokens whose KV is written; the next token in
     engine_state)  ->  release (completed, or interrupted on an exception).

Greedy sampling; the result carries the generated tokens and a SHA-256 of every float32 logit
row it sampled from, so two runs can be compared bit for bit."""
import hashlib
import struct

import torch

from kvd.engine.model import TinyDecoder
from kvd.engine.paged_kv import PagedKv


class Engine:
    def __init__(self, client, pool="default", cfg=None, wrong_layer_stride=False):
        self.client = client
        self.pool = pool
        self.models = {}
        self.cfg = cfg or TinyDecoder().cfg
        self.kv = client.kv_tensor(pool, torch.float32, self.cfg.kv_inner_shape)
        self.block_tokens = client.pool(pool).block_tokens
        self.wrong_layer_stride = wrong_layer_stride

    def model(self, adapter):
        if adapter not in self.models:
            self.models[adapter] = TinyDecoder(self.cfg, adapter)
        return self.models[adapter]

    def generate(self, request_id, prompt, max_new=4, adapter="", salt="", checkpoint_every=0):
        model = self.model(adapter)
        digest = hashlib.sha256()
        generated = []
        with self.client.request(request_id, self.pool, list(prompt), max_new_tokens=max_new,
                                 cache_salt=salt, adapter=adapter) as req:
            cached = req.cached_tokens
            kv = PagedKv(self.kv, req.blocks, self.block_tokens,
                         wrong_layer_below=cached if self.wrong_layer_stride else 0)
            tokens = list(prompt)
            logits = model.forward(kv, tokens, cached, len(tokens))[-1]
            req.publish(tokens)
            for i in range(max_new):
                digest.update(logits.numpy().tobytes())
                nxt = int(torch.argmax(logits))
                generated.append(nxt)
                if i + 1 == max_new:
                    break
                # The sampled token needs a position of its own before its KV can be computed.
                req.extend(1)
                kv.table = req.blocks
                tokens.append(nxt)
                logits = model.forward(kv, tokens, len(tokens) - 1, len(tokens))[-1]
                if checkpoint_every and (i + 1) % checkpoint_every == 0:
                    # Positions 0..len(tokens)-1 have KV; the token sampled from `logits` next
                    # is the engine's state.
                    req.checkpoint(tokens, struct.pack("<I", int(torch.argmax(logits))))
        return {"id": request_id, "cached_tokens": cached, "tokens": generated, "digest": digest.hexdigest()}
