"""A hybrid pool (docs/hybrid.md, build step 1) through the Python client against a real kvd: the
pool's groups as ListPools gives them, the attach expectation with groups (accepted, refused naming
the field), Pool.group_index, each group's layer written at a group-local index and found at the
slab offset of docs/hybrid.md §2.2 through a second client's own mapping, and, with torch,
kv_tensor(pool, group=...) shapes and offsets.

Usage: test_hybrid_pool.py KVD_BINARY
"""
import sys
import tempfile

import grpc

from kvd.client import Client
from kvd.errors import KvdError
from kvd_testlib import Daemon, check, finish

# Four layers: full attention in 1 and 3, a 6-token window in 0, recurrent state in 2.
HYBRID_POOL = ("pools:\n  - name: hy\n    block_tokens: 4\n    num_layers: 4\n    bytes_per_token_per_layer: 16\n"
               "    max_model_len: 64\n    dtype: float32\n    kv_heads: 2\n    head_dim: 1\n"
               "    kv_arrangement: token_kv_head_dim\n    groups:\n"
               "      - {name: full, kind: full, layers: [\"1-3/2\"], capacity_blocks: 40}\n"
               "      - {name: swa, kind: sliding_window, layers: [0], window: 6, capacity_blocks: 24}\n"
               "      - {name: rec, kind: state, layers: [2], bytes_per_state: 96, checkpoint_every_blocks: 2, "
               "capacity_slots: 6}\n")

GROUPS = [{"name": "full", "kind": "full", "layers": [1, 3]},
          {"name": "swa", "kind": "sliding_window", "window": 6},
          {"name": "rec", "kind": "state", "checkpoint_every_blocks": 2, "bytes_per_state": 96}]


def main():
    kvd = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        d = Daemon(kvd, tmp, HYBRID_POOL)
        check(d.started, "kvd serves a hybrid pool")
        if not d.started:
            return finish()
        try:
            run(d.target)
        finally:
            d.stop()
    return finish()


def refused(target, expect):
    try:
        Client(target, expect=expect).close()
    except KvdError as e:
        return e.code, e.details
    return None, ""


def run(target):
    w = Client(target, expect=[{"pool": "hy", "groups": GROUPS}])
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


if __name__ == "__main__":
    sys.exit(main())
