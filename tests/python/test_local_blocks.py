"""The in-process baseline (kvd.engine.local_blocks) under both duplicate rules, no daemon: two
requests sharing a 3-block prefix run at once and both publish. "continue" (vLLM's rule, kvd's
since kvd-reuse-2) keeps the second one's later blocks cached after the first one's shared blocks:
a later start of its prompt hits all of it. "stop" (the old rule) caches nothing after the
duplicate: the later start finds only the shared prefix. Outcomes are counted once per position,
the private copies are freed at the end, and a bad rule is refused by name.

Usage: test_local_blocks.py   (PYTHONPATH=<build>/python)"""
from types import SimpleNamespace as NS

from kvd.engine.local_blocks import LocalBlocks

BT = 4
SHARED = list(range(100, 112))                 # 3 blocks
A = SHARED + list(range(200, 212)) + [1]       # + 3 own blocks and a partial one
B = SHARED + list(range(300, 312)) + [2]


def req(rid):
    return NS(id=rid, blocks=[], num_tokens=0, cached_tokens=0, waiting=False, live=False)


def start(lb, r, prompt):
    res = lb._start(r, NS(admit=NS(prompt=prompt, max_new_tokens=4, namespace=NS(cache_salt=""))))
    assert not res.waiting
    return r.cached_tokens


def publish(lb, r, prompt):
    return lb._publish(r, NS(tokens=prompt, num_blocks=len(prompt) // BT)).kept


def run(chains):
    lb = LocalBlocks(block_tokens=BT, capacity_blocks=64, max_model_len=128, chains=chains)
    a, b = req("a"), req("b")
    assert start(lb, a, A) == 0 and start(lb, b, B) == 0    # both compute the shared prefix
    assert publish(lb, a, A) == 6
    kept_b = publish(lb, b, B)
    assert publish(lb, b, B) == 0                            # a repeat publish counts nothing again
    counts = (lb.duplicates, lb.no_parent)
    lb._end(a, None)
    lb._end(b, None)
    assert lb._reserved == 0 and all(x == 0 for x in lb._refs)
    cached = len(lb._key_of)
    hit = start(lb, req("b2"), B)
    return kept_b, counts, cached, hit


def main():
    kept, counts, cached, hit = run("continue")
    assert (kept, counts, cached, hit) == (3, (3, 0), 9, 24), (kept, counts, cached, hit)
    kept, counts, cached, hit = run("stop")
    assert (kept, counts, cached, hit) == (0, (1, 5), 6, 12), (kept, counts, cached, hit)
    try:
        LocalBlocks(chains="sometimes")
        raise AssertionError("a bad rule was accepted")
    except ValueError as e:
        assert "chains" in str(e)
    print("ok")


if __name__ == "__main__":
    main()
