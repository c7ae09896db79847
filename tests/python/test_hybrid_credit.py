"""Block credit per (pool, KV group) in the Python step client (docs/hybrid.md §2.4, docs/api.md
"Block credit") against a real kvd: a 24-step decode on a hybrid pool makes no round trip after its
first grow (the full and window groups' growth placed from their credit, the window's blocks below
computed - (W - 1) dropped as kvd's answer would), its tables equal step for step those of the same
decode with every grow a round trip (a client without credit), and kvd agrees with them when the
held grows go out (every block published; nothing owned afterwards but the credit). Hostile: a grow
naming another group's block, or window credit past the horizon, is refused INVALID_ARGUMENT
naming the group, and nothing changes (counts, the credit kvd lists, the request's tables). A step
kvd applied whose answer is lost: the credit is dropped until an answer lists it again.

Usage: test_hybrid_credit.py KVD_BINARY
"""
import sys

import grpc

from kvd import StepBatch, StepRequest
from kvd.client import Client
from kvd.errors import KvdError
from kvd.v1 import kvd_pb2
from kvd_testlib import HYBRID_GROUPS as GROUPS, check, serve_and_run

# kvd_testlib's HYBRID_POOL with room for credit: kvd grants a worker at most an eighth of a group
# (full: 32 blocks, swa: 16).
POOL = ("pools:\n  - name: hy\n    block_tokens: 4\n    num_layers: 4\n    bytes_per_token_per_layer: 16\n"
        "    max_model_len: 64\n    dtype: float32\n    kv_heads: 2\n    head_dim: 1\n"
        "    kv_arrangement: token_kv_head_dim\n    step_tokens: 8\n    groups:\n"
        "      - {name: full, kind: full, layers: [\"1-3/2\"], capacity_blocks: 256}\n"
        "      - {name: swa, kind: sliding_window, layers: [0], window: 6, capacity_blocks: 128}\n"
        "      - {name: rec, kind: state, layers: [2], bytes_per_state: 96, checkpoint_every_blocks: 2, "
        "capacity_slots: 16}\n")
FULL, SWA = 0, 1


def counts(c):
    p = next(p for p in c.report().pools if p.name == "hy")
    return p.owned_blocks, p.reserved_blocks


def shape(req):
    return [(t.first_block_position, len(t.blocks)) for t in req.group_tables]


def decode(c, rid, salt, steps=24):
    """A 12-token prompt, then `steps` decode grows of one token, each reporting the tokens
    computed so far; the tables' shapes after each step and the round trips after the first grow."""
    s = StepRequest(rid)
    res = c.step(StepBatch().start(s, pool="hy", prompt=list(range(1, 13)), max_new_tokens=40, cache_salt=salt))
    check(res[0].ok, f"{rid} starts ({res[0].message})")
    shapes, trips = [], 0
    for k in range(steps):
        before = c.rpc_calls
        res = c.step(StepBatch().grow(s, 1, computed_tokens=s.num_tokens))
        if not res[0].ok:
            check(False, f"{rid} grow {k} ({res[0].message})")
        if k > 0:
            trips += c.rpc_calls - before
        shapes.append(shape(s))
    return s, shapes, trips


def run(target):
    w = Client(target, expect=[{"pool": "hy", "groups": GROUPS}], worker_name="credit")
    plain = Client(target, expect=[{"pool": "hy", "groups": GROUPS}], worker_name="round-trips", step_credit_blocks=0)
    try:
        s, shapes, trips = decode(w, "on-credit", "a")
        r, expected, _ = decode(plain, "round-trip", "b")
        check(w.step_credit("hy", "full") > 0 and w.step_credit("hy", "swa") > 0 and w.step_credit("hy", "rec") == 0,
              f"credit per attention group ({w.step_credit('hy', 'full')}, {w.step_credit('hy', 'swa')})")
        check(trips == 0, f"24 decode steps on credit: no round trip after the first grow ({trips})")
        check(shapes == expected, f"the tables placed from credit equal the round-trip grows' step for step "
                                  f"({shapes[-1]} vs {expected[-1]})")
        check(s.num_tokens == r.num_tokens == 36 and s.blocks == s.group_table("full").blocks and len(s.blocks) == 9,
              f"36 tokens, the full table is blocks ({s.num_tokens}, {len(s.blocks)})")
        swa = w.pool("hy").group("swa")
        check(all(swa.first_block <= b < swa.first_block + swa.capacity for b in s.group_table("swa").blocks),
              "window blocks come from the window group's credit")

        # kvd's word on the tables: a grow reporting nothing goes to kvd with the held growth ahead
        # of it; its answer's first positions must be the client's (else the client raises INTERNAL).
        held = shape(s)
        res = w.step(StepBatch().grow(s, 0))
        check(res[0].ok and s.error is None and shape(s) == held,
              f"kvd applies the held grows as placed ({res[0].message}, {shape(s)})")

        hostile(w, s)
        res = w.step(StepBatch().end(s, publish_blocks=9, more_tokens=[100 + k for k in range(24)]))
        check(res[0].ok and res[0].kept == 9, f"End publishes all 9 full blocks of the table ({res[0].kept} kept)")
        plain.step(StepBatch().end(r))
        left = counts(w)
        check(left == (w.step_credit("hy"),) * 2, f"nothing owned or reserved but the credit ({left})")
        unknown_outcome(w)
    finally:
        plain.close()
        w.close()


def hostile(w, s):
    """Raw steps from the same worker: refused items change nothing."""
    p = w.pool("hy")
    w.step_flush()  # the growth held so far goes out first
    full_credit = list(w._stepper.credit[(p.id, FULL)])
    swa_credit = list(w._stepper.credit[(p.id, SWA)])
    before_counts, before_shape = counts(w), shape(s)
    check(not w._stepper.held and len(full_credit) > 0 and len(swa_credit) >= 3, "nothing held, credit in both groups")

    def raw(entries, tokens, computed):
        w._stepper.seq += 1
        step = kvd_pb2.StepRequest(worker_id=w.worker_id, seq=w._stepper.seq)
        step.items.add(request_id=s.id, grow=kvd_pb2.StepGrow(tokens=tokens, computed_tokens=computed, credit=[
            kvd_pb2.CreditEntry(group=g, block=b) for g, b in entries]))
        resp = w._stub.Step(step, timeout=10)
        return resp, resp.results[0], [r for r in resp.results[1:] if r.code != 0]

    # The next grow (4 tokens) crosses into a new full block: name a window block for it.
    n, c = s.num_tokens + 4, s.num_tokens
    resp, r, bad = raw([(FULL, swa_credit[0])], 4, c)
    check(not bad and r.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "full" in r.message,
          f"a full grow naming a window block is refused naming the group ({r.message})")
    listed = {(x.pool_id, x.group): sorted(x.blocks) for x in resp.credit}
    check(listed.get((p.id, FULL)) == sorted(full_credit) and listed.get((p.id, SWA)) == sorted(swa_credit),
          "the credit kvd lists is unchanged")
    # Window credit past computed + step_tokens: 3 window blocks for one more token.
    resp, r, bad = raw([(SWA, b) for b in swa_credit[:3]], 1, c)
    check(not bad and r.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "swa" in r.message,
          f"window credit past the horizon is refused naming the group ({r.message})")
    check(counts(w) == before_counts and shape(s) == before_shape and n > c,
          f"nothing changes ({counts(w)} vs {before_counts})")
    listed = {(x.pool_id, x.group): sorted(x.blocks) for x in resp.credit}
    check(listed.get((p.id, SWA)) == sorted(swa_credit), "the window credit kvd lists is unchanged")
    w._stepper.credit = {k: list(v) for k, v in {(p.id, FULL): full_credit, (p.id, SWA): swa_credit}.items()}


def unknown_outcome(w):
    """A step kvd applied but whose answer was lost: the requests with growth in it are unusable
    (End only), the credit is dropped and nothing is placed from it until an answer lists it
    again, which then equals what kvd holds for the worker."""
    s = StepRequest("lost-answer")
    w.step(StepBatch().start(s, pool="hy", prompt=list(range(200, 212)), max_new_tokens=20, cache_salt="c"))
    w.step(StepBatch().grow(s, 1, computed_tokens=12))  # kvd's word: from here on credit
    before = w.rpc_calls
    w.step(StepBatch().grow(s, 4, computed_tokens=13))
    check(w.rpc_calls == before and w._stepper.held, "a grow placed from credit, held")
    real = w._rpc

    def lost(method, req, timeout=30):
        real(method, req, timeout)  # kvd applies it; the answer never arrives
        raise KvdError(grpc.StatusCode.DEADLINE_EXCEEDED, "the answer was lost")

    w._rpc = lost
    w.step_lane = False  # the answer is lost on gRPC here (test_step_lane.py loses one on the lane)
    try:
        w.step(StepBatch().grow(s, 0))
        check(False, "a step whose answer is lost fails as a whole")
    except KvdError as e:
        check(e.code == grpc.StatusCode.DEADLINE_EXCEEDED, f"a step whose answer is lost fails as a whole ({e.code})")
    finally:
        del w._rpc
        w.step_lane = True
    check(w.step_credit("hy") == 0 and s.error is not None, "the credit is dropped; the request is End-only")
    res = w.step(StepBatch().grow(s, 1, computed_tokens=17))
    check(not res[0].ok and not w._stepper.held, f"its grows are refused with that error ({res[0].code})")
    res = w.step(StepBatch().end(s))
    check(res[0].ok and w.step_credit("hy") > 0, f"End goes out; the answer lists the credit again ({res[0].message})")
    check(counts(w) == (w.step_credit("hy"),) * 2, f"the credit listed is what kvd holds for the worker ({counts(w)})")


def main():
    return serve_and_run(sys.argv[1], POOL, run)


if __name__ == "__main__":
    sys.exit(main())
