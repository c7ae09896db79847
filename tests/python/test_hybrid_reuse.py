"""Hybrid chains continue past duplicates (docs/hybrid.md §2.7) against a real kvd, through StepBatch:
request a caches a chain whose first two nodes hold no window block and no checkpoint; b shares
a's first 8 tokens, hits nothing (the state group cuts the hit), recomputes them and publishes its
checkpoints at 8 and 16 — kept, onto a's nodes (the old rule answered no_chain and the pool never
learnt) — then its worker's process goes away without End (the stream closed: its own copies of
the duplicates must be freed, nothing owned or reserved after). Later requests hit at both
checkpoints with the state bytes b wrote.

Usage: test_hybrid_reuse.py KVD_BINARY
"""
import sys
import time

from kvd import StepBatch, StepRequest
from kvd.client import Client
from kvd_testlib import HYBRID_GROUPS as GROUPS, HYBRID_POOL, check, serve_and_run


def main():
    return serve_and_run(sys.argv[1], HYBRID_POOL, run)


def counts(c):
    p = next(p for p in c.report().pools if p.name == "hy")
    return p.owned_blocks, p.reserved_blocks


def state(seed, n):
    return bytes((i * seed + 3) % 251 for i in range(n))


def run(target):
    import kvd.v1.kvd_pb2 as pb
    observer = Client(target)
    w = Client(target, expect=[{"pool": "hy", "groups": GROUPS}])
    rec = w.pool("hy").group("rec")
    n = rec.layer_unit_bytes
    try:
        # a: 16 tokens computed before it publishes, so its window left blocks 0 and 1 unpublished;
        # End keeps 4 blocks and the checkpoint at 16 only.
        pa = list(range(500, 517))
        a = StepRequest("reuse-a")
        res = w.step(StepBatch().start(a, pool="hy", prompt=pa))
        check(res[0].ok, f"a starts ({res[0].message})")
        w.step(StepBatch().grow(a, 0, computed_tokens=8))
        w.step(StepBatch().grow(a, 0, computed_tokens=16))
        spare = a.group_table("rec").blocks[1]
        w.layer_view("hy", spare, rec.layers[0])[:] = state(7, n)
        res = w.step(StepBatch().end(a, publish_blocks=4, state_checkpoints=[(2, 16, spare)]))
        check(res[0].ok and res[0].checkpoint_outcomes == [pb.CHECKPOINT_KEPT], f"a keeps its checkpoint at 16 ({res[0].message})")

        # b, on its own worker: shares a's first 8 tokens, hits nothing, recomputes them.
        wb = Client(target, expect=[{"pool": "hy", "groups": GROUPS}])
        pb_prompt = pa[:8] + list(range(900, 909))
        b = StepRequest("reuse-b")
        res = wb.step(StepBatch().start(b, pool="hy", prompt=pb_prompt))
        check(res[0].ok and b.cached_tokens == 0, f"b hits nothing: no checkpoint at 8 ({b.cached_tokens})")
        wb.step(StepBatch().grow(b, 0, computed_tokens=8))
        s8 = b.group_table("rec").blocks[1]
        wb.layer_view("hy", s8, rec.layers[0])[:] = state(11, n)
        res = wb.step(StepBatch().publish(b, pb_prompt[:8], 2, state_checkpoints=[(2, 8, s8)]))
        check(res[0].ok and res[0].checkpoint_outcomes == [pb.CHECKPOINT_KEPT],
              f"b's checkpoint at 8, over a's cached blocks, is kept (was no_chain) ({res[0].message} "
              f"{res[0].checkpoint_outcomes})")
        wb.step(StepBatch().grow(b, 0, computed_tokens=16))
        s16 = b.group_table("rec").blocks[1]
        wb.layer_view("hy", s16, rec.layers[0])[:] = state(13, n)
        res = wb.step(StepBatch().publish(b, pb_prompt[:16], 4, state_checkpoints=[(2, 16, s16)]))
        check(res[0].ok and res[0].checkpoint_outcomes == [pb.CHECKPOINT_KEPT],
              f"b's checkpoint at 16 is kept on the continued chain ({res[0].message} {res[0].checkpoint_outcomes})")
        owned, _ = counts(observer)
        check(owned > 0, "b holds its blocks, its own copies of the duplicates among them")
        # b's process goes away without End: its copies and blocks are let go, the chain stays.
        wb.close()
        deadline = time.time() + 5
        credit = (w.step_credit("hy"),) * 2  # w's block credit is owned and reserved, nothing else
        while time.time() < deadline and counts(observer) != credit:
            time.sleep(0.05)
        check(counts(observer) == credit, f"nothing owned or reserved once b's worker is gone {counts(observer)}")

        # Hits at both of b's checkpoints, on a's blocks at 0 and 1.
        c = StepRequest("reuse-c")
        res = w.step(StepBatch().start(c, pool="hy", prompt=pb_prompt[:16] + [1]))
        check(res[0].ok and c.cached_tokens == 16 and c.group_table("rec").checkpoint_slot == s16 and
              bytes(w.layer_view("hy", s16, rec.layers[0])) == state(13, n),
              f"a later request hits at b's checkpoint at 16 ({c.cached_tokens}, {c.group_table('rec')})")
        d = StepRequest("reuse-d")
        res = w.step(StepBatch().start(d, pool="hy", prompt=pa[:8] + [2]))
        check(res[0].ok and d.cached_tokens == 8 and d.group_table("rec").checkpoint_slot == s8 and
              bytes(w.layer_view("hy", s8, rec.layers[0])) == state(11, n),
              f"and at 8, where a's node lacked a checkpoint and window ({d.cached_tokens})")
        check(list(c.group_table("full").blocks[:2]) == list(d.group_table("full").blocks[:2]),
              "both read the same cached blocks at 0 and 1")
        w.step(StepBatch().end(c).end(d))
        check(counts(observer) == (w.step_credit("hy"),) * 2, "nothing owned or reserved at the end but w's credit")
    finally:
        w.close()
        observer.close()


if __name__ == "__main__":
    sys.exit(main())
