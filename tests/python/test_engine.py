"""The engine proof: a real attention model (kvd.engine) whose paged KV cache is kvd's slab memory,
run as real worker processes against real daemons. Reuse must be exact: the float32 logits (bit
for bit) and greedy tokens of a worker that hits kvd's cache equal those of the same prompts with
an empty cache — for hits of one block, many blocks and the capped case, under eviction pressure,
from the host tier, from the disk tier after a restart and from Redis on a second daemon; adapters and salts never share KV; a
worker SIGKILLed after a checkpoint is resumed by another to the same sequence; a layout bug is
caught; and the Python client gives back what an Acquire failure would otherwise leak.

Usage: test_engine.py KVD_BINARY   (PYTHONPATH = the build's python/ directory)"""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from kvd_testlib import Daemon, check, finish

import grpc
from kvd.client import Client, KvdError
from kvd.v1 import kvd_pb2

# block_tokens 4; per token and layer K and V of 2 kv heads x 8 dims, float32 (the model's Config).
POOL = ("pools:\n  - name: default\n    block_tokens: 4\n    num_layers: 2\n"
        "    bytes_per_token_per_layer: 128\n    capacity_blocks: {cap}\n    max_model_len: 256\n"
        "    dtype: float32\n    kv_heads: 2\n    head_dim: 8\n    kv_arrangement: token_kv_head_dim\n")


def base(n, start=1):
    return [(start + 7 * i) % 97 for i in range(n)]


P = base(24)  # six full blocks
FIRST = [{"id": "seed", "prompt": P, "max_new": 4}]
# Hits of one block, of several blocks, and the capped case (all 24 tokens known: 20 reused, the
# last block recomputed so that one token is left to compute).
SECOND = [
    {"id": "one-block", "prompt": P[:4] + base(7, 50), "max_new": 4},
    {"id": "many-blocks", "prompt": P[:20] + base(3, 60), "max_new": 5},
    {"id": "all-but-one", "prompt": P, "max_new": 6},
]
EXPECT_CACHED = {"one-block": 4, "many-blocks": 20, "all-but-one": 20}


def run_worker(target, requests, *flags):
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for r in requests:
            f.write(json.dumps(r) + "\n")
        path = f.name
    out = subprocess.run([sys.executable, "-m", "kvd.engine.worker", "--pool", "default", "--target", target, "--prompts", path, *flags],
                         capture_output=True, text=True, timeout=300)
    os.unlink(path)
    if out.returncode != 0:
        print(out.stderr)
    return {r["id"]: r for r in map(json.loads, out.stdout.split("\n")[:-1])} if out.returncode == 0 else {}


def prove_resume(kvd, tmp):
    """A worker SIGKILLed right after a checkpoint; another resumes: the same sequence."""
    d = Daemon(kvd, tmp, POOL.format(cap=128), name="resume")
    try:
        req = {"id": "gen", "prompt": base(10, 5), "max_new": 9, "checkpoint_every": 3}
        full = run_worker(d.target, [dict(req, id="gen-whole")]).get("gen-whole", {})
        dead = subprocess.run([sys.executable, "-m", "kvd.engine.worker", "--pool", "default", "--target", d.target,
                               "--die-after-checkpoints", "2"], input=json.dumps(req) + "\n",
                              capture_output=True, text=True, timeout=300)
        check(dead.returncode == -9 and "died_after_checkpoints" in dead.stdout,
              "the first worker dies (SIGKILL) right after its second checkpoint")
        resumed = run_worker(d.target, [dict(req, resume=True)]).get("gen", {})
        check(resumed.get("resumed") is True, "the second worker resumes the checkpoint")
        check(len(full.get("tokens", [])) == 9 and resumed.get("tokens") == full.get("tokens"),
              f"the resumed sequence equals an uninterrupted run's ({resumed.get('tokens')})")
    finally:
        d.stop()


def prove_resume_wait(kvd, tmp):
    """A resume while the previous worker's request is still live: Admit waits for it to end
    instead of answering ALREADY_EXISTS. The first worker hangs (SIGSTOP) after a checkpoint, so
    its request lives until its 1 s lease lapses; the resume, sent at once, still succeeds."""
    d = Daemon(kvd, tmp, POOL.format(cap=128), name="resume-wait", extra=["--lease-ttl=1"])
    hung = None
    try:
        req = {"id": "hang", "prompt": base(10, 9), "max_new": 9, "checkpoint_every": 2}
        full = run_worker(d.target, [dict(req, id="hang-whole")]).get("hang-whole", {})
        # The probe attaches before the worker starts, so that only its one Report has to land
        # between the hang and the lapse of the hung worker's 1 s lease.
        with Client(d.target, worker_name="probe") as c:
            hung = subprocess.Popen([sys.executable, "-m", "kvd.engine.worker", "--pool", "default",
                                     "--target", d.target, "--stop-after-checkpoints", "1"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            hung.stdin.write(json.dumps(req) + "\n")
            hung.stdin.close()
            check("stopped_after_checkpoints" in hung.stdout.readline(),
                  "the first worker hangs after a checkpoint")
            check(c.report().live_requests == 1, "its request is still live")
            start = time.monotonic()
            admit = c._rpc("Admit", kvd_pb2.AdmitRequest(
                worker_id=c.worker_id, request_id="hang", namespace=kvd_pb2.Namespace(pool="default"),
                prompt=req["prompt"], max_new_tokens=9, resume_from="hang"))
            check(admit.admitted, f"a resume sent while it is live is admitted once the lease lapses "
                                  f"(waited {time.monotonic() - start:.2f} s) instead of ALREADY_EXISTS")
            # Admitted, not acquired: giving it back leaves the checkpoint for the engine worker.
            c._rpc("Release", kvd_pb2.ReleaseRequest(worker_id=c.worker_id, request_id="hang", completed=False))
        resumed = run_worker(d.target, [dict(req, resume=True)]).get("hang", {})
        check(resumed.get("resumed") is True and resumed.get("tokens") == full.get("tokens"),
              f"then the engine worker continues the checkpoint exactly ({resumed.get('tokens')})")
        # A live owner that never lets go: the wait ends (bounded) with ALREADY_EXISTS, and a
        # worker resuming its own live request is told at once.
        with Client(d.target, worker_name="owner") as a, Client(d.target, worker_name="other") as b:
            with a.request("held", "default", base(8, 2), max_new_tokens=2):
                for who, client in (("another worker", b), ("the owner", a)):
                    try:
                        client.request("held", "default", base(8, 2), resume_from="held")
                        check(False, f"{who} cannot resume a request that stays live")
                    except KvdError as e:
                        check(e.code == grpc.StatusCode.ALREADY_EXISTS,
                              f"{who} resuming a live request: ALREADY_EXISTS ({e.details})")
            check(a.report().live_requests == 0, "nothing is left live")
    finally:
        if hung is not None:
            hung.kill()
            hung.wait()
        d.stop()


# A writer whose attach stream breaks while its process lives on (its channel closed under the
# stream, no Detach), then stops itself: kvd cannot tell that it will write nothing more.
FENCED_WRITER = """
import os, signal, sys
from kvd import Client
c = Client(sys.argv[1], worker_name="fenced-writer")
prompt = [int(t) for t in sys.argv[2].split(",")]
r = c.request("fenced", "default", prompt, max_new_tokens=9)
r.extend(1)
r.checkpoint(prompt + [5], b"\\x07\\x00\\x00\\x00")
c._channel.close()
print("broken", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def prove_resume_after_fenced_writer(kvd, tmp):
    """A checkpoint whose writer lost its attach stream alive has its tail block fenced: the
    writer could still write it. Once the writer is killed, a resume sent at once takes the whole
    checkpoint back: the resume itself sees that the writer's process has ended and lifts its
    fences (server/rpc/ended_writers.h), instead of recomputing the tail block until the reaper
    (every second at a 4 s lease) looks again."""
    d = Daemon(kvd, tmp, POOL.format(cap=128), name="resume-fenced", extra=["--lease-ttl=4"])
    writer = None
    try:
        prompt = base(10, 5)
        with Client(d.target, worker_name="probe") as c:
            writer = subprocess.Popen([sys.executable, "-c", FENCED_WRITER, d.target, ",".join(map(str, prompt))],
                                      stdout=subprocess.PIPE, text=True)
            line = writer.stdout.readline().split()
            check(line[:1] == ["broken"], f"fenced: the writer checkpoints, then breaks its stream alive ({line})")
            deadline = time.monotonic() + 10
            while c.report().live_requests != 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            check(c.report().live_requests == 0, "fenced: kvd ended the writer's request when its stream broke")
            writer.kill()
            writer.wait()
            writer = None
            r = c.request("fenced", "default", prompt, max_new_tokens=9, resume_from="fenced", wait_s=5)
            with r:
                check(r.resumed and len(r.resumed_tokens) == len(prompt) + 1, "fenced: the resume takes the checkpoint")
                check(r.cached_tokens == len(r.resumed_tokens),
                      f"fenced: every checkpointed position comes back, the fenced tail block too "
                      f"({r.cached_tokens} of {len(r.resumed_tokens)})")
    finally:
        if writer is not None:
            writer.kill()
            writer.wait()
        d.stop()


def prove_pressure(kvd, tmp):
    """A pool too small for the work: blocks are evicted and reused all along, outputs stay exact."""
    d = Daemon(kvd, tmp, POOL.format(cap=24), name="small")
    try:
        reqs = [{"id": f"p{i}-{k}", "prompt": base(4 * (i % 3) + 12, 11 * i % 97), "max_new": 4}
                for k in range(2) for i in range(8)]
        hot = run_worker(d.target, reqs)
        cold = run_worker(d.target, [dict(r, id=r["id"] + "-cold", salt="cold-" + r["id"]) for r in reqs])
        reused = sum(1 for r in reqs if hot.get(r["id"], {}).get("cached_tokens", 0) > 0)
        check(reused > 0, f"requests reuse blocks under pressure ({reused} of {len(reqs)})")
        check(len(hot) == len(reqs) and all(hot[r["id"]]["digest"] == cold.get(r["id"] + "-cold", {}).get("digest")
                                            for r in reqs),
              "every output under eviction equals a cold run's, bit for bit")
    finally:
        d.stop()


def prove_tiers(kvd, tmp):
    """The prefix comes back from the host tier, then from the disk tier after a restart."""
    disk = os.path.join(tmp, "disk")
    config = POOL.format(cap=128) + f"tiers:\n  host_bytes: 1048576\n  disk_dir: {disk}\n"
    want = run_worker_cold(kvd, tmp, SECOND[1])
    d = Daemon(kvd, tmp, config, name="tiers")
    try:
        run_worker(d.target, FIRST)
        with Client(d.target, worker_name="ops") as c:
            freed = c._rpc("Gc", kvd_pb2.GcRequest()).blocks_freed  # device -> host tier
        check(freed > 0, f"gc moves the prefix to the host tier ({freed} blocks)")
        got = run_worker(d.target, [dict(SECOND[1], id="from-host")]).get("from-host", {})
        check(got.get("cached_tokens") == 20 and got.get("digest") == want,
              "a prefix promoted from the host tier gives the same logits, bit for bit")
        with Client(d.target, worker_name="ops") as c:
            check(c.flush().durable, "the flush is durable")
    finally:
        d.stop()
    d = Daemon(kvd, tmp, config, name="tiers2")
    try:
        got = run_worker(d.target, [dict(SECOND[1], id="from-disk")]).get("from-disk", {})
        check(got.get("cached_tokens") == 20 and got.get("digest") == want,
              "after a restart, a prefix read back from the disk tier gives the same logits, bit for bit")
    finally:
        d.stop()


def prove_redis(kvd, tmp):
    """The prefix comes from Redis (G4) on a second daemon that never saw it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    redis = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                              "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL)
    want = run_worker_cold(kvd, tmp, SECOND[1])
    config = POOL.format(cap=128) + f"tiers:\n  redis_url: redis://127.0.0.1:{port}\n"
    a = Daemon(kvd, tmp, config, name="node-a")
    b = Daemon(kvd, tmp, config, name="node-b")
    try:
        run_worker(a.target, FIRST)
        got = {}
        for _ in range(100):  # uploads are write-behind: wait until node B finds the prefix
            got = run_worker(b.target, [dict(SECOND[1], id="from-redis")]).get("from-redis", {})
            if got.get("cached_tokens") == 20:
                break
            with Client(b.target, worker_name="ops") as c:  # forget what this try computed
                c._rpc("Gc", kvd_pb2.GcRequest())
            time.sleep(0.1)
        check(got.get("cached_tokens") == 20 and got.get("digest") == want,
              "on a second daemon, a prefix fetched from Redis gives the same logits, bit for bit")
    finally:
        a.stop()
        b.stop()
        redis.terminate()
        redis.wait(timeout=10)


def prove_format(kvd, tmp):
    """The pool declares what its bytes mean; a worker that assumes otherwise cannot attach, and
    neither can an operator's config whose numbers do not add up."""
    d = Daemon(kvd, tmp, POOL.format(cap=16), name="format")
    try:
        with Client(d.target, worker_name="format") as c:
            p = c.pool("default")
            check((p.dtype, p.kv_heads, p.head_dim, p.kv_arrangement) == ("float32", 2, 8, "token_kv_head_dim"),
                  "ListPools shows the declared dtype, heads and arrangement")
            t = c.kv_tensor("default")
            check(tuple(t.shape) == (2, 16, 4, 2, 2, 8) and str(t.dtype) == "torch.float32",
                  f"kv_tensor() takes dtype and shape from the declaration ({tuple(t.shape)})")
            del t
        good = {"pool": "default", "dtype": "float32", "kv_heads": 2, "head_dim": 8,
                "kv_arrangement": "token_kv_head_dim", "block_tokens": 4, "layout": "layer_major"}
        wrong = [({"dtype": "bfloat16"}, grpc.StatusCode.FAILED_PRECONDITION, "dtype"),
                 ({"kv_heads": 8}, grpc.StatusCode.FAILED_PRECONDITION, "kv_heads"),
                 ({"head_dim": 128}, grpc.StatusCode.FAILED_PRECONDITION, "head_dim"),
                 ({"kv_arrangement": "kv_token_head_dim"}, grpc.StatusCode.FAILED_PRECONDITION, "kv_arrangement"),
                 ({"block_tokens": 16}, grpc.StatusCode.FAILED_PRECONDITION, "block_tokens"),
                 ({"layout": "block_major"}, grpc.StatusCode.FAILED_PRECONDITION, "layout"),
                 # The pool declares no model: it cannot promise a worker the weights it computes with.
                 ({"model_fingerprint": "tiny@v2"}, grpc.StatusCode.FAILED_PRECONDITION, "model_fingerprint"),
                 ({"pool": "llama-70b"}, grpc.StatusCode.NOT_FOUND, "llama-70b"),
                 ({"pool": ""}, grpc.StatusCode.INVALID_ARGUMENT, "pool")]
        for change, code, word in wrong:
            try:
                with Client(d.target, worker_name="mismatch", expect=[dict(good, **change)]):
                    check(False, f"a worker expecting {change} is refused")
            except KvdError as e:
                check(e.code == code and word in e.details, f"expecting {change}: {e.code.name} naming {word}")
        with Client(d.target, worker_name="matching", expect=[good]) as c:
            check(c.report().live_requests == 0, "a worker whose expectation matches attaches; refusals left nothing")
    finally:
        d.stop()
    # A pool that declares nothing meets no expectation: the reference worker refuses to run on it.
    bare = POOL.format(cap=16).split("    dtype:")[0]
    d = Daemon(kvd, tmp, bare, name="undeclared")
    try:
        out = subprocess.run([sys.executable, "-m", "kvd.engine.worker", "--pool", "default", "--target", d.target],
                             input=json.dumps(FIRST[0]) + "\n", capture_output=True, text=True, timeout=120)
        check(out.returncode != 0 and "(undeclared)" in out.stderr,
              "the engine worker refuses a pool that does not declare its format")
    finally:
        d.stop()
    # A careless prompt file: ids outside the vocabulary, not JSON, no prompt. Each line is answered
    # with an error naming it (no traceback), the good line is still served, the exit status is 1.
    d = Daemon(kvd, tmp, POOL.format(cap=16), name="badinput")
    try:
        lines = ['{"id": "big", "prompt": [1, 2, 97]}', "not json", '{"id": "empty", "prompt": []}',
                 '{"id": "neg", "prompt": [-1]}', json.dumps(dict(FIRST[0], id="fine"))]
        out = subprocess.run([sys.executable, "-m", "kvd.engine.worker", "--pool", "default", "--target", d.target],
                             input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120)
        answers = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
        errors = [a["error"] for a in answers if "error" in a]
        check(out.returncode == 1 and "Traceback" not in out.stderr and len(errors) == 4
              and "token id 97 is outside the model's vocabulary 0..96" in errors[0] and "not JSON" in errors[1]
              and any(a.get("id") == "fine" and a.get("tokens") for a in answers),
              f"bad prompt lines are named and skipped, the good one served ({out.stdout.strip()[-600:]} {out.stderr[-300:]})")
        with Client(d.target, worker_name="after") as c:
            check(c.report().live_requests == 0, "the refused lines left no request behind")
    finally:
        d.stop()
    helped = subprocess.run([sys.executable, "-m", "kvd.engine.worker", "--help"], capture_output=True, text=True)
    check(helped.returncode == 0 and "one JSON object a line" in helped.stdout and "0..96" in helped.stdout
          and "tiny-engine" in helped.stdout, "--help describes the input, the vocabulary and the pool")
    # Operator typos: numbers that do not add up, an unknown dtype, a misspelt key.
    for bad, word in (("kv_heads: 2", "kv_heads: 3"), ("float32", "float31"), ("head_dim: 8", "head_dims: 8")):
        path = os.path.join(tmp, "typo.yaml")
        with open(path, "w") as f:
            f.write(POOL.format(cap=16).replace(bad, word))
        out = subprocess.run([kvd, "--config=" + path, "--print-config"], capture_output=True, text=True, timeout=30)
        check(out.returncode == 2 and ("pools[0]" in out.stderr or "pool 'default'" in out.stderr),
              f"a config with '{word}' is refused, naming the pool ({out.stderr.strip()})")


def run_worker_cold(kvd, tmp, req):
    d = Daemon(kvd, tmp, POOL.format(cap=128), name="reference")
    try:
        return run_worker(d.target, [dict(req, id="reference")]).get("reference", {}).get("digest")
    finally:
        d.stop()


def main():
    kvd = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        warm = Daemon(kvd, tmp, POOL.format(cap=128), name="warm")
        cold = Daemon(kvd, tmp, POOL.format(cap=128), name="cold")
        try:
            # Two worker processes on one daemon: the second reuses the first's prefix blocks.
            seeded = run_worker(warm.target, FIRST)
            check(seeded.get("seed", {}).get("cached_tokens") == 0, "the first worker computes its whole prompt")
            hit = run_worker(warm.target, SECOND)
            # The same prompts with nothing cached: a fresh daemon, and a salt of their own each
            # (a salt selects a namespace; it does not change the model), so that they do not
            # reuse each other's blocks either.
            miss = run_worker(cold.target, [dict(r, salt="cold-" + r["id"]) for r in SECOND])
            for r in SECOND:
                rid = r["id"]
                h, m = hit.get(rid, {}), miss.get(rid, {})
                check(h.get("cached_tokens") == EXPECT_CACHED[rid],
                      f"{rid}: {EXPECT_CACHED[rid]} prompt tokens come from kvd (got {h.get('cached_tokens')})")
                check(m.get("cached_tokens") == 0, f"{rid}: nothing cached on the cold daemon")
                check(h.get("digest") is not None and h.get("digest") == m.get("digest"),
                      f"{rid}: float32 logits with reuse equal those without, bit for bit")
                check(h.get("tokens") == m.get("tokens") and len(h.get("tokens", [])) == r["max_new"],
                      f"{rid}: greedy tokens equal ({h.get('tokens')})")

            # Namespaces: the same prompt under another adapter or salt reuses nothing, and its
            # output is what that model computes from scratch (and differs from the base model's).
            for key, value in (("adapter", "lora-a"), ("salt", "tenant-b")):
                req = dict(SECOND[2], id=f"ns-{key}", **{key: value})
                h = run_worker(warm.target, [req]).get(req["id"], {})
                m = run_worker(cold.target, [dict(req, id=f"ns-{key}-cold")]).get(f"ns-{key}-cold", {})
                check(h.get("cached_tokens") == 0, f"another {key} reuses no KV of the base namespace")
                check(h.get("digest") == m.get("digest"), f"another {key}: output equals a cold run's")
            adapted = run_worker(cold.target, [dict(SECOND[2], id="adapted", adapter="lora-a")]).get("adapted", {})
            check(adapted.get("digest") != miss.get("all-but-one", {}).get("digest"),
                  "an adapter changes the model's output (so sharing KV across adapters would show)")

            # The check can fail: reading the reused prefix from the wrong layer changes the answer.
            wrong = run_worker(warm.target, [dict(SECOND[1], id="wrong-stride")], "--wrong-layer-stride")
            check(wrong.get("wrong-stride", {}).get("cached_tokens") == 20, "the layout-bug run reuses the prefix")
            check(wrong.get("wrong-stride", {}).get("digest") not in (None, miss.get("many-blocks", {}).get("digest")),
                  "a wrong layer stride on reused KV is caught by the exactness check")

            # The Python client gives back an admitted request whose Acquire fails: a resume whose
            # prompt does not extend the checkpoint.
            with Client(warm.target, worker_name="leak-check") as c:
                r = c.request("ck", "default", base(9, 3), max_new_tokens=4)
                r.extend(1)
                r.checkpoint(base(9, 3) + [5], b"\x07\x00\x00\x00")
                r.release(completed=False)
                try:
                    c.request("ck", "default", base(9, 40), resume_from="ck")
                    check(False, "a resume with the wrong prompt fails")
                except KvdError as e:
                    check(e.code != grpc.StatusCode.OK, f"a resume with the wrong prompt fails ({e.code.name})")
                check(c.report().live_requests == 0, "nothing stays admitted after the failed Acquire")
                with c.request("ck", "default", base(9, 3) + [5], resume_from="ck") as again:
                    check(again.resumed, "the retry with the right prompt resumes (the id was given back)")
                    check(again.pool == "default" and again.pool_id == 0, "Request.pool is the pool's name")
                # The two-round-trip path: request() is one Start; end() publishes and releases.
                r = c.request("fast", "default", base(9, 70), max_new_tokens=2)
                ended = r.end(publish_blocks=2)
                check(ended.kept == 2 and c.report().live_requests == 0, "Request.end publishes 2 blocks and releases")
                raised = None
                try:
                    r.release()
                except KvdError as e:
                    raised = e
                check(raised is None, f"release after end is a no-op ({raised})")
        finally:
            warm.stop()
            cold.stop()
        prove_format(kvd, tmp)
        prove_resume(kvd, tmp)
        prove_resume_wait(kvd, tmp)
        prove_resume_after_fenced_writer(kvd, tmp)
        prove_pressure(kvd, tmp)
        prove_tiers(kvd, tmp)
        if shutil.which("redis-server"):
            prove_redis(kvd, tmp)
        else:
            check(False, "redis-server is installed (scripts/test.sh installs it)")
    return finish()


if __name__ == "__main__":
    sys.exit(main())
