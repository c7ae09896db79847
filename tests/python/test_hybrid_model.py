"""The reference hybrid model's exactness (docs/hybrid.md §2.10), on the in-process prefix-cache
simulator (kvd.engine.hybrid_cache), no daemon: a prompt that reuses a cached prefix — full blocks,
the window's blocks in place, the checkpoint copied into its running state — gives logits equal bit
for bit (torch.equal and the SHA-256 of every float32 row) and the same greedy tokens as the same
prompt on an engine with no cache; and each negative control (a window of 7 over a cache built
with 6, a window block of another chain, a stale checkpoint, the conv state zeroed, another
chain's checkpoint) changes the logits at the first computed position.

Pool: 4-token blocks, W = 6 (w = 2 blocks, the window straddles a block), checkpoints every
k = 2 blocks (8 tokens) with the tail on.

Runs under pytest, or alone: test_hybrid_model.py   (PYTHONPATH = the build's python/ directory)"""
import sys
import traceback

import torch

from kvd.engine.hybrid_cache import HybridPrefixCache, run
from kvd.engine.hybrid_model import (BlockNotHeld, HybridConfig, TinyHybrid, local_hybrid_kv,
                                     row_digests)

BT, K = 4, 2
CFG = HybridConfig()
MODEL = TinyHybrid(CFG)


def base(n, start=1, step=7):
    return [(start + step * i) % CFG.vocab for i in range(n)]


A = base(18)                        # computes 21 positions with 4 new tokens: checkpoints 8, 16, tail 20
B = A[:17] + base(6, 40)            # shares 4 blocks of A: hits at the checkpoint at 16
C = A[:6] + base(9, 60)             # shares 1 block (< k): hits at 0
E = base(22, 5, 11)                 # another chain, as long: window blocks and a checkpoint at 16
MAX_NEW = 4
_reference = {}


def reference(prompt, model=MODEL, max_new=MAX_NEW):
    """Logits of every position and the new tokens on an engine with no cache."""
    key = (tuple(prompt), model.cfg.window, max_new)
    if key not in _reference:
        kv = local_hybrid_kv(model.cfg, BT, len(prompt) + max_new)
        _reference[key] = model.generate(kv, prompt, 0, max_new)
    return _reference[key]


def cache_with(*prompts, model=MODEL):
    cache = HybridPrefixCache(CFG, block_tokens=BT, checkpoint_every_blocks=K)
    for p in prompts:
        run(cache, model, p, MAX_NEW)
    return cache


def same(cached, prompt, model=MODEL):
    """Whether a cached run's logits and tokens equal the no-cache run's at the positions it
    computed, by torch.equal and by the SHA-256 of every row."""
    logits, new, req = cached
    ref_logits, ref_new = reference(prompt, model)
    tail = ref_logits[req.cached_tokens:]
    return (torch.equal(logits, tail) and row_digests(logits) == row_digests(tail) and new == ref_new)


def first_row_differs(cached, prompt, model=MODEL):
    logits, _, req = cached
    ref = reference(prompt, model)[0][req.cached_tokens]
    return not torch.equal(logits[0], ref) and row_digests(logits[:1]) != row_digests(ref[None])


def test_pool_groups_cover_every_layer_once():
    groups = CFG.pool_groups(checkpoint_every_blocks=K)
    assert sorted(layer for g in groups for layer in g["layers"]) == list(range(len(CFG.layer_kinds)))
    assert [(g["name"], g["kind"]) for g in groups] == [("full", "full"), ("swa", "sliding_window"), ("rec", "state")]
    assert groups[1]["window"] == 6 and groups[0]["bytes_per_token"] == 2 * 2 * 8 * 4
    assert groups[2]["bytes_per_state"] == 4 * (2 * 8 * 8 + 3 * 32) and groups[2]["checkpoint_every_blocks"] == K
    assert CFG.window_blocks(BT) == 2 and HybridConfig(window=7).window_blocks(BT) == 2


def test_emitted_state_resumes_at_any_length():
    """The state the model offers at length L (block boundary or not), with the K/V of [0, L),
    continues the computation exactly: the model side of a checkpoint."""
    prompt = A + base(4, 3)
    n = len(prompt)
    states = {}

    def keep(group, length):
        states[length] = torch.empty(len(CFG.groups[2][2]), CFG.state_numel)
        return states[length]

    kv = local_hybrid_kv(CFG, BT, n, checkpoint=keep)
    ref = MODEL.forward(kv, prompt, 0, n)
    assert sorted(states) == list(range(1, n + 1))
    assert torch.equal(ref, reference(prompt)[0][:n])  # the same rows, computed in one forward or chunks
    for length in (1, 3, 7, 8, 10, 13, 16):
        resumed = local_hybrid_kv(CFG, BT, n)
        for g, pages in resumed.pages.items():
            flat = pages.view(pages.shape[0], -1, *pages.shape[3:])
            flat[:, :length] = kv.pages[g].view_as(flat)[:, :length]
        resumed.states["rec"].copy_(states[length])
        assert torch.equal(MODEL.forward(resumed, prompt, length, n), ref[length:]), length


def test_reuse_is_exact():
    cache = HybridPrefixCache(CFG, block_tokens=BT, checkpoint_every_blocks=K)
    cold = run(cache, MODEL, A, MAX_NEW)
    assert cold[2].cached_tokens == 0 and same(cold, A)
    assert cold[2].outcomes == [("rec", 8, "kept"), ("rec", 16, "kept"), ("rec", 20, "kept")]
    assert cache.checkpoint_lengths(A + cold[1]) == [8, 16, 20]

    hit = run(cache, MODEL, B, MAX_NEW)                     # 4 blocks shared: the checkpoint at 16
    assert hit[2].cached_tokens == 16 and same(hit, B)
    table = hit[2].kv.tables["swa"]
    assert table[:3] == [None] * 3, "the window was released as the request advanced"

    short = run(cache, MODEL, C, MAX_NEW)                   # 1 block shared, fewer than k
    assert short[2].hit.full_hit_blocks == 1 and short[2].cached_tokens == 0 and same(short, C)

    turn = A + cold[1][:3] + base(5, 70)                    # the next turn: A's 21 tokens and more
    nxt = run(cache, MODEL, turn, MAX_NEW)
    assert nxt[2].cached_tokens == 20, "hits A's tail checkpoint"
    assert same(nxt, turn)


def test_first_window_block_only_what_the_rule_needs():
    """A hit at L = 16 reads window blocks [2, 4) only: with block 1's window component gone the
    hit stays at 16 and exact; with block 2's gone it falls to the checkpoint at 8, still exact."""
    cache = cache_with(A)
    cache.drop_component_for_testing(A, 2, "swa")           # n_2: block 1, outside the window
    out = run(cache, MODEL, B, MAX_NEW)
    assert out[2].cached_tokens == 16 and same(out, B)

    cache = cache_with(A)
    cache.drop_component_for_testing(A, 3, "swa")           # n_3: block 2, the window's oldest
    out = run(cache, MODEL, B, MAX_NEW)
    assert out[2].cached_tokens == 8 and out[2].hit.limited_by == "swa" and same(out, B)

    cache = cache_with(A)
    cache.drop_component_for_testing(A, 4, "rec")           # the checkpoint at 16
    out = run(cache, MODEL, B, MAX_NEW)
    assert out[2].cached_tokens == 8 and out[2].hit.limited_by == "rec" and same(out, B)


def test_wider_window_reads_a_block_the_hit_does_not_hold():
    wide = TinyHybrid(HybridConfig(window=10))              # needs ceil(9/4) = 3 blocks, the hit holds 2
    cache = cache_with(A)
    try:
        run(cache, wide, B, MAX_NEW)
    except BlockNotHeld:
        return
    raise AssertionError("a W = 10 model read past the W = 6 hit's window without error")


def test_negative_window_of_seven():
    """An engine whose window is 7 over a pool built for 6. The pool's release by W = 6 stops it
    when decode reads a released block; without the release, its logits differ from the first
    computed position on (the cached K/V and state were computed under W = 6)."""
    seven = TinyHybrid(HybridConfig(window=7))
    try:
        run(cache_with(A), seven, B, MAX_NEW)
        raise AssertionError("W = 7 read no block the W = 6 release had dropped")
    except BlockNotHeld:
        pass
    cache = cache_with(A)
    out = run(cache, seven, B, MAX_NEW, release=False)
    assert out[2].cached_tokens == 16
    assert first_row_differs(out, B, model=MODEL), "W = 7 over a W = 6 cache equals the W = 6 reference"
    assert first_row_differs(out, B, model=seven), "W = 7 over a W = 6 cache equals the W = 7 reference"


def test_negative_window_block_of_another_chain():
    cache = cache_with(A, E)
    out = run(cache, MODEL, B, MAX_NEW, request=cache.start_with_fault_for_testing(B, MAX_NEW, window_block_chain=E))
    assert out[2].cached_tokens == 16 and first_row_differs(out, B)


def test_negative_stale_checkpoint():
    cache = cache_with(A)
    stale = cache.start_with_fault_for_testing(B, MAX_NEW, checkpoint_blocks=16 // BT - K)  # the state at 8
    out = run(cache, MODEL, B, MAX_NEW, request=stale)
    assert out[2].cached_tokens == 16 and first_row_differs(out, B)


def test_negative_conv_state_zeroed():
    cache = cache_with(A)
    out = run(cache, MODEL, B, MAX_NEW, request=cache.start_with_fault_for_testing(B, MAX_NEW, zero_conv=True))
    assert out[2].cached_tokens == 16 and first_row_differs(out, B)


def test_negative_checkpoint_of_another_chain():
    cache = cache_with(A, E)
    assert 16 in cache.checkpoint_lengths(E)
    out = run(cache, MODEL, B, MAX_NEW, request=cache.start_with_fault_for_testing(B, MAX_NEW, checkpoint_chain=E))
    assert out[2].cached_tokens == 16 and first_row_differs(out, B)


def test_unfaulted_control_path_is_exact():
    """The fault hook with no fault serves exactly start()'s hit: the controls differ because of
    their fault, not because of the hook."""
    cache = cache_with(A, E)
    out = run(cache, MODEL, B, MAX_NEW, request=cache.start_with_fault_for_testing(B, MAX_NEW))
    assert out[2].cached_tokens == 16 and same(out, B)


def main():
    failed = 0
    for name, fn in [(n, f) for n, f in sorted(globals().items()) if n.startswith("test_")]:
        try:
            fn()
            print("ok   " + name)
        except Exception:  # noqa: BLE001 - report every test, then the count
            failed += 1
            print("FAIL " + name)
            traceback.print_exc()
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
