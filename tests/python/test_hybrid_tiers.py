"""A hybrid pool with host and disk tiers through the Python client against a real kvd
(docs/hybrid.md §2.9, build step 6): a prompt published with the state checkpoint at 8 tokens,
written into every group through the client's own mapping, is hit at 8 after a SIGTERM (the drain
flushes) and a restart on the same disk, each group's blocks and the checkpoint byte-identical;
a restart under another grouping (another window) serves none of it.

Usage: test_hybrid_tiers.py KVD_BINARY
"""
import os
import sys
import tempfile

from kvd.client import Client
from kvd_testlib import Daemon, check, finish

POOL = ("pools:\n  - name: hy\n    block_tokens: 4\n    num_layers: 4\n    bytes_per_token_per_layer: 16\n"
        "    max_model_len: 64\n    step_tokens: 8\n    groups:\n"
        "      - {name: full, kind: full, layers: [\"1-3/2\"], capacity_blocks: 40}\n"
        "      - {name: swa, kind: sliding_window, layers: [0], window: WINDOW, capacity_blocks: 24}\n"
        "      - {name: rec, kind: state, layers: [2], bytes_per_state: 96, checkpoint_every_blocks: 2, "
        "capacity_slots: 6}\n"
        "tiers:\n  host_bytes: 65536\n  disk_dir: DISK\n")


def unit_bytes(c, pool, group, index):
    g = pool.group(group)
    return b"".join(bytes(c.layer_view("hy", index, layer)) for layer in g.layers)


def fill(c, pool, group, index, seed):
    g = pool.group(group)
    for j, layer in enumerate(g.layers):
        view = c.layer_view("hy", index, layer)
        view[:] = bytes((seed * 31 + j * 7 + i) % 251 for i in range(len(view)))


def main():
    kvd = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        disk = os.path.join(tmp, "disk")
        os.makedirs(disk)
        config = POOL.replace("DISK", disk)
        d = Daemon(kvd, tmp, config.replace("WINDOW", "6"))
        check(d.started, "kvd serves a hybrid pool with host and disk tiers")
        if not d.started:
            return finish()
        try:
            w = Client(d.target)
            pool = w.pool("hy")
            a = w.request("writer", pool="hy", prompt=list(range(300, 317)))
            full, swa = a.group_table("full").blocks, a.group_table("swa").blocks
            spare = a.group_table("rec").blocks[1]
            written = {}
            for i in range(2):
                fill(w, pool, "full", full[i], 10 + i)
                fill(w, pool, "swa", swa[i], 20 + i)
                written[("full", i)] = unit_bytes(w, pool, "full", full[i])
                written[("swa", i)] = unit_bytes(w, pool, "swa", swa[i])
            fill(w, pool, "rec", spare, 30)
            written["rec"] = unit_bytes(w, pool, "rec", spare)
            a.publish(list(range(300, 308)), state_checkpoints=[(2, 8, spare)])
            a.release()
            w.close()
        finally:
            d.stop()  # SIGTERM: the drain flushes to disk
        d = Daemon(kvd, tmp, config.replace("WINDOW", "6"), name="again")
        try:
            w = Client(d.target)
            pool = w.pool("hy")
            b = w.request("reader", pool="hy", prompt=list(range(300, 308)) + list(range(900, 909)))
            check(b.cached_tokens == 8, f"after a restart the hit is at the checkpoint ({b.cached_tokens})")
            if b.cached_tokens == 8:
                ft, st, rt = b.group_table("full"), b.group_table("swa"), b.group_table("rec")
                same = all(unit_bytes(w, pool, "full", ft.blocks[i]) == written[("full", i)] and
                           unit_bytes(w, pool, "swa", st.blocks[i - st.first_block_position]) == written[("swa", i)]
                           for i in range(2))
                check(same, "every full and window block of the hit is byte-identical")
                check(rt.checkpoint_slot is not None and
                      unit_bytes(w, pool, "rec", rt.checkpoint_slot) == written["rec"],
                      "the checkpoint slot holds the state published before the restart")
            b.release()
            w.close()
        finally:
            d.stop()
        d = Daemon(kvd, tmp, config.replace("WINDOW", "5"), name="regrouped")
        try:
            w = Client(d.target)
            c = w.request("other", pool="hy", prompt=list(range(300, 308)) + list(range(900, 909)))
            check(c.cached_tokens == 0, f"another grouping (window 5) serves none of it ({c.cached_tokens})")
            c.release()
            w.close()
        finally:
            d.stop()
    return finish()


if __name__ == "__main__":
    sys.exit(main())
