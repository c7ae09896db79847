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
import time

import torch


from kvd.engine.model import TinyDecoder
from kvd.engine.paged_kv import PagedKv


class Engine:
    def __init__(self, client, pool="default", cfg=None, wrong_layer_stride=False, peer=""):
        self.client = client
        self.peer = peer  # a peer kvd that may hold the prompts' prefixes (docs/transfer.md)
        self.pool = pool
        self.models = {}
        self.cfg = cfg or TinyDecoder().cfg
        self.kv = client.kv_tensor(pool, torch.float32, self.cfg.kv_inner_shape)
        self.device = str(self.kv.device)  # cpu on the host backend, cuda:N on CUDA slabs
        self.block_tokens = client.pool(pool).block_tokens
        self.wrong_layer_stride = wrong_layer_stride

    def model(self, adapter):
        if adapter not in self.models:
            self.models[adapter] = TinyDecoder(self.cfg, adapter, self.device)
        return self.models[adapter]

    def generate(self, request_id, prompt, max_new=4, adapter="", salt="", checkpoint_every=0, resume=False,
                 on_checkpoint=None):
        """Generates `max_new` tokens greedily. With `resume`, continues request_id's checkpoint
        (left by a worker that died): the full sequence equals an uninterrupted run's.
        `on_checkpoint()` runs after each checkpoint (the worker's crash hook)."""
        model = self.model(adapter)
        digest = hashlib.sha256()
        generated = []
        start, rpc_before = time.perf_counter(), self.client.rpc_seconds
        ttft = None
        req = self._request(request_id, prompt, max_new, adapter, salt, resume)
        with req:
            cached = req.cached_tokens
            kv = PagedKv(self.kv, req.blocks, self.block_tokens,
                         wrong_layer_below=cached if self.wrong_layer_stride else 0)
            if req.resumed:
                # Positions with KV, then the token the dead worker sampled next (engine_state).
                tokens = list(req.resumed_tokens)
                generated = tokens[len(prompt):] + [struct.unpack("<I", req.engine_state)[0]]
                if cached < len(tokens):  # kvd handed back a fresh tail block: recompute it
                    model.forward(kv, tokens, cached, len(tokens))
            else:
                tokens = list(prompt)
                logits = model.forward(kv, tokens, cached, len(tokens))[-1]
                self._written()
                req.publish(tokens)
                digest.update(logits.cpu().numpy().tobytes())
                generated.append(int(torch.argmax(logits)))
            ttft = time.perf_counter() - start
            while len(generated) < max_new:
                # The last sampled token needs a position of its own before its KV is computed.
                req.extend(1)
                kv.table = req.blocks
                tokens.append(generated[-1])
                logits = model.forward(kv, tokens, len(tokens) - 1, len(tokens))[-1]
                digest.update(logits.cpu().numpy().tobytes())
                generated.append(int(torch.argmax(logits)))
                if checkpoint_every and len(generated) < max_new and len(generated) % checkpoint_every == 0:
                    # Positions 0..len(tokens)-1 have KV; the token just sampled is the state.
                    self._written()
                    req.checkpoint(tokens, struct.pack("<I", generated[-1]))
                    if on_checkpoint is not None:
                        on_checkpoint()
        return {"id": request_id, "cached_tokens": cached, "resumed": req.resumed, "tokens": generated,
                "digest": digest.hexdigest(), "prompt_tokens": len(prompt), "ttft_s": ttft,
                "wall_s": time.perf_counter() - start, "rpc_s": self.client.rpc_seconds - rpc_before}

    def _written(self):
        """Before other processes may read what this one wrote (publish, checkpoint): on a GPU the
        writes must have landed. A host slab is coherent already. (An engine that must not stall
        records its IPC event instead, see docs/api.md.)"""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)

    def _request(self, request_id, prompt, max_new, adapter, salt, resume):
        """Client.request. A resume right after the previous worker died needs no retry: kvd's
        Admit waits (bounded) for the dead worker's request to end."""
        return self.client.request(request_id, self.pool, list(prompt), max_new_tokens=max_new,
                                   cache_salt=salt, adapter=adapter, resume_from=request_id if resume else "",
                                   peer=self.peer)
