"""A hybrid pool (docs/hybrid.md, build step 1) through the Python client against a real kvd: the
pool's groups as ListPools gives them, the attach expectation with groups (accepted, refused naming
the field), Pool.group_index, each group's layer written at a group-local index and found at the
slab offset of docs/hybrid.md §2.2 through a second client's own mapping, and, with torch,
kv_tensor(pool, group=...) shapes and offsets; a request's per-group tables (Request.group_tables,
group_table(name)) through grows that report computed_tokens, window blocks below computed - (W - 1)
dropped from the client's table and freed or left cached as the daemon's Report counts them, bad
reports refused changing nothing, and the same through StepBatch.

Usage: test_hybrid_pool.py KVD_BINARY
"""
import sys

import grpc

from kvd import StepBatch, StepRequest
from kvd.client import Client
from kvd.errors import KvdError
from kvd_testlib import HYBRID_GROUPS as GROUPS, HYBRID_POOL, check, serve_and_run


def main():
    return serve_and_run(sys.argv[1], HYBRID_POOL, run)


def refused(target, expect):
    try:
        Client(target, expect=expect).close()
    except KvdError as e:
        return e.code, e.details
    return None, ""


def run(target):
    # No block credit: the counts below are the requests' own (test_hybrid_credit.py has credit).
    w = Client(target, expect=[{"pool": "hy", "groups": GROUPS}], step_credit_blocks=0)
    r = Client(target)
    try:
        p = w.pool("hy")
        check([g.name for g in p.groups] == ["full", "swa", "rec"], "ListPools lists the groups in order")
        check([g.first_block for g in p.groups] == [0, 40, 64] and p.capacity_blocks == 70,
              "first_block concatenates the groups' ranges; capacity_blocks is the sum")
        check([g.region_offset_bytes for g in p.groups] == [0, 2 << 20, 4 << 20], "regions start on 2 MiB")
        check([g.layer_unit_bytes for g in p.groups] == [64, 64, 96], "unit bytes: a block of a layer, or a state")
        check(p.group_index("swa", 45) == 5, "group_index: pool-wide 45 is swa's 5")
        try:
            p.group_index("swa", 3)
            check(False, "group_index refuses an index of another group")
        except IndexError:
            check(True, "group_index refuses an index of another group")

        code, details = refused(target, [{"pool": "hy"}])
        check(code == grpc.StatusCode.FAILED_PRECONDITION and "this worker declares none" in details,
              f"a worker declaring no groups is refused ({details})")
        other = [dict(g) for g in GROUPS]
        other[1]["window"] = 7
        code, details = refused(target, [{"pool": "hy", "groups": other}])
        check(code == grpc.StatusCode.FAILED_PRECONDITION and
              details == "pool 'hy' group 1 (swa) holds window 6, the worker expects 7",
              f"a worker declaring another window is refused naming group and field ({details})")

        # Each group's layer at a group-local index, written by one client, read at the §2.2 offset
        # through the other's mapping.
        raw = r.pool("hy").maps[0]
        for name, local, j in (("full", 0, 0), ("full", 39, 1), ("swa", 7, 0), ("rec", 5, 0)):
            g = p.group(name)
            index = g.first_block + local
            view = w.layer_view("hy", index, g.layers[j])
            data = bytes((local * 7 + j * 3 + i) % 251 for i in range(g.layer_unit_bytes))
            view[:] = data
            at = g.region_offset_bytes + (j * g.capacity + local) * g.layer_unit_bytes
            check(bytes(raw[at:at + len(data)]) == data,
                  f"{name} unit {local} layer {j}: written at pool-wide {index}, read at offset {at}")

        tables(w, r)

        try:
            import torch  # noqa: F401
        except ImportError:
            print("skip kv_tensor(pool, group=...): torch is not installed")
            return
        full = w.kv_tensor("hy", group="full")
        check(tuple(full.shape) == (2, 40, 4, 2, 2, 1), f"full: [2 layers][40 blocks][4 tokens][2][2][1] ({tuple(full.shape)})")
        swa = w.kv_tensor("hy", group="swa")
        check(tuple(swa.shape) == (1, 24, 4, 2, 2, 1), f"swa: [1 layer][24 blocks][...] ({tuple(swa.shape)})")
        rec = w.kv_tensor("hy", group="rec", dtype=torch.float32)
        check(tuple(rec.shape) == (1, 6, 24), f"rec: [1 layer][6 slots][24 float32] ({tuple(rec.shape)})")
        swa[0, 3].fill_(2.5)
        rec[0, 4].fill_(-1.0)
        full[1, 9].fill_(7.0)
        for name, local, j, value in (("swa", 3, 0, 2.5), ("rec", 4, 0, -1.0), ("full", 9, 1, 7.0)):
            g = p.group(name)
            at = g.region_offset_bytes + (j * g.capacity + local) * g.layer_unit_bytes
            got = torch.frombuffer(bytearray(raw[at:at + g.layer_unit_bytes]), dtype=torch.float32)
            check(bool((got == value).all()), f"kv_tensor(group={name})[{j}, {local}] lands at offset {at}")
        try:
            w.kv_tensor("hy")
            check(False, "kv_tensor of a hybrid pool without group= is refused")
        except ValueError as e:
            check("pass group=" in str(e), f"kv_tensor of a hybrid pool without group= is refused ({e})")
    finally:
        w.close()
        r.close()


def counts(c):
    p = next(p for p in c.report().pools if p.name == "hy")
    return p.free_blocks, p.owned_blocks, p.cached_blocks, p.evictable_blocks, p.reserved_blocks


def tables(w, observer):
    """step_tokens 8: the window group holds [floor(max(0, c - 5) / 4), ceil(min(n, c + 8) / 4))."""
    p = w.pool("hy")
    req = w.request("py-hybrid", pool="hy", prompt=list(range(1, 13)), max_new_tokens=20)
    full, swa, rec = req.group_table("full"), req.group_table("swa"), req.group_table("rec")
    check([t.name for t in req.group_tables] == ["full", "swa", "rec"] and req.group_table("nope") is None,
          "a request on a hybrid pool holds a table per group")
    check(full.blocks == req.blocks and len(full.blocks) == 3, "the full table is blocks, [0, 3)")
    check(swa.first_block_position == 0 and len(swa.blocks) == 2 and len(rec.blocks) == 2,
          f"window [0, 2), 2 state slots ({swa}, {rec})")
    written = {}
    for t in req.group_tables:
        g = p.group(t.name)
        for b in t.blocks:
            local = p.group_index(t.name, b)  # raises for another group's index
            data = bytes((local * 5 + ord(t.name[0]) + i) % 251 for i in range(g.layer_unit_bytes))
            w.layer_view("hy", b, g.layers[0])[:] = data
            written[b] = data
    req.publish(list(range(1, 5)))  # block 0: the full block and the window block at 0 become cached
    before = counts(observer)
    swa0, swa1 = swa.blocks
    req.extend(4, computed_tokens=12)  # window [7/4, 4) = [1, 4)
    swa = req.group_table("swa")
    after = counts(observer)
    check(swa.first_block_position == 1 and swa.blocks[0] == swa1 and len(swa.blocks) == 3,
          f"grow with computed 12: window block 0 dropped, 2 and 3 appended ({swa})")
    check(len(req.group_table("full").blocks) == 4 and req.group_table("full").blocks == req.blocks,
          "the full table covers every position")
    # No state checkpoint reads the published window block 0: in a pool with a state group it is
    # freed when it leaves the table (docs/hybrid.md §2.8, U4).
    check(after[1] == before[1] + 3 and after[0] == before[0] - 3 + 1 and after[2] == before[2] - 1 and
          after[3] == before[3], f"the published window block no checkpoint reads is freed, 3 handed out ({before} -> {after})")
    window = list(swa.blocks)
    req.extend(4, computed_tokens=16)  # window [11/4, 5) = [2, 5)
    swa = req.group_table("swa")
    step2 = counts(observer)
    check(swa.first_block_position == 2 and swa.blocks[:2] == window[1:] and len(swa.blocks) == 3,
          f"grow with computed 16: window block 1 dropped ({swa})")
    check(step2[1] == after[1] + 1 and step2[0] == after[0] - 1 and step2[2] == after[2],
          f"the unpublished window block is freed ({after} -> {step2})")
    for t in req.group_tables:
        g = p.group(t.name)
        for b in t.blocks:
            if b in written:
                check(bytes(w.layer_view("hy", b, g.layers[0])) == written[b], f"{t.name} block {b} kept its bytes")

    snapshot = [(t.first_block_position, list(t.blocks)) for t in req.group_tables]
    for n, computed, what in ((4, 8, "last report (16)"), (1, 30, "its tokens (21)")):
        try:
            req.extend(n, computed_tokens=computed)
            check(False, f"computed_tokens {computed} is refused")
        except KvdError as e:
            check(e.code == grpc.StatusCode.INVALID_ARGUMENT and f"computed_tokens {computed}" in e.details
                  and what in e.details, f"computed_tokens {computed} is refused naming it ({e.details})")
    check(req.num_tokens == 20 and counts(observer) == step2 and
          [(t.first_block_position, t.blocks) for t in req.group_tables] == snapshot,
          "a refused report changes nothing")

    req.extend(4)  # computed unchanged (16): the window reaches ceil(24 / 4)
    req.extend(0, computed_tokens=24)  # window [19/4, 6) = [4, 6)
    check(req.group_table("swa").first_block_position == 4 and len(req.group_table("swa").blocks) == 2 and
          len(req.group_table("full").blocks) == 6, f"computed 24: window [4, 6) ({req.group_table('swa')})")
    end = req.end(publish_blocks=6, more_tokens=list(range(13, 25)))
    done = counts(observer)
    check(end.kept + end.already_cached == 6, f"End publishes the full table ({end.kept} kept)")
    check(done[1] == 0 and done[4] == 0 and done[0] + done[2] == 70 and done[3] == done[2],
          f"nothing stays owned or reserved after End ({done})")

    s = StepRequest("py-stepped")
    res = w.step(StepBatch().start(s, pool="hy", prompt=list(range(100, 108)), max_new_tokens=16))
    check(res[0].ok and len(s.group_tables) == 3 and len(s.group_table("swa").blocks) == 2,
          f"a StepRequest holds a table per group ({res[0].message})")
    first = s.group_table("swa").blocks[0]
    for _ in range(3):
        res = w.step(StepBatch().grow(s, 4, computed_tokens=s.num_tokens))
        check(res[0].ok, f"a step grow reports computed tokens ({res[0].message})")
    swa = s.group_table("swa")
    check(s.num_tokens == 20 and swa.first_block_position == 2 and len(swa.blocks) == 3 and first not in swa.blocks[:1]
          and s.group_table("full").blocks == s.blocks and len(s.blocks) == 5,
          f"after computed 16, n 20: window [2, 5), full [0, 5) ({swa})")
    res = w.step(StepBatch().grow(s, 1, computed_tokens=4))
    check(res[0].code == grpc.StatusCode.INVALID_ARGUMENT and s.num_tokens == 20 and
          s.group_table("swa").first_block_position == 2, f"a step grow going back is refused ({res[0].message})")
    res = w.step(StepBatch().end(s))
    check(res[0].ok and counts(observer)[1] == 0 and counts(observer)[4] == 0, "the stepped request ends, nothing owned")

    # A hit at a state checkpoint (docs/hybrid.md §2.6, §2.7): the state at 8 tokens published
    # with the blocks; another request sharing 2 blocks starts there and reads the slot's bytes.
    a = w.request("py-ckpt-a", pool="hy", prompt=list(range(300, 317)))
    rec = p.group("rec")
    spare = a.group_table("rec").blocks[1]
    state = bytes((i * 7 + 3) % 251 for i in range(rec.layer_unit_bytes))
    w.layer_view("hy", spare, rec.layers[0])[:] = state
    resp = a.publish(list(range(300, 308)), state_checkpoints=[(2, 8, spare)])
    import kvd.v1.kvd_pb2 as pb
    check(list(resp.checkpoint_outcomes) == [pb.CHECKPOINT_KEPT] and spare not in a.group_table("rec").blocks,
          f"the checkpoint is kept and a fresh spare takes its slot ({resp.checkpoint_outcomes})")
    b = w.request("py-ckpt-b", pool="hy", prompt=list(range(300, 308)) + list(range(900, 909)))
    rb = b.group_table("rec")
    check(b.cached_tokens == 8 and rb.checkpoint_slot == spare and b.full_hit_tokens == 8,
          f"the hit ends at the checkpoint ({b.cached_tokens}, {rb})")
    check(bytes(w.layer_view("hy", rb.checkpoint_slot, rec.layers[0])) == state, "the checkpoint slot holds the state")
    c = w.request("py-ckpt-c", pool="hy", prompt=list(range(300, 304)) + list(range(950, 959)))
    check(c.cached_tokens == 0 and c.group_table("rec").checkpoint_slot is None,
          f"one block shared (fewer than k = 2): no hit ({c.cached_tokens})")
    for x in (c, b):
        x.release()
    a.extend(0, computed_tokens=8)
    named = a.group_table("rec").blocks[1]
    resp = a.checkpoint(list(range(300, 308)), b"s", state_checkpoints=[(2, 8, named)])
    check(len(resp.fresh_slots) == 1 and a.group_table("rec").blocks[1] == resp.fresh_slots[0] and
          named not in a.group_table("rec").blocks,
          f"Request.checkpoint with the state: the record keeps the slot, a fresh spare takes its place ({resp.fresh_slots})")
    a.end()
    stepped_checkpoints(w, observer)


def stepped_checkpoints(w, observer):
    """StepBatch publish and end items with state checkpoints: a kept slot is swapped for its fresh
    spare, a slot that is not the request's is refused naming it with the table unchanged, another
    stepped start hits at the checkpoint, and End's tail checkpoint (3 blocks, off the k = 2 grid)
    is hit by the next turn."""
    import kvd.v1.kvd_pb2 as pb
    p = w.pool("hy")
    rec = p.group("rec")
    prompt = list(range(400, 413))
    s = StepRequest("py-step-ckpt")
    res = w.step(StepBatch().start(s, pool="hy", prompt=prompt, max_new_tokens=4))
    check(res[0].ok and s.cached_tokens == 0, f"a stepped start on a hybrid pool ({res[0].message})")
    running, spare = s.group_table("rec").blocks
    state8 = bytes((i * 11 + 5) % 251 for i in range(rec.layer_unit_bytes))
    w.layer_view("hy", spare, rec.layers[0])[:] = state8
    before = [list(t.blocks) for t in s.group_tables]
    res = w.step(StepBatch().publish(s, prompt[:8], 2, state_checkpoints=[(2, 8, running + 1000)]))
    check(res[0].code == grpc.StatusCode.INVALID_ARGUMENT and "slot" in res[0].message and
          [list(t.blocks) for t in s.group_tables] == before,
          f"a checkpoint naming a slot the request does not hold is refused, tables unchanged ({res[0].message})")
    res = w.step(StepBatch().publish(s, prompt[:8], 2, state_checkpoints=[(2, 8, spare)]))
    rt = s.group_table("rec").blocks
    check(res[0].ok and res[0].checkpoint_outcomes == [pb.CHECKPOINT_KEPT] and len(res[0].fresh_slots) == 1 and
          rt == [running, res[0].fresh_slots[0]] and spare not in rt,
          f"a stepped publish keeps the checkpoint and the fresh spare takes its slot ({res[0].checkpoint_outcomes}, {rt})")
    res = w.step(StepBatch().publish(s, prompt[:8], 2, state_checkpoints=[(2, 8, rt[1])]))
    check(res[0].ok and res[0].checkpoint_outcomes == [pb.CHECKPOINT_ALREADY_CACHED] and
          s.group_table("rec").blocks == rt, f"offered again: already_cached, the slot stays the request's ({res[0].checkpoint_outcomes})")
    h = StepRequest("py-step-hit")
    res = w.step(StepBatch().start(h, pool="hy", prompt=prompt[:8] + [1, 2, 3]))
    check(res[0].ok and h.cached_tokens == 8 and h.group_table("rec").checkpoint_slot == spare and
          bytes(w.layer_view("hy", spare, rec.layers[0])) == state8,
          f"a stepped start hits at the stepped checkpoint ({h.cached_tokens}, {h.group_table('rec')})")
    w.step(StepBatch().end(h))

    # End with the tail: the state at 12 (the last full block of 13 tokens), off the k = 2 grid;
    # its window, blocks [1, 3), held after a grow reporting 12 computed.
    res = w.step(StepBatch().grow(s, 0, computed_tokens=12))
    check(res[0].ok and s.group_table("swa").first_block_position == 1, f"computed 12: window from block 1 ({res[0].message})")
    # A live generation checkpoint at 12 with the state: a position that is not the checkpoint's is
    # refused naming the field, nothing changed; the spare named is kept by the record and a fresh
    # spare takes its place in the table.
    live = s.group_table("rec").blocks[1]
    before = [list(t.blocks) for t in s.group_tables]
    res = w.step(StepBatch().checkpoint(s, prompt[:12], b"x", state_checkpoints=[(2, 8, live)]))
    check(res[0].code == grpc.StatusCode.INVALID_ARGUMENT and "position_tokens" in res[0].message and
          [list(t.blocks) for t in s.group_tables] == before,
          f"a checkpoint whose state is not at its position is refused naming it, tables unchanged ({res[0].message})")
    res = w.step(StepBatch().checkpoint(s, prompt[:12], b"x", state_checkpoints=[(2, 12, live)]))
    rt = s.group_table("rec").blocks
    check(res[0].ok and len(res[0].fresh_slots) == 1 and res[0].fresh_slots[0] >= 0 and rt[1] == res[0].fresh_slots[0]
          and live not in rt, f"a stepped checkpoint keeps the slot; its fresh spare takes its place ({res[0].message}, {rt})")
    tail_slot = s.group_table("rec").blocks[1]
    state12 = bytes((i * 13 + 1) % 251 for i in range(rec.layer_unit_bytes))
    w.layer_view("hy", tail_slot, rec.layers[0])[:] = state12
    res = w.step(StepBatch().end(s, publish_blocks=3, state_checkpoints=[(2, 12, tail_slot)]))
    check(res[0].ok and res[0].checkpoint_outcomes == [pb.CHECKPOINT_KEPT],
          f"End keeps the tail checkpoint at 12 ({res[0].message} {res[0].checkpoint_outcomes})")
    t = StepRequest("py-step-turn")
    res = w.step(StepBatch().start(t, pool="hy", prompt=prompt + [7, 7, 7]))
    check(res[0].ok and t.cached_tokens == 12 and t.group_table("rec").checkpoint_slot == tail_slot and
          bytes(w.layer_view("hy", tail_slot, rec.layers[0])) == state12,
          f"the next turn hits at the tail checkpoint ({t.cached_tokens}, {t.group_table('rec')})")
    w.step(StepBatch().end(t))
    check(counts(observer)[1] == 0 and counts(observer)[4] == 0, "nothing stays owned or reserved")


if __name__ == "__main__":
    sys.exit(main())
