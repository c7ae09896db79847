"""The reference hybrid model on kvd's memory (docs/hybrid.md §2.10): TinyHybrid in the
continuous-batching engine (kvd.engine.hybrid_batch) against a real kvd, with its full-attention
layers in the full group's blocks, its sliding-window layer in the window group's table (only
the window: a read outside it raises) and its recurrent state in the state group's running slot.
Several requests sharing prefixes run in one continuous batch; each one's tokens and float32
logits equal bit for bit (torch.equal, and the SHA-256 of every row) a run of the same prompt on an engine with no cache, at
every position it computed, and the hits happened where the pool's rules put them (a k-grid
checkpoint, End's tail; fewer than k shared blocks: none). Negative controls, each on a hit:
reading one window block too few, one too many, and a stale state (the checkpoint copy skipped)
each change the logits at the first computed position. The same exactness after a preemption
resumed on another worker, after a warm restart (flush to the disk tier, a new kvd reading it; a
generation preempted before the restart resumes after it),
across a hot handoff (kvd --takeover; a request preempted before it resumes after it) and after
a pull from a peer kvd (mutual TLS on loopback). A careless engine whose client closes
mid-generation leaves nothing owned or reserved, and what it published is served exactly.

Pool: 4-token blocks, W = 6 (the window straddles a block), checkpoints every k = 2 blocks with
the tail on, step_tokens 8.

Usage: test_hybrid_engine.py KVD_BINARY [--backend=cuda]   (PYTHONPATH: the build's python/ and
tests/python). With --backend=cuda (the GPU bundle's hybrid_model step, tests/gpu/hybrid_gpu_check.py)
kvd keeps the pool on the GPU, the engine runs the model on the slab's device through kv_tensor,
and the reference runs on the same device."""
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from kvd.client import Client
from kvd.engine.hybrid_batch import HybridBatchEngine, expectation
from kvd.engine.hybrid_model import HybridConfig, TinyHybrid, local_hybrid_kv, row_digests
from kvd_testlib import Daemon, check, finish

import kvd.v1.kvd_pb2 as pb

BT, K, MAX_NEW = 4, 2, 4
CFG = HybridConfig()
MODEL = TinyHybrid(CFG)


def pool_yaml(name="hy", extra=""):
    caps = {"full": ("capacity_blocks", 96), "swa": ("capacity_blocks", 48), "rec": ("capacity_slots", 32)}
    lines = []
    for g in expectation(CFG, name, K)["groups"]:  # the pool's format is the groups' (float32, 2 x 8)
        key, n = caps[g["name"]]
        lines.append("      - " + json.dumps(dict(g, **{key: n})))
    return (f"pools:\n  - name: {name}\n    block_tokens: {BT}\n    num_layers: 4\n"
            f"    bytes_per_token_per_layer: {CFG.bytes_per_token}\n    max_model_len: 64\n    dtype: float32\n"
            f"    kv_heads: {CFG.kv_heads}\n    head_dim: {CFG.head_dim}\n    kv_arrangement: token_kv_head_dim\n"
            f"    step_tokens: 8\n{extra}    groups:\n" + "\n".join(lines) + "\n")


def base(n, start=1, step=7):
    return [(start + step * i) % CFG.vocab for i in range(n)]


A = base(18)                      # 21 positions computed: checkpoints at 8, 16, End's tail at 20
E = base(22, 5, 11)               # another chain in the same batch
B = A[:17] + base(6, 40)          # shares A's 4 blocks: hits the checkpoint at 16
C = A[:6] + base(9, 60)           # shares 1 block (fewer than k): no hit
D = A[:8] + base(7, 30)           # shares 2 blocks: hits the checkpoint at 8
_reference = {}


def reference(prompt):
    """(logits of every position, new tokens) on an engine with no cache, on the same device."""
    key = tuple(prompt)
    if key not in _reference:
        kv = local_hybrid_kv(MODEL.cfg, BT, len(prompt) + MAX_NEW, device=MODEL.device)
        _reference[key] = MODEL.generate(kv, prompt, 0, MAX_NEW)
    return _reference[key]


def exact(result, prompt):
    """Tokens and every computed position's logits equal the no-cache run's, bit for bit."""
    ref_logits, ref_new = reference(prompt)
    got = result["logits"]
    want = ref_logits[result["first_computed"]:]
    return (result["tokens"] == ref_new and got is not None and torch.equal(got, want) and
            row_digests(got) == row_digests(want))


def first_row_differs(result, prompt):
    ref = reference(prompt)[0][result["first_computed"]]
    return not torch.equal(result["logits"][0], ref)


def counts(client, pool="hy"):
    p = next(p for p in client.report().pools if p.name == pool)
    return p.owned_blocks, p.reserved_blocks


def main(argv):
    global MODEL
    kvd, cuda = argv[1], "--backend=cuda" in argv[2:]
    with tempfile.TemporaryDirectory() as tmp:
        d = Daemon(kvd, tmp, pool_yaml(), extra=["--backend=cuda"] if cuda else [])
        check(d.started, f"kvd serves the reference model's hybrid pool ({'cuda' if cuda else 'host'} backend)")
        if not d.started:
            return finish()
        try:
            # The resuming worker: another client on the host backend; on CUDA the same one (a
            # process opens a CUDA IPC handle once).
            with Client(d.target, expect=[expectation(CFG, "hy", K)]) as c, \
                    (contextlib.nullcontext(c) if cuda else
                     Client(d.target, worker_name="python-2", expect=[expectation(CFG, "hy", K)])) as c2:
                device = str(c.kv_tensor("hy", group="full", dtype=torch.float32, inner_shape=CFG.kv_inner_shape).device)
                check(device.startswith("cuda") == cuda, f"the pool's slab is on {device}")
                if device != "cpu":
                    MODEL = TinyHybrid(CFG, device=device)
                reuse(c)
                negative_controls(c)
                preempt_resume(c, c2)
                if not cuda:
                    careless_engine(d.target, c)
        finally:
            d.stop()
        if not cuda:  # the host backend's: tiers, a host handoff, peers on loopback
            warm_restart(kvd, tmp)
            handoff(kvd, tmp)
            peer_pull(kvd, tmp)
    return finish()


def reuse(c):
    eng = HybridBatchEngine(c, "hy", MODEL, token_budget=12, max_running=4)
    eng.submit("A", A, MAX_NEW)
    eng.submit("E", E, MAX_NEW)
    out = eng.run()
    for rid, prompt in (("A", A), ("E", E)):
        check(out[rid]["cached_tokens"] == 0 and exact(out[rid], prompt),
              f"{rid}: cold, in one batch with another: tokens and logits equal the no-cache run bit for bit")
    kept = [(n, o) for n, o in out["A"]["checkpoints"] if o == pb.CHECKPOINT_KEPT]
    check(kept == [(8, 0), (16, 0), (20, 0)], f"A's checkpoints at 8 and 16 (the k-grid) and End's tail at 20 are kept "
          f"({out['A']['checkpoints']})")
    check(out["A"]["max_first_window"] >= 3, f"A's grows reported computed tokens: its window table moved on "
          f"(first block {out['A']['max_first_window']})")

    turn = A + out["A"]["tokens"][:3] + base(5, 70)   # A's next turn: its 21 tokens and more
    eng = HybridBatchEngine(c, "hy", MODEL, token_budget=12, max_running=4)
    for rid, prompt in (("B", B), ("C", C), ("D", D), ("T", turn)):
        eng.submit(rid, prompt, MAX_NEW)
    out = eng.run()
    for rid, prompt, hit, why in (("B", B, 16, "A's checkpoint at 16"), ("D", D, 8, "A's checkpoint at 8"),
                                  ("T", turn, 20, "A's tail at 20"), ("C", C, 0, "nothing: 1 block < k")):
        r = out[rid]
        window = max(0, hit // BT - CFG.window_blocks(BT))
        check(r["cached_tokens"] == hit and r["first_computed"] == hit and r["window_at_start"] == window,
              f"{rid} hits {why}, its window table from block {window} ({r['cached_tokens']}, {r['window_at_start']})")
        check(exact(r, prompt), f"{rid}: tokens and the logits of positions {hit}.. equal the no-cache run bit for bit")
    check(counts(c) == (c.step_credit("hy"),) * 2, f"nothing stays owned or reserved but credit ({counts(c)})")


def negative_controls(c):
    """Each on a hit at 16 in its own namespace (salt): A computed correctly, then B with a fault."""
    for i, (name, kwargs) in enumerate((("one window block too few", {"window_fault_blocks": -1}),
                                        ("one window block too many", {"window_fault_blocks": 1}),
                                        ("a stale state (the checkpoint copy skipped)", {"skip_checkpoint_copy": True}))):
        salt = f"control-{i}"
        eng = HybridBatchEngine(c, "hy", MODEL)
        eng.submit("A", A, MAX_NEW, salt=salt)
        eng.run()
        bad = HybridBatchEngine(c, "hy", MODEL, **kwargs)
        bad.submit("B", B, MAX_NEW, salt=salt)
        r = bad.run()["B"]
        check(r["cached_tokens"] == 16 and first_row_differs(r, B),
              f"negative control, {name}: the hit's first computed position's logits differ")
    eng = HybridBatchEngine(c, "hy", MODEL)
    eng.submit("B", B, MAX_NEW, salt="control-0")
    r = eng.run()["B"]
    check(r["cached_tokens"] == 16 and exact(r, B), "the controls' prefix served to a correct engine is exact")


def preempt_resume(c, c2):
    """P is preempted between decode positions on one worker (its running slot named as the state
    at its 19 positions, off a block boundary) and resumed on worker c2 (another one, or the same),
    which copies the state kvd answers into its running slot; Q runs beside it throughout. Both
    are exact."""
    eng = HybridBatchEngine(c, "hy", MODEL, token_budget=12)
    eng.submit("P", A, MAX_NEW, salt="preempt")
    eng.submit("Q", E, MAX_NEW, salt="preempt")
    eng.run(until=lambda e: any(g.rid == "P" and len(g.generated) == 2 for g in e.running))
    eng.preempt("P")
    other = HybridBatchEngine(c2, "hy", MODEL, token_budget=12)
    other.waiting.append(eng.waiting.pop())
    q = eng.run()["Q"]
    r = other.run()["P"]
    check(r["preemptions"] == 1 and r["cached_tokens"] == 0 and r["resumed_at"] == 19,
          f"P was preempted once and resumed at its 19 positions ({r['preemptions']}, {r['resumed_at']})")
    where = "the same worker" if c2 is c else "another worker"
    check(exact(r, A), f"P, preempted at 19 tokens and resumed on {where}: tokens and logits bit for bit")
    check(exact(q, E), "Q, in the batch beside it: bit for bit")


def careless_engine(target, observer):
    """An engine whose client closes mid-generation, without ending its requests (one past its
    checkpoint at 8, one in its first chunk): nothing stays owned or reserved, and what it
    published is served exactly to the next engine (B hits the checkpoint at 8)."""
    others = counts(observer)  # the other workers' block credit, which stays
    careless = Client(target, worker_name="careless", expect=[expectation(CFG, "hy", K)])
    eng = HybridBatchEngine(careless, "hy", MODEL)
    eng.submit("A", A, MAX_NEW, salt="careless")
    eng.submit("E", E, MAX_NEW, salt="careless")
    eng.run(until=lambda e: e.steps >= 3)
    live = counts(observer)
    careless.close()
    deadline = time.monotonic() + 5
    left = counts(observer)
    while left != others and time.monotonic() < deadline:  # its detach may land after close() returns
        time.sleep(0.02)
        left = counts(observer)
    check(live[0] > others[0] and left == others, f"a client closed mid-generation leaves nothing owned or reserved ({live} -> {left})")
    eng = HybridBatchEngine(observer, "hy", MODEL)
    eng.submit("B", B, MAX_NEW, salt="careless")
    r = eng.run()["B"]
    check(r["cached_tokens"] == 8 and exact(r, B),
          f"what it published (the checkpoint at 8) is served bit for bit ({r['cached_tokens']})")


def handoff(kvd, tmp):
    """A hot handoff (kvd --takeover): A's prefix published and P preempted under the old kvd; under
    the new one B hits A's checkpoint at 16 and P resumes from its checkpoint, both exact."""
    d = Daemon(kvd, tmp, pool_yaml(), name="handoff")
    successor = None
    try:
        with Client(d.target, expect=[expectation(CFG, "hy", K)]) as c:
            eng = HybridBatchEngine(c, "hy", MODEL, token_budget=12)
            eng.submit("A", A, MAX_NEW)
            eng.submit("P", D, MAX_NEW, salt="handoff")
            eng.run(until=lambda e: any(g.rid == "P" and len(g.generated) == 2 for g in e.running))
            eng.preempt("P")
            parked = eng.waiting.pop()
            eng.run()
            epoch = c.epoch
            os.remove(os.path.join(tmp, "handoff.ready"))
            successor = Daemon(kvd, tmp, pool_yaml(), name="handoff", extra=["--takeover"])
            check(successor.started and d.proc.wait(timeout=30) == 0, "the successor took over; the old kvd exited 0")
            c.wait_attached(10)
            check(c.epoch == epoch + 1, "the client re-attached to the successor")
            eng = HybridBatchEngine(c, "hy", MODEL, token_budget=12)
            eng.submit("B", B, MAX_NEW)
            eng.waiting.append(parked)
            out = eng.run()
            check(out["B"]["cached_tokens"] == 16 and exact(out["B"], B),
                  f"after the handoff B hits A's checkpoint at 16, bit for bit ({out['B']['cached_tokens']})")
            check(out["P"]["preemptions"] == 1 and out["P"]["resumed_at"] == 16 and exact(out["P"], D),
                  f"P, preempted at 16 before the handoff, resumes there after it bit for bit ({out['P']['resumed_at']})")
    finally:
        for x in (successor, d):
            if x is not None and x.proc.poll() is None:
                x.stop()


def warm_restart(kvd, tmp):
    """A's prefix flushed to the disk tier with P preempted (its generation checkpoint: full and
    window blocks and the state slot); kvd stopped and started again on the same disk_dir (warm
    restart); B hits A's checkpoint at 16 promoted from disk and P resumes from its restored
    checkpoint, both bit for bit."""
    disk = os.path.join(tmp, "disk")
    config = pool_yaml() + f"tiers:\n  host_bytes: 4194304\n  disk_dir: {disk}\n"
    d = Daemon(kvd, tmp, config, name="warm")
    try:
        with Client(d.target, expect=[expectation(CFG, "hy", K)]) as c:
            eng = HybridBatchEngine(c, "hy", MODEL, token_budget=12)
            eng.submit("A", A, MAX_NEW)
            eng.submit("P", D, MAX_NEW, salt="warm")
            eng.run(until=lambda e: any(g.rid == "P" and len(g.generated) == 2 for g in e.running))
            eng.preempt("P")
            parked = eng.waiting.pop()
            eng.run()
            check(c.flush().durable, "the flush is durable")
            tiers = c.report().tiers
            check(tiers.pending_checkpoints == 0, f"P's checkpoint is on disk ({tiers.pending_checkpoints} pending)")
    finally:
        d.stop()
    os.remove(os.path.join(tmp, "warm.ready"))
    d = Daemon(kvd, tmp, config, name="warm")
    try:
        with Client(d.target, expect=[expectation(CFG, "hy", K)]) as c:
            eng = HybridBatchEngine(c, "hy", MODEL, token_budget=12)
            eng.submit("B", B, MAX_NEW)
            eng.waiting.append(parked)
            out = eng.run()
            check(out["B"]["cached_tokens"] == 16 and exact(out["B"], B),
                  f"after a warm restart B hits A's checkpoint at 16 from disk, bit for bit ({out['B']['cached_tokens']})")
            check(out["P"]["preemptions"] == 1 and out["P"]["resumed_at"] == 16 and exact(out["P"], D),
                  f"P, preempted at 16 before the restart, resumes there after it bit for bit ({out['P']['resumed_at']})")
    finally:
        d.stop()


CERTS = r"""set -e
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=kvd-peer-ca -keyout ca.key -out ca.pem 2>/dev/null
for who in node-a node-b; do
  openssl req -newkey rsa:2048 -nodes -subj /CN=$who -keyout $who.key -out $who.csr 2>/dev/null
  printf 'subjectAltName=DNS:%s\n' $who > $who.ext
  openssl x509 -req -in $who.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile $who.ext -out $who.pem 2>/dev/null
done
"""


def transfer_yaml(tmp, name, peer, address):
    return (f"transfer:\n  listen: \"127.0.0.1:0\"\n  tls_cert_file: {tmp}/{name}.pem\n  tls_key_file: {tmp}/{name}.key\n"
            f"  tls_ca_file: {tmp}/ca.pem\n  peers:\n    - {{name: {peer}, address: \"{address}\"}}\n")


def peer_pull(kvd, tmp):
    """Two daemons joined by the peers' mutual-TLS channel on loopback (port 0): A computes A's
    prompt; on node B, B's start names node-a as its peer, kvd B pulls A's full and window blocks
    and the checkpoint at 16, and B's tokens and logits equal the no-cache run bit for bit."""
    subprocess.run(["/bin/sh", "-c", CERTS], cwd=tmp, check=True)
    # A never pulls: its peer entry only allows node-b to pull from it.
    a = Daemon(kvd, tmp, pool_yaml() + transfer_yaml(tmp, "node-a", "node-b", "127.0.0.1:9"), name="node-a")
    b = None
    try:
        check(a.started, "node A serves with a transfer section")
        with open(os.path.join(tmp, "node-a.ready")) as f:
            port = json.load(f)["transfer"].rsplit(":", 1)[1]
        b = Daemon(kvd, tmp, pool_yaml() + transfer_yaml(tmp, "node-b", "node-a", f"127.0.0.1:{port}"), name="node-b")
        check(b.started, "node B serves, pulling from node A")
        with Client(a.target, expect=[expectation(CFG, "hy", K)]) as ca:
            eng = HybridBatchEngine(ca, "hy", MODEL)
            eng.submit("A", A, MAX_NEW)
            eng.run()
        with Client(b.target, expect=[expectation(CFG, "hy", K)]) as cb:
            eng = HybridBatchEngine(cb, "hy", MODEL, peer="node-a")
            eng.submit("B", B, MAX_NEW)
            r = eng.run()["B"]
            check(r["cached_tokens"] == 16 and exact(r, B),
                  f"B on node B hits A's checkpoint at 16 pulled from node A, bit for bit ({r['cached_tokens']})")
    finally:
        for x in (b, a):
            if x is not None and x.proc.poll() is None:
                x.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
