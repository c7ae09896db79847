#!/usr/bin/env python3
"""Router-compatible KV events from a real kvd, decoded by a Python subscriber (pyzmq + msgpack).

Checks: the three-frame format (topic, 8-byte big-endian sequence, msgpack [ts, [events], rank]);
every BlockStored id equals vLLM's sha256_cbor block hash computed here independently with hashlib
and cbor2 (plain, LoRA adapter, cache salt); removals name stored blocks; the live set a router
rebuilds matches the daemon's cached blocks; lost batches are recovered through the ROUTER replay
socket byte for byte; a late subscriber rebuilds everything by replay; Close announces
AllBlocksCleared; a warm restart announces the reloaded blocks (medium DISK) with the same ids.
Topics: one sequence per pool, replay by topic with vLLM >= 0.26's topic frame (and without it),
a medium per pool, topics that would prefix-match refused, and a PUB socket that connects to a
router that binds (llm-d's central mode); positioned media keyed per overlapped block. The stream
is also fed to decoders written from llm-d's and Dynamo's sources (LlmdIndexer, DynamoIndexer),
whose rebuilt indexes must find each prompt's cached blocks under their own key schemes. A hybrid
pool (KV groups) announces its spine as its full group, with vLLM's group fields where llm-d reads
them by position and under vLLM's names in the map format; an evicted unit is announced removed.

Usage: test_router_events.py KVD_BINARY   (PYTHONPATH=<build>/python)
"""
import hashlib
import os
import shutil
import subprocess
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


def replay(ctx, endpoint, start, topic=None, topic_frame=True, with_topics=False):
    """Asks the replay socket for every batch from `start` (of `topic`, or of every topic); returns
    {seq: payload}, or {(topic, seq): payload} with `with_topics`. Replies are [topic, seq, payload]
    (vLLM >= 0.26) or [seq, payload] (topic_frame=False); the end marker's sequence is -1."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b""] + ([topic] if topic is not None else []) + [start.to_bytes(8, "big")])
    out = {}
    while dealer.poll(5000):
        frames = dealer.recv_multipart()
        if topic_frame:
            _, t, seq, payload = frames
        else:
            (_, seq, payload), t = frames, None
        s = int.from_bytes(seq, "big", signed=True)
        if s == -1:
            if payload != b"" or (topic_frame and t != b""):
                check(False, f"replay end marker is ['', -1, ''] (got {frames[1:]})")
            break
        out[(t, s) if with_topics else s] = payload
    dealer.close(0)
    return out


def replay_settled(ctx, endpoint, start, wait_s=10.0, **kw):
    """replay() until two answers 0.3 s apart agree: the publisher thread sends what the daemon
    queued (a warm restart's reload, the last request's blocks) a moment after the daemon answers."""
    deadline = time.monotonic() + wait_s
    got = replay(ctx, endpoint, start, **kw)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        again = replay(ctx, endpoint, start, **kw)
        if again == got and got:
            return got
        got = again
    return got


def events_of(payloads):
    for seq in sorted(payloads):
        ts, events, rank = msgpack.unpackb(payloads[seq], raw=False)
        for e in events:
            yield seq, ts, rank, e


def events_config(tmp, pools=("m",), endpoint=None, extra=""):
    config = "pools:\n"
    for p in pools:
        config += (f"  - name: {p}\n    block_tokens: {BT}\n    num_layers: 1\n"
                   "    bytes_per_token_per_layer: 8\n    capacity_blocks: 24\n    max_model_len: 200\n")
    return config + (f"tiers:\n  host_bytes: 0\n  disk_dir: {tmp}/disk\n"
                     f"router_events:\n  endpoint: {endpoint or f'ipc://{tmp}/events'}\n"
                     f"  replay_endpoint: ipc://{tmp}/replay\n"
                     f"  node: n1\n  hash_seed: \"{SEED}\"\n  data_parallel_rank: 2\n  max_batch_events: 3\n" + extra)


def fnv64a(data):
    h = 0xcbf29ce484222325
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


class LlmdIndexer:
    """llm-d's KV-cache indexer as its source defines it (llm-d/llm-d-kv-cache at 7be76e119ca5:
    pkg/kvevents/engineadapter/vllm_adapter.go, common.go, pkg/kvevents/pool.go,
    pkg/kvcache/kvblock/token_processor.go, in_memory.go). It decodes array-format batches by field
    position (tag, block_hashes, parent, token_ids, block_size, then optional lora_id, medium,
    lora_name, extra_keys), takes pod and model from the topic "kv@pod@model", and re-keys every
    block with its own scheme: FNV-64a over canonical CBOR [parent, tokens, extra], the chain's root
    FNV-64a(cbor[FNV-64a(seed), null, model]), where model is lora_name when set. Engine ids only
    link parents and name removals."""

    def __init__(self, block_size, seed=""):
        self.bs = block_size
        self.init = fnv64a(seed.encode())
        self.eng_to_req = {}   # engine key -> request key
        self.pods = {}         # request key -> {(pod, tier)}

    def _hash(self, parent, tokens, extra):
        return fnv64a(cbor2.dumps([parent, tokens, extra], canonical=True))

    def request_keys(self, tokens, model, parent=None):
        prefix = parent if parent is not None else self._hash(self.init, None, model)
        keys = []
        for i in range(len(tokens) // self.bs):
            prefix = self._hash(prefix, tokens[i * self.bs:(i + 1) * self.bs], None)
            keys.append(prefix)
        return keys

    def consume(self, topic, payload):
        parts = topic.decode().split("@")
        pod, model = (parts[1], parts[2]) if len(parts) == 3 else (topic.decode(), "")
        ts, events = msgpack.unpackb(payload, raw=False)[:2]
        for f in events:
            if f[0] == "BlockStored":
                tier = (f[6] if len(f) > 6 and f[6] else "gpu").lower()
                eff = f[7] if len(f) > 7 and f[7] else model
                parent = None
                if f[2] is not None:
                    if f[2] not in self.eng_to_req:
                        continue  # llm-d logs "Failed to get request key for parent block" and skips
                    parent = self.eng_to_req[f[2]]
                reqs = self.request_keys(f[3], eff, parent)
                for ek, rk in zip(f[1], reqs):
                    self.eng_to_req[ek] = rk
                    self.pods.setdefault(rk, set()).add((pod, tier))
            elif f[0] == "BlockRemoved":
                tier = (f[2] if len(f) > 2 and f[2] else "gpu").lower()
                for ek in f[1]:
                    rk = self.eng_to_req.get(ek)
                    if rk is not None:
                        self.pods.get(rk, set()).discard((pod, tier))
            elif f[0] == "AllBlocksCleared":
                for entries in self.pods.values():
                    entries.difference_update({e for e in entries if e[0] == pod})

    def hits(self, tokens, model, pod):
        """Leading blocks of `tokens` that the indexer scores on `pod` (a router's lookup)."""
        n = 0
        for rk in self.request_keys(tokens, model):
            if not any(e[0] == pod for e in self.pods.get(rk, ())):
                break
            n += 1
        return n


class DynamoIndexer:
    """NVIDIA Dynamo's KV router as its source defines it: ai-dynamo/dynamo at 4fb5a208fe6e,
    lib/kv-router/src/zmq_wire/deserialize.rs (array or tagged-map events; BlockStored by position:
    tag, block_hashes, parent, token_ids, block_size, lora_id (discarded), medium, lora_name,
    extra_keys) and convert.rs (blocks whose block_size is not the router's kv_block_size are not
    published; each block's tokens_hash is compute_block_hash_for_seq of its tokens and
    lora_name); lib/kv-router/src/protocols.rs of the same API (BlockHashOptions{block_mm_infos,
    lora_name, is_eagle}): XXH3-64 of the tokens as little-endian u32, seed 1337, plus
    XXH3-64(lora_name) when one is set; StorageTier::from_kv_medium ("GPU"/"DEVICE" device,
    "CPU_PINNED"/"CPU_TIER1" host, "DISK"/"NVME"/"CPU_TIER2" disk, anything else the device).
    Blocks form a tree linked by the engine's ids; a request matches by walking its own local
    hashes from the root."""

    SEED = 1337

    def __init__(self, kv_block_size):
        import ctypes
        self.lib = ctypes.CDLL("libxxhash.so.0")
        self.lib.XXH3_64bits_withSeed.restype = ctypes.c_uint64
        self.lib.XXH3_64bits_withSeed.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]
        self.lib.XXH3_64bits.restype = ctypes.c_uint64
        self.lib.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        self.bs = kv_block_size
        self.nodes = {}     # engine id -> {"local", "parent", "workers": {(worker, tier)}}
        self.children = {}  # (parent engine id or None, local hash) -> engine id
        self.dropped = 0

    def local_hashes(self, tokens, lora_name=None):
        seed = self.SEED
        if lora_name:
            seed = (seed + self.lib.XXH3_64bits(lora_name.encode(), len(lora_name.encode()))) & (2 ** 64 - 1)
        out = []
        for i in range(len(tokens) // self.bs):
            data = b"".join(t.to_bytes(4, "little") for t in tokens[i * self.bs:(i + 1) * self.bs])
            out.append(self.lib.XXH3_64bits_withSeed(data, len(data), seed))
        return out

    @staticmethod
    def tier(medium):
        return {"GPU": "device", "DEVICE": "device", "CPU_PINNED": "host", "CPU_TIER1": "host",
                "CPU_TIER2": "disk", "DISK": "disk", "NVME": "disk"}.get(medium or "", "device")

    def consume(self, worker, payload):
        batch = msgpack.unpackb(payload, raw=False)
        events = batch["events"] if isinstance(batch, dict) else batch[1]
        for e in events:
            if isinstance(e, dict):
                f = [e.get("type"), e.get("block_hashes"), e.get("parent_block_hash"), e.get("token_ids"),
                     e.get("block_size"), None, e.get("medium"), e.get("lora_name")]
                if f[0] == "BlockRemoved":
                    f = [f[0], f[1], e.get("medium")]
            else:
                f = list(e) + [None] * 8
            if f[0] == "BlockStored":
                if f[4] != self.bs:
                    self.dropped += len(f[1])  # "Block not published. Block size must be ..."
                    continue
                parent = f[2]
                if parent is not None and parent not in self.nodes:
                    continue
                for ext, local in zip(f[1], self.local_hashes(f[3], f[7])):
                    node = self.nodes.setdefault(ext, {"local": local, "parent": parent, "workers": set()})
                    node["workers"].add((worker, self.tier(f[6])))
                    self.children.setdefault((parent, local), ext)
                    parent = ext
            elif f[0] == "BlockRemoved":
                for ext in f[1]:
                    if ext in self.nodes:
                        self.nodes[ext]["workers"].discard((worker, self.tier(f[2])))
            elif f[0] == "AllBlocksCleared":
                for node in self.nodes.values():
                    node["workers"] = {w for w in node["workers"] if w[0] != worker}

    def overlap(self, tokens, worker, lora_name=None):
        """Blocks of `tokens` the router scores on `worker` (find_matches: the walk from the root)."""
        parent, n = None, 0
        for local in self.local_hashes(tokens, lora_name):
            ext = self.children.get((parent, local))
            if ext is None or not any(w[0] == worker for w in self.nodes[ext]["workers"]):
                break
            parent, n = ext, n + 1
        return n


def start_daemon(kvd, tmp, name, fmt=None, extra=""):
    return Daemon(kvd, tmp, events_config(tmp, extra=(f"  format: {fmt}\n" if fmt else "") + extra), name=name)


def refused(kvd, tmp, config):
    """kvd --print-config on `config`: (exit code, stderr)."""
    path = os.path.join(tmp, "refused.yaml")
    with open(path, "w") as f:
        f.write(config)
    out = subprocess.run([kvd, "--config=" + path, "--print-config"], capture_output=True, text=True, timeout=30)
    return out.returncode, out.stderr


def prove_media(kvd, tmp, ctx):
    """Positioned media follow vLLM's per-block rule: (identifier, offset - block start) only in the
    blocks an item overlaps, so a block before the image keeps the plain prompt's id — announced
    once while any block behind it is cached, removed when the last goes."""
    shutil.rmtree(os.path.join(tmp, "disk"), ignore_errors=True)
    d = start_daemon(kvd, tmp, "media")
    try:
        a = list(range(200, 217))  # 4 full blocks
        with Client(d.target, worker_name="media") as c:
            for rid, kw in (("plain", {}), ("image", {"media": [("img-1", 5, 6)]}),
                            ("legacy", {"media_keys": ["img-2"]})):
                with c.request(rid, pool="m", prompt=a, **kw) as r:
                    r.publish(a)
            stored_before = replay_settled(ctx, f"ipc://{tmp}/replay", 0)
            for k in range(6):  # 24 new blocks: everything above is evicted
                p = [5000 + 100 * k + t for t in range(17)]
                with c.request(f"fill-{k}", pool="m", prompt=p) as r:
                    r.publish(p)
            cached = c.report().pools[0].cached_blocks
        got = replay_settled(ctx, f"ipc://{tmp}/replay", 0)
    finally:
        d.stop()
    plain = vllm_ids(a)
    image = vllm_ids(a, lambda i: (("img-1", 5 - 4 * i),) if 4 * i < 11 and 5 < 4 * i + 4 else None)
    legacy = vllm_ids(a, lambda i: ("img-2",))
    check(image[0] == plain[0] and len(set(image[1:]) & set(plain)) == 0,
          "media: the block before the image keeps the plain id; the blocks it overlaps (and after) differ")
    first = [i for _, _, _, e in events_of(stored_before) if e[0] == "BlockStored" for i in e[1]]
    check(all(i in first for i in image[1:]) and all(i in first for i in legacy),
          "media: ids equal vLLM's, (identifier, offset from the block start) in the overlapped blocks")
    check(first.count(plain[0]) == 1, f"media: the shared id is announced once ({first.count(plain[0])})")
    live, removed = set(), []
    for _, _, _, e in events_of(got):
        if e[0] == "BlockStored":
            live.update(e[1])
        elif e[0] == "BlockRemoved":
            removed.extend(e[1])
            live.difference_update(e[1])
    check(removed.count(plain[0]) == 1, "media: the shared id is removed once, with the last block behind it")
    check(len(live) == cached and not live & set(plain + image + legacy),
          f"media: the router's live set = the daemon's cached blocks ({len(live)} vs {cached})")


def prove_topics(kvd, tmp, ctx):
    """Per-pool topics: one sequence each, topics that cannot prefix-match, a medium per pool, the
    replay topic frame, and a PUB socket that connects to a router that binds (llm-d's central mode)."""
    code, err = refused(kvd, tmp, events_config(tmp, pools=("m", "m2")))
    check(code == 2 and "kv@n1@m'" in err and "kv@n1@m2" in err,
          f"pools m and m2 under topic kv@{{node}}@{{pool}}: refused, naming both topics ({err.strip()[-160:]})")
    for bad, word in (("  endpoint_mode: sideways\n", "endpoint_mode"), ("  medium:\n    x: GPU\n", "no pool named 'x'"),
                      ("  medium: G/PU\n", "G/PU")):
        code, err = refused(kvd, tmp, events_config(tmp, extra=bad))
        check(code == 2 and word in err, f"router_events {bad.strip()!r}: refused naming {word}")

    # The router binds; kvd's PUB connects (a tcp endpoint without a wildcard).
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@n1@")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    shutil.rmtree(os.path.join(tmp, "disk"), ignore_errors=True)  # nothing reloaded: every block is live
    d = Daemon(kvd, tmp, events_config(tmp, pools=("m", "n"), endpoint=f"tcp://127.0.0.1:{port}",
                                       extra="  medium:\n    n: GPU\n"), name="topics")
    try:
        # A bound SUB attaches an accepted connection (and sends it the subscription) only while it
        # is polled, as a router's receive loop does; batches sent before that are replayed below.
        sub.poll(500)
        time.sleep(0.2)
        with Client(d.target, worker_name="topics") as c:
            for k in range(4):
                for pool in ("m", "n"):
                    p = [50 * k + t + (0 if pool == "m" else 7) for t in range(13)]
                    with c.request(f"{pool}-{k}", pool=pool, prompt=p) as r:
                        r.publish(p)
        live = {}
        while sub.poll(1500):
            topic, seq, payload = sub.recv_multipart()
            live[(topic, int.from_bytes(seq, "big"))] = payload
        check(len(live) > 0, f"a connecting PUB delivers to a binding SUB ({len(live)} batches)")
        both = replay_settled(ctx, f"ipc://{tmp}/replay", 0, with_topics=True)
        check(all(both.get(k) == v for k, v in live.items()), "replay of every topic has each live batch, byte for byte")
        for pool, medium in (("m", "CPU"), ("n", "GPU")):
            topic = f"kv@n1@{pool}".encode()
            mine = replay(ctx, f"ipc://{tmp}/replay", 0, topic=topic, with_topics=True)
            seqs = sorted(s for _, s in mine)
            check(mine and all(t == topic for t, _ in mine) and seqs == list(range(len(seqs))),
                  f"topic {pool}: its own sequence 0..{len(seqs) - 1} without gaps; a topic's replay holds only it")
            check(mine == {k: v for k, v in both.items() if k[0] == topic}, f"topic {pool}: its replay = its share of the whole")
            media = {e[6] for _, _, _, e in events_of({s: p for (_, s), p in mine.items()}) if e[0] in ("BlockStored",)}
            check(media == {medium}, f"pool {pool}: medium {medium} ({media})")
        check(replay(ctx, f"ipc://{tmp}/replay", 0, topic=b"kv@n1@zz") == {}, "replay of an unknown topic: just the end marker")
        # Careless or hostile replay requests are ignored; the socket keeps serving.
        junk = ctx.socket(zmq.DEALER)
        junk.connect(f"ipc://{tmp}/replay")
        for frames in ([b""], [b"", b"\x00\x01"], [b"", b"kv@n1@m", b"x", b"\x00" * 8], [b"", b"\xff" * 8 + b"!"]):
            junk.send_multipart(frames)
        check(not junk.poll(500), "malformed replay requests get no answer")
        junk.close(0)
        check(replay(ctx, f"ipc://{tmp}/replay", 0, with_topics=True) == both, "after them, replay answers as before")
    finally:
        d.stop()
        sub.close(0)


HYBRID_CONFIG = ("pools:\n  - name: hy\n    block_tokens: 4\n    num_layers: 4\n    bytes_per_token_per_layer: 16\n"
                 "    max_model_len: 64\n    step_tokens: 8\n    groups:\n"
                 "      - {name: swa, kind: sliding_window, layers: [0], window: 6, capacity_blocks: 24}\n"
                 "      - {name: full, kind: full, layers: [\"1-3/2\"], capacity_blocks: 40}\n"
                 "      - {name: rec, kind: state, layers: [2], bytes_per_state: 96, checkpoint_every_blocks: 2, "
                 "capacity_slots: 6}\n")


def llmd_groups(payloads):
    """llm-d's reading of a hybrid stream (vllm_adapter.go at 7be76e11, by position): BlockStored [9]
    group_idx, [10] kv_cache_spec_kind, [11] kv_cache_spec_sliding_window; BlockRemoved [3]
    group_idx. Returns (catalog {group: (kind, block_size, window)}, stored [(ids, group)],
    removed [(ids, group)])."""
    catalog, stored, removed = {}, [], []
    for _, _, _, e in events_of(payloads):
        if e[0] == "BlockStored":
            g = e[9] if len(e) > 9 else None
            if g is not None:
                catalog[g] = (e[10] if len(e) > 10 else None, e[4], e[11] if len(e) > 11 else None)
            stored.append((e[1], g))
        elif e[0] == "BlockRemoved":
            removed.append((e[1], e[3] if len(e) > 3 else None))
    return catalog, stored, removed


def prove_hybrid(kvd, tmp, ctx):
    """A hybrid pool (groups swa, full, rec: the full group is index 1) announces its spine as the
    full group: ids as vLLM hashes the prompt, block_size the pool's block, group_idx 1 and kind
    full_attention where llm-d reads them (arrays) and under vLLM's names (maps). State pressure
    evicts the oldest unit (checkpoint, window and full blocks): its blocks are announced removed
    for group 1, and the router's live set is kvd's cached full blocks. Every chain the router
    still scores, kvd hits at the same length; the evicted ones neither."""
    for fmt in ("vllm", "vllm-map"):
        events = (f"router_events:\n  endpoint: ipc://{tmp}/events-hy\n  replay_endpoint: ipc://{tmp}/replay-hy\n"
                  f"  node: n1\n  hash_seed: \"{SEED}\"\n  format: {fmt}\n")
        d = Daemon(kvd, tmp, HYBRID_CONFIG + events, name=f"hybrid-{fmt}")
        check(d.started, f"{fmt}: kvd serves router events for a hybrid pool (no longer refused)")
        if not d.started:
            continue
        try:
            prompts = [[1000 * (k + 1) + t for t in range(9)] for k in range(6)]
            with Client(d.target, worker_name="hy-ev") as c:
                for k, p in enumerate(prompts):
                    with c.request(f"h{k}", pool="hy", prompt=p) as r:
                        spare = r.group_table("rec").blocks[1]
                        r.publish(p[:8], state_checkpoints=[(2, 8, spare)])
                served = [c.peek_prefix_len("hy", p[:8] + [7]) for p in prompts]
                groups = {g.name: g for g in c.report().pools[0].groups}
                full_cached = groups["full"].cached
            got = replay_settled(ctx, f"ipc://{tmp}/replay-hy", 0)
        finally:
            d.stop()
        check(served[0] == 0 and served[-1] == 8, f"{fmt}: state pressure evicted the oldest unit; the newest hits 8 ({served})")
        if fmt == "vllm":
            catalog, stored, removed = llmd_groups(got)
            arrays = [e for _, _, _, e in events_of(got) if e[0] in ("BlockStored", "BlockRemoved")]
            check(all(len(e) == (12 if e[0] == "BlockStored" else 4) for e in arrays),
                  "vllm: BlockStored has 12 fields (extra_keys nil, group_idx, kind, window), BlockRemoved 4")
            check(catalog == {1: ("full_attention", BT, None)},
                  f"llm-d's group catalog: group 1, full_attention, block_size {BT}, no window ({catalog})")
            ids = [i for i_s, g in stored for i in i_s]
            check(all(i in ids for p in prompts for i in vllm_ids(p[:8])), "vllm: every spine block's id is vLLM's hash")
            gone = [i for i_s, g in removed for i in i_s]
            check(removed and all(g == 1 for _, g in removed) and set(vllm_ids(prompts[0][:8])) <= set(gone),
                  f"vllm: the evicted unit's blocks are removed for group 1 ({removed})")
            # llm-d's index: entries per (pod, tier, group); a removal takes only its group's entry.
            entries = {}
            for i_s, g in stored:
                for i in i_s:
                    entries.setdefault(i, set()).add(("n1", g))
            for i_s, g in removed:
                for i in i_s:
                    entries.get(i, set()).discard(("n1", g))
            live = {i for i, e in entries.items() if e}
            for k, p in enumerate(prompts):
                scored = 0
                for i in vllm_ids(p[:8]):
                    if i not in live:
                        break
                    scored += 1
                check(scored * BT == served[k], f"vllm: the router scores prompt {k} at {scored} blocks, kvd serves {served[k]}")
            check(len(live) == full_cached, f"vllm: the router's live set = kvd's cached full blocks ({len(live)} vs {full_cached})")
            check(groups["rec"].cached == sum(1 for s in served if s == 8),
                  f"Report per group: one cached checkpoint per chain kvd hits ({groups['rec'].cached})")
        else:
            evs = [e for s in sorted(got) for e in msgpack.unpackb(got[s], raw=False)["events"]]
            st = [e for e in evs if e["type"] == "BlockStored"]
            rm = [e for e in evs if e["type"] == "BlockRemoved"]
            check(st and all(set(e) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                       "medium", "lora_name", "group_idx", "kv_cache_spec_kind"} and
                             e["group_idx"] == 1 and e["kv_cache_spec_kind"] == "full_attention" and e["block_size"] == BT
                             for e in st),
                  "vllm-map: BlockStored by vLLM's names with group_idx 1 and kv_cache_spec_kind (defaults left out)")
            check(rm and all(set(e) == {"type", "block_hashes", "medium", "group_idx"} and e["group_idx"] == 1 for e in rm),
                  "vllm-map: BlockRemoved carries group_idx")


WINDOW_CONFIG = ("pools:\n  - name: hw\n    block_tokens: 4\n    num_layers: 2\n    bytes_per_token_per_layer: 16\n"
                 "    max_model_len: 64\n    step_tokens: 16\n    groups:\n"
                 "      - {name: full, kind: full, layers: [0], capacity_blocks: 40}\n"
                 "      - {name: swa, kind: sliding_window, layers: [1], window: 6, capacity_blocks: 9}\n")


def prove_window_tombstone(kvd, tmp, ctx):
    """Window pressure tombstones the oldest window block, inside a chain (full + sliding window,
    W = 6: a hit of d blocks needs window blocks [d - 2, d)). kvd still serves the chain at its
    full length, and the router is told nothing: no BlockRemoved, every id still live. Then more
    pressure tombstones the other interior window blocks and takes its leaf unit, which is announced removed: the
    router never scores the chain below what kvd serves (it may score it above: the tombstones
    inside it are not announced, docs/hybrid.md "What works today")."""
    events = (f"router_events:\n  endpoint: ipc://{tmp}/events-hw\n  replay_endpoint: ipc://{tmp}/replay-hw\n"
              f"  node: n1\n  hash_seed: \"{SEED}\"\n")
    d = Daemon(kvd, tmp, WINDOW_CONFIG + events, name="hybrid-window")
    check(d.started, "a full + sliding_window pool with router events starts")
    if not d.started:
        return
    try:
        a = list(range(2000, 2017))
        with Client(d.target, worker_name="hw-ev") as c:
            for rid, p in (("a", a), ("b", list(range(3000, 3017)))):
                with c.request(rid, pool="hw", prompt=p) as r:
                    r.publish(p[:16])  # 4 full blocks and their 4 window blocks
                    r.extend(0, computed_tokens=16)  # window blocks 0 and 1 leave the table: oldest
            before = {g.name: g.cached for g in c.report().pools[0].groups}
            with c.request("c", pool="hw", prompt=list(range(4000, 4005))):
                pass  # 2 window blocks with 1 free: a's oldest window block is tombstoned
            after = {g.name: g.cached for g in c.report().pools[0].groups}
            served = c.peek_prefix_len("hw", a[:16] + [7])
            got = replay_settled(ctx, f"ipc://{tmp}/replay-hw", 0)
            # Interior window blocks go first (docs/hybrid.md §2.8): d takes the 2 free and 2 of
            # the 3 interior ones and caches its own 4; then e's 4 take the interior ones left and
            # the chain ends' windows by release age, a's first, and with them its leaf unit.
            d_prompt = list(range(5000, 5017))
            with c.request("d", pool="hw", prompt=d_prompt) as r:
                r.publish(d_prompt[:16])
            with c.request("e", pool="hw", prompt=list(range(6000, 6017))):
                pass
            served_after = c.peek_prefix_len("hw", a[:16] + [7])
            full_after = {g.name: g.cached for g in c.report().pools[0].groups}["full"]
            got_after = replay_settled(ctx, f"ipc://{tmp}/replay-hw", 0)
    finally:
        d.stop()
    check(before == {"full": 8, "swa": 8} and after == {"full": 8, "swa": 7},
          f"window pressure tombstoned one window block, no full block ({before} -> {after})")
    check(served == 16, f"kvd still serves a's 16 tokens (the window before 16 is intact): {served}")
    _, stored, removed = llmd_groups(got)
    ids = {i for i_s, _ in stored for i in i_s}
    check(not removed and set(vllm_ids(a[:16])) <= ids and all(g == 0 for _, g in stored),
          f"the router is told no removal: a's 4 blocks stay live for group 0 ({removed})")
    _, stored, removed = llmd_groups(got_after)
    live = {i for i_s, _ in stored for i in i_s} - {i for i_s, _ in removed for i in i_s}
    scored = 0
    for i in vllm_ids(a[:16]):
        if i not in live:
            break
        scored += 1
    check(served_after < 16 and removed and scored * BT >= served_after and len(live) == full_after,
          f"more pressure: a's leaf unit went and was announced removed; the router scores a at {scored} blocks, "
          f"kvd serves {served_after} tokens; live set = cached full blocks ({len(live)} vs {full_after})")


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
            sub.drain(idle_s=1.5)
            before_fill = max(sub.batches)  # the last batch of the four requests: nothing evicted yet
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

            # llm-d's indexer, fed the same stream, finds each request's blocks on this node under
            # its own keys: LoRA blocks under the adapter's name, never under the base model.
            llmd = LlmdIndexer(BT)
            for seq in seqs:
                if seq <= before_fill:
                    llmd.consume(b"kv@n1@m", full[seq])
            check(llmd.hits(a, "m", "n1") == 4 and llmd.hits(b, "m", "n1") == 4,
                  "llm-d: both base prompts score all their blocks on the node, under its own keys")
            check(llmd.hits(a, "lora-x", "n1") == 4, "llm-d: the adapter's blocks score under lora_name")
            check(llmd.hits(a, "lora-y", "n1") == 0, "llm-d: another adapter scores nothing")
            lora_engine = set(expected["lora"])
            lora_reqs = {llmd.eng_to_req[i] for i in lora_engine}
            check(lora_reqs == set(llmd.request_keys(a, "lora-x")) and not lora_reqs & set(llmd.request_keys(a, "m")),
                  "llm-d: LoRA blocks are indexed under the adapter, none under the base model")
            # Dynamo's router, fed the same stream with its kv_block_size equal to the pool's block,
            # scores the same blocks under its own token hashes; with another block size it drops
            # every block (a router configured for another block size must not score this node).
            dynamo, dynamo_other = DynamoIndexer(BT), DynamoIndexer(2 * BT)
            for seq in seqs:
                if seq <= before_fill:
                    dynamo.consume("n1", full[seq])
                    dynamo_other.consume("n1", full[seq])
            check(dynamo.overlap(a, "n1") == 4 and dynamo.overlap(b, "n1") == 4,
                  "Dynamo: both base prompts score all their blocks, under its own token hashes")
            check(dynamo.overlap(a, "n1", "lora-x") == 4 and dynamo.overlap(a, "n1", "lora-y") == 0,
                  "Dynamo: the adapter's blocks score under lora_name, another adapter's none")
            check(all(w[1] == "device" for n in dynamo.nodes.values() for w in n["workers"]),
                  "Dynamo: medium CPU reads as its device tier at this version (router_events.medium can say GPU)")
            check(dynamo_other.dropped > 0 and not dynamo_other.nodes and dynamo_other.overlap(a, "n1") == 0,
                  f"Dynamo with kv_block_size {2 * BT}: every block dropped ({dynamo_other.dropped}), nothing scored")
            for seq in seqs:
                if seq > before_fill:
                    llmd.consume(b"kv@n1@m", full[seq])
                    dynamo.consume("n1", full[seq])
            dyn_live = {ext for ext, n in dynamo.nodes.items() if n["workers"]}
            check(dyn_live <= live and len(dyn_live) >= len(live) - len(expected["salt"]),
                  f"Dynamo: after evictions its tree holds the node's blocks ({len(dyn_live)} of {len(live)})")
            on_node = {rk for rk, e in llmd.pods.items() if ("n1", "cpu") in e}
            check(cached - len(expected["salt"]) <= len(on_node) <= cached,
                  f"llm-d: after evictions its index holds the node's cached blocks ({len(on_node)} keys for {cached} "
                  "blocks; it ignores the cache salt, so a salted chain shares the plain one's keys)")
            fill_keys = [k for k in range(5) if all(
                i in live for i in vllm_ids([1000 * (k + 1) + t for t in range(17)]))]
            check(all(llmd.hits([1000 * (k + 1) + t for t in range(17)], "m", "n1") == 4 for k in fill_keys),
                  "llm-d: the fill prompts still cached score all 4 blocks")

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
        daemon = start_daemon(kvd, tmp, "c", fmt="vllm-map", extra="  replay_topic_frame: false\n")
        sub = Subscriber(ctx, f"ipc://{tmp}/events")
        time.sleep(0.3)
        with Client(daemon.target, worker_name="ev-map") as c:
            with c.request("m1", pool="m", prompt=a, adapter="lora-x") as r:
                r.publish(a)
        got = replay_settled(ctx, f"ipc://{tmp}/replay", 0, topic_frame=False)
        batches = [msgpack.unpackb(got[s], raw=False) for s in sorted(got)]
        check(len(got) > 0, "replay_topic_frame: false answers [seq, payload] (vLLM before 0.26)")
        check(batches and all(isinstance(b, dict) and set(b) == {"ts", "events", "data_parallel_rank"} for b in batches),
              "map format: batches are maps of ts, events, data_parallel_rank")
        evs = [e for b in batches for e in b["events"]]
        st = [e for e in evs if e.get("type") == "BlockStored"]
        check(st and all(set(e) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                   "medium", "lora_name"} for e in st), "map format: BlockStored fields by name")
        check(all(e["lora_name"] == "lora-x" for e in st) and
              [i for e in st for i in e["block_hashes"]] == expected["lora"],
              "map format: the same ids, and lora_name the adapter")
        dm = DynamoIndexer(BT)
        for seq in sorted(got):
            dm.consume("n1", got[seq])
        check(dm.overlap(a, "n1", "lora-x") == 4, "map format: Dynamo's decoder reads it (the adapter's 4 blocks score)")
        daemon.stop()
        prove_media(kvd, tmp, ctx)
        prove_topics(kvd, tmp, ctx)
        prove_hybrid(kvd, tmp, ctx)
        prove_window_tombstone(kvd, tmp, ctx)
    finally:
        daemon.stop()
        ctx.destroy(0)
        shutil.rmtree(tmp, ignore_errors=True)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
