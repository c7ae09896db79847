#!/usr/bin/env python3
"""Router-compatible KV events from a real kvd, decoded by a Python subscriber (pyzmq + msgpack).

Checks: the three-frame format (topic, 8-byte big-endian sequence, msgpack [ts, [events], rank]);
every BlockStored id equals vLLM's sha256_cbor block hash computed here independently with hashlib
and cbor2 (plain, LoRA adapter, cache salt); removals name stored blocks; the live set a router
rebuilds matches the daemon's cached blocks; lost batches are recovered through the ROUTER replay
socket byte for byte; a late subscriber rebuilds everything by replay; Close announces
AllBlocksCleared; a warm restart announces the reloaded blocks (medium DISK) with the same ids.

Usage: test_router_events.py KVD_BINARY   (PYTHONPATH=<build>/python)
"""
import hashlib
import os
import shutil
import sys
import tempfile
import time

import cbor2
import msgpack
import zmq

from kvd import Client
from kvd.v1 import kvd_pb2
from kvd_testlib import Daemon, check, finish

SEED = "1234"
BT = 4


def sha256_cbor(obj):
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def vllm_ids(tokens, extra_for_block=lambda i: None):
    """vLLM's hash_block_tokens chain with sha256_cbor; ids are the low 64 bits (last 8 bytes)."""
    parent = sha256_cbor(SEED)
    ids = []
    for i in range(len(tokens) // BT):
        h = sha256_cbor((parent, tuple(tokens[i * BT:(i + 1) * BT]), extra_for_block(i)))
        ids.append(int.from_bytes(h[-8:], "big"))
        parent = h
    return ids


class Subscriber:
    def __init__(self, ctx, endpoint):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.batches = {}  # seq -> (topic, payload bytes)

    def drain(self, idle_s=0.5):
        deadline = time.monotonic() + idle_s
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                topic, seq, payload = self.sock.recv_multipart()
                self.batches[int.from_bytes(seq, "big")] = (topic, payload)
                deadline = time.monotonic() + idle_s


def replay(ctx, endpoint, start):
    """Asks the replay socket for every batch from `start`; returns {seq: payload}."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = {}
    while dealer.poll(5000):
        _, seq, payload = dealer.recv_multipart()
        s = int.from_bytes(seq, "big", signed=True)
        if s == -1:
            break
        out[s] = payload
    dealer.close(0)
    return out


def replay_settled(ctx, endpoint, start, wait_s=10.0):
    """replay() until two answers 0.3 s apart agree: the publisher thread sends what the daemon
    queued (a warm restart's reload, the last request's blocks) a moment after the daemon answers."""
    deadline = time.monotonic() + wait_s
    got = replay(ctx, endpoint, start)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        again = replay(ctx, endpoint, start)
        if again == got and got:
            return got
        got = again
    return got


def events_of(payloads):
    for seq in sorted(payloads):
        ts, events, rank = msgpack.unpackb(payloads[seq], raw=False)
        for e in events:
            yield seq, ts, rank, e


def start_daemon(kvd, tmp, name, fmt=None):
    config = (f"pools:\n  - name: m\n    block_tokens: {BT}\n    num_layers: 1\n"
              "    bytes_per_token_per_layer: 8\n    capacity_blocks: 24\n    max_model_len: 200\n"
              f"tiers:\n  host_bytes: 0\n  disk_dir: {tmp}/disk\n"
              f"router_events:\n  endpoint: ipc://{tmp}/events\n  replay_endpoint: ipc://{tmp}/replay\n"
              f"  node: n1\n  hash_seed: \"{SEED}\"\n  data_parallel_rank: 2\n  max_batch_events: 3\n"
              + (f"  format: {fmt}\n" if fmt else ""))
    return Daemon(kvd, tmp, config, name=name)


def main():
    kvd = sys.argv[1]
    tmp = tempfile.mkdtemp(prefix="kvd-ev-")
    ctx = zmq.Context()
    daemon = start_daemon(kvd, tmp, "a")
    try:
        sub = Subscriber(ctx, f"ipc://{tmp}/events")
        time.sleep(0.3)  # let the SUB connection settle (anything missed is replayed below)
        a = list(range(100, 117))            # 4 full blocks
        b = list(range(100, 108)) + [7] * 9  # shares a's first 2 blocks
        expected = {}
        with Client(daemon.target, worker_name="ev") as c:
            for rid, prompt, kw in (("a", a, {}), ("b", b, {}), ("lora", a, {"adapter": "lora-x"}),
                                    ("salt", a, {"cache_salt": "tenant-1"})):
                with c.request(rid, pool="m", prompt=prompt, **kw) as r:
                    r.publish(prompt)
            expected["plain"] = vllm_ids(a)
            expected["b"] = vllm_ids(b)
            expected["lora"] = vllm_ids(a, lambda i: ("lora-x",))
            expected["salt"] = vllm_ids(a, lambda i: ("tenant-1",) if i == 0 else None)
            # Fill the 24-block pool so that older blocks are evicted (BlockRemoved).
            for k in range(5):
                p = [1000 * (k + 1) + t for t in range(17)]
                with c.request(f"fill-{k}", pool="m", prompt=p) as r:
                    r.publish(p)
            cached = c.report().pools[0].cached_blocks
            sub.drain(idle_s=1.5)

            seqs = sorted(sub.batches)
            first_missing = next((s for s in range(max(seqs) + 1) if s not in sub.batches), None) if seqs else 0
            full = dict((s, p) for s, (_, p) in sub.batches.items())
            if first_missing is not None:  # the subscriber joined late: the replay socket has the rest
                full.update(replay(ctx, f"ipc://{tmp}/replay", first_missing))
            seqs = sorted(full)
            check(seqs == list(range(len(seqs))) and len(seqs) > 5, f"{len(seqs)} batches, sequence 0.. without gaps")
            check(all(t == b"kv@n1@m" for t, _ in sub.batches.values()), "topic kv@{node}@{pool}")

            stored, removed, live, ranks, stamps, shapes, loras = [], [], set(), set(), [], [], {}
            for _, ts, rank, e in events_of(full):
                ranks.add(rank)
                stamps.append(ts)
                if e[0] == "BlockStored":
                    # vLLM's array-era BlockStored since PR #27577: lora_name is the required 8th field.
                    _, ids, parent, tokens, bs, lora_id, medium, lora_name = e
                    shapes.append(bs == BT and len(tokens) == BT * len(ids) and lora_id is None and medium == "CPU")
                    for i in ids:
                        loras[i] = lora_name
                    stored.append((ids, parent, tokens))
                    live.update(ids)
                elif e[0] == "BlockRemoved":
                    _, ids, medium = e
                    removed.extend(ids)
                    live.difference_update(ids)
            check(ranks == {2}, "data_parallel_rank from the config")
            check(all(isinstance(t, float) and abs(t - time.time()) < 120 for t in stamps), "timestamps are float seconds")
            check(shapes and all(shapes), "BlockStored fields: block_size, tokens per block, lora_id nil, medium CPU")
            all_stored = [i for ids, _, _ in stored for i in ids]
            for name, ids in expected.items():
                check(all(i in all_stored for i in ids), f"{name}: every id equals Python's sha256_cbor ({len(ids)} blocks)")
            first = next(s for s in stored if s[0][0] == expected["plain"][0])
            check(first[1] is None and first[2][:BT] == a[:BT], "first block: parent nil, its tokens")
            b_tail = next(s for s in stored if expected["b"][2] in s[0])
            check(b_tail[1] == expected["b"][1], "b's first new block names its shared parent")
            check(all(loras.get(i) == "lora-x" for i in expected["lora"]) and
                  all(loras.get(i) is None for i in expected["plain"] + expected["salt"]),
                  "lora_name carries the adapter (nil for the base model)")
            check(len(set(expected["lora"]) & set(expected["plain"])) == 0 and
                  len(set(expected["salt"]) & set(expected["plain"])) == 0, "adapter and salt give distinct ids")
            check(len(removed) > 0 and set(removed) <= set(all_stored), f"{len(removed)} removals, all of stored blocks")
            check(len(live) == cached, f"router's live set = daemon's cached blocks ({len(live)} vs {cached})")

            # Lost batches come back byte-identical through replay.
            lost = seqs[2:5]
            got = replay(ctx, f"ipc://{tmp}/replay", lost[0])
            check(all(got.get(s) == full[s] for s in lost) and max(got) == max(seqs), "replay resends lost batches byte for byte")
            late = replay(ctx, f"ipc://{tmp}/replay", 0)
            check(late == full, "a late subscriber rebuilds the whole stream from sequence 0")

            # Close: flush to disk, clear the cache -> AllBlocksCleared.
            c._rpc("Close", kvd_pb2.CloseRequest())
            sub.drain(idle_s=1.5)
            after = dict((s, p) for s, (_, p) in sub.batches.items() if s > max(seqs))
            kinds = [e[0] for _, _, _, e in events_of(after)]
            check(kinds == ["AllBlocksCleared"], f"Close announces AllBlocksCleared ({kinds})")
        daemon.stop()

        # Warm restart: "cleared", then the reloaded blocks, parents first, medium DISK, same ids.
        daemon = start_daemon(kvd, tmp, "b")
        got = replay_settled(ctx, f"ipc://{tmp}/replay", 0)
        evs = [e for _, _, _, e in events_of(got)]
        check(evs and evs[0][0] == "AllBlocksCleared", "restart: AllBlocksCleared first")
        reloaded = [i for e in evs if e[0] == "BlockStored" for i in e[1]]
        check(all(e[6] == "DISK" for e in evs if e[0] == "BlockStored"), "restart: medium DISK")
        # Evicted blocks were demoted to disk too, so the restart brings back every block stored.
        check(set(reloaded) == set(all_stored), f"restart: the reloaded ids are the stored ids ({len(reloaded)})")
        seen = set()
        ordered = True
        for e in evs:
            if e[0] == "BlockStored":
                ordered &= e[2] is None or e[2] in seen
                seen.update(e[1])
        check(ordered, "restart: every block is announced after its parent")
        daemon.stop()

        # router_events.format: vllm-map — vLLM's msgspec structs as tagged maps.
        shutil.rmtree(os.path.join(tmp, "disk"), ignore_errors=True)
        daemon = start_daemon(kvd, tmp, "c", fmt="vllm-map")
        sub = Subscriber(ctx, f"ipc://{tmp}/events")
        time.sleep(0.3)
        with Client(daemon.target, worker_name="ev-map") as c:
            with c.request("m1", pool="m", prompt=a, adapter="lora-x") as r:
                r.publish(a)
        got = replay_settled(ctx, f"ipc://{tmp}/replay", 0)
        batches = [msgpack.unpackb(got[s], raw=False) for s in sorted(got)]
        check(batches and all(isinstance(b, dict) and set(b) == {"ts", "events", "data_parallel_rank"} for b in batches),
              "map format: batches are maps of ts, events, data_parallel_rank")
        evs = [e for b in batches for e in b["events"]]
        st = [e for e in evs if e.get("type") == "BlockStored"]
        check(st and all(set(e) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                   "medium", "lora_name"} for e in st), "map format: BlockStored fields by name")
        check(all(e["lora_name"] == "lora-x" for e in st) and
              [i for e in st for i in e["block_hashes"]] == expected["lora"],
              "map format: the same ids, and lora_name the adapter")
    finally:
        daemon.stop()
        ctx.destroy(0)
        shutil.rmtree(tmp, ignore_errors=True)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
