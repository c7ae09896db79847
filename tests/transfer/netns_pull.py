#!/usr/bin/env python3
"""kvd-transfer end to end: two kvd daemons in two network namespaces joined by a veth pair
(tests/transfer/netns.py), each with its own reference-engine workers (python3 -m
kvd.engine.worker). The engine prefills a prompt on node A; an engine on node B names node-a as
its peer, and kvd B pulls A's blocks over the peers' mutual-TLS channel (across the veth): B's
outputs must be bit-exact (tokens and the SHA-256 of every logit row) against A's cold run, with
the prompt's blocks served as cached. Then the other way round; then an attacker in B's namespace
(tests/transfer/peer_attack.py) tries A as nobody, as a name A does not allow and as B with leases
it does not hold, while A must listen on nothing but its peer and metrics addresses, and A's
cached bytes must be unchanged; then with node A killed: B's engine computes, and its output is
still exact.

Usage: netns_pull.py KVD   (PYTHONPATH holds the kvd package). Root only: exits 77 (skipped)
with the reason otherwise."""
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns  # noqa: E402

SKIPPED = 77


def engine(node, prompts, peer=""):
    lines = "".join(json.dumps(p) + "\n" for p in prompts)
    args = [sys.executable, "-m", "kvd.engine.worker", "--target", node.target, "--name", f"engine-{node.name}"]
    if peer:
        args += ["--peer", peer]
    r = subprocess.run(args, input=lines, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise AssertionError(f"engine on {node.name} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return {o["id"]: o for o in map(json.loads, r.stdout.splitlines())}


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok:", what, flush=True)


def settled(node):
    """The node's leases once the pullers' Releases landed (they go out after each answer)."""
    deadline = time.monotonic() + 10
    n = node.metric("kvd_peer_leases")
    while n != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        n = node.metric("kvd_peer_leases")
    return n


def prompt(seed, n):
    return [(seed * 31 + i * 7) % 97 for i in range(n)]


def main():
    kvd = sys.argv[1]
    reason = netns.why_not()
    if reason:
        print(f"skipped: {reason}")
        return SKIPPED
    with netns.Pair(kvd) as pair:
        a, b = pair.a, pair.b
        p1 = {"id": "p1", "prompt": prompt(1, 200), "max_new": 6}  # 12 full blocks of 16 tokens
        cold = engine(a, [p1])["p1"]
        check(cold["cached_tokens"] == 0, "node A computes the prompt cold")
        pulled = engine(b, [dict(p1, id="p1b")], peer="node-a")["p1b"]
        check(pulled["cached_tokens"] == 192, f"node B serves 192 tokens pulled from A ({pulled['cached_tokens']})")
        check(pulled["tokens"] == cold["tokens"] and pulled["digest"] == cold["digest"],
              "node B's output is bit-exact against A's cold run")
        check(b.metric("kvd_peer_pulled_blocks_total") == 12, "B counts 12 blocks pulled")
        check(a.metric("kvd_peer_offered_blocks_total") == 12, "A counts 12 blocks offered")
        check(settled(a) == 0, "A's lease was released")
        again = engine(b, [dict(p1, id="p1c")])["p1c"]
        check(again["cached_tokens"] == 192 and again["digest"] == cold["digest"],
              "the pulled blocks are B's own cached blocks now")

        # The other way round, and several prompts in one worker (each pulled on its Start).
        batch = [{"id": f"q{i}", "prompt": prompt(10 + i, 150 + 16 * i), "max_new": 4} for i in range(4)]
        cold_b = engine(b, batch)
        pulled_a = engine(a, [dict(p, id=p["id"] + "a") for p in batch], peer="node-b")
        for p in batch:
            got, want = pulled_a[p["id"] + "a"], cold_b[p["id"]]
            check(got["cached_tokens"] == (len(p["prompt"]) - 1) // 16 * 16 and got["digest"] == want["digest"],
                  f"node A pulls {p['id']} from B, bit-exact")

        # What anyone on the network reaches of A: its peer listener (mutual TLS) and /metrics on
        # loopback, nothing else; and through the listener, nothing without an allowed
        # certificate and a lease of one's own.
        listening = set(a.listening())
        allowed = {("tcp", f"{a.ip}:7070"), ("tcp", f"127.0.0.1:{a.metrics_port}")}
        check(listening <= allowed, f"node A listens only on its peer and metrics addresses ({sorted(listening)})")
        attack = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_attack.py")
        r = netns.sh(sys.executable, attack, f"{a.ip}:7070", "node-a", pair.dir, ns=b.ns)
        got = json.loads(r.stdout)
        print("attack:", got, flush=True)
        check(got["nobody:offer"] not in ("OK", "OK_EMPTY") and "OK" not in got["nobody:read"],
              "without a client certificate: no offer, no read")
        check(got["stranger:offer"] == "PERMISSION_DENIED" and got["stranger:read"] == ["PERMISSION_DENIED"],
              "a CA-signed name A does not allow: refused")
        check(got["node-b:read"] == ["NOT_FOUND"], "the allowed peer reads no lease it does not hold")
        after = engine(a, [dict(p1, id="p1-after")])["p1-after"]
        check(after["cached_tokens"] == 192 and after["digest"] == cold["digest"] and after["tokens"] == cold["tokens"],
              "A's cached blocks are unchanged after the attempts")

        # The peer is gone: B's engine computes, still exact, and nothing partial is cached.
        a.proc.kill()
        a.proc.wait()
        p2 = {"id": "p2", "prompt": prompt(2, 120), "max_new": 4}
        gone = engine(b, [p2], peer="node-a")["p2"]
        check(gone["cached_tokens"] == 0, "with node A killed, B computes the prompt")
        fresh = engine(b, [dict(p2, id="p2b")])["p2b"]
        check(fresh["digest"] == gone["digest"] and fresh["cached_tokens"] == 112,
              "B's own run of it is exact (and cached it)")
        check(b.metric('kvd_peer_pulls_total{outcome="offer"}') == 1, "B counts the failed offer")
    print("netns_pull: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
