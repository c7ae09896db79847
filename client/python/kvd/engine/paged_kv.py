"""PagedKv: a request's KV cache as kvd holds it. `tensor` is the pool's zero-copy view
[layers][blocks][block_tokens][2][kv_heads][head_dim] (Client.kv_tensor), `table` the request's
block table from Acquire/Extend; position p of a layer lives in block table[p // block_tokens],
slot p % block_tokens. Nothing is copied in or out of kvd's memory but the rows attention reads.

`wrong_layer_below` simulates a layout bug for the test that proves the exactness check can fail:
positions below it (the reused prefix) are read from the next layer's array."""


class PagedKv:
    def __init__(self, tensor, table, block_tokens, wrong_layer_below=0):
        self.tensor = tensor
        self.table = list(table)
        self.block_tokens = block_tokens
        self.wrong_layer_below = wrong_layer_below

    def write(self, layer, pos, k, v):
        block, slot = self.table[pos // self.block_tokens], pos % self.block_tokens
        self.tensor[layer, block, slot, 0] = k
        self.tensor[layer, block, slot, 1] = v

    def read(self, layer, n):
        """K and V of positions 0..n-1, each [n][kv_heads][head_dim]."""
        blocks = self.table[:(n + self.block_tokens - 1) // self.block_tokens]
        rows = self.tensor[layer, blocks].reshape(-1, *self.tensor.shape[3:])[:n]
        if self.wrong_layer_below > 0:
            wrong = (layer + 1) % self.tensor.shape[0]
            bad = self.tensor[wrong, blocks].reshape(-1, *self.tensor.shape[3:])[:n].clone()
            rows = rows.clone()
            m = min(n, self.wrong_layer_below)
            rows[:m] = bad[:m]
        return rows[:, 0], rows[:, 1]
