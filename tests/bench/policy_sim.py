#!/usr/bin/env python3
"""Eviction-policy candidates on a Mooncake trace, simulated at the trace's 512-token blocks.

Written to choose kvd's horizon policy (docs/architecture.md, "Eviction"): every candidate runs
in the same leaf-first prefix cache (a block is evictable when no cached block extends it; the
request being served holds its blocks), so the figures are comparable with each other and, for
lru and slru, with kvd_core_replay --block-tokens=512. Token-weighted hit rate, one-token cap.

  tests/bench/policy_sim.py ../shared/data/mooncake-fast25/conversation_trace.jsonl [capacities]

Clocks count blocks stored; horizons are in pool capacities. Pure Python: about a minute per
trace and capacity for all candidates.
"""
import collections
import heapq
import json
import math
import sys


class Segment:
    """Blocks ordered by (stamp, serial), oldest and newest reachable; lazy deletion."""

    def __init__(self):
        self.low, self.high, self.live = [], [], {}

    def push(self, key, stamp):
        self.live[key] = stamp
        heapq.heappush(self.low, (stamp, key))
        heapq.heappush(self.high, ((-stamp[0], -stamp[1]), key))

    def remove(self, key):
        self.live.pop(key, None)

    def _top(self, heap, negated):
        while heap:
            stamp, key = heap[0]
            if negated:
                stamp = (-stamp[0], -stamp[1])
            if self.live.get(key) == stamp:
                return stamp, key
            heapq.heappop(heap)
        return None

    def oldest(self):
        return self._top(self.low, False)

    def newest(self):
        return self._top(self.high, True)


class Policy:
    """Two segments (probation: never reused; main: reused or remembered) and a victim rule."""

    def __init__(self, cap, victim, ghosts=4.0, priority=None):
        self.cap, self.victim, self.ghosts, self.priority = cap, victim, ghosts, priority
        self.seg = [Segment(), Segment()]
        self.uses = collections.Counter()
        self.L = 0.0  # GreedyDual's inflation
        self.share = 0.5
        self.gone = {}

    def stamp(self, key, clock, serial):
        if self.priority is None:
            return (clock, serial)
        return (self.priority(self, key, clock), serial)


def rule_lru(p, now):
    """The oldest block of either segment (plain LRU when nothing is ever promoted)."""
    ends = [(s, e) for s, e in ((0, p.seg[0].oldest()), (1, p.seg[1].oldest())) if e]
    return min(ends, key=lambda se: se[1][0]) if ends else None


def rule_slru(p, now):
    prob, main = p.seg
    o, om = prob.oldest(), main.oldest()
    n_main, n_all = len(main.live), len(main.live) + len(prob.live)
    if om and (n_main > p.share * n_all or not o):
        return 1, om
    return o and (0, o)


def rule_horizon(probation, main_h):
    def rule(p, now):
        prob, main = p.seg
        o, om = prob.oldest(), main.oldest()
        if o and now - o[0][0] > probation * p.cap:
            return 0, o
        if om and now - om[0][0] > main_h * p.cap:
            return 1, om
        n = prob.newest()
        if n:
            return 0, n
        n = main.newest()
        return n and (1, n)
    return rule


def simulate(trace, cap, make):
    """Leaf-first prefix cache of `cap` blocks; `make(cap)` builds the policy. Returns hit rate."""
    p = make(cap)
    parent, children, cached, last, seg_of, seen = {}, collections.Counter(), set(), {}, {}, {}
    total = hit = clock = serial = 0
    for r in trace:
        ids, full = r["hash_ids"], r["input_length"] // 512
        limit = (r["input_length"] - 1) // 512
        total += r["input_length"]
        h = 0
        while h < limit and ids[h] in cached:
            h += 1
        hit += h * 512
        for j in range(full):
            x = ids[j]
            p.uses[x] += 1
            if x in cached:
                p.seg[0].remove(x)
                p.seg[1].remove(x)
                seg_of[x] = 1
                if hasattr(p, "on_hit"):
                    p.on_hit(x, clock - last[x])
            else:
                cached.add(x)
                clock += 1
                parent[x] = ids[j - 1] if j else None
                if j:
                    children[ids[j - 1]] += 1
                ghost = seen.get(x)
                seg_of[x] = 1 if ghost is not None and clock - ghost <= p.ghosts * cap else 0
                if x in p.gone and hasattr(p, "on_ghost"):
                    p.on_ghost(p.gone.pop(x))
            seen[x] = clock
        if hasattr(p, "on_request"):
            p.on_request(ids[:full], clock, seg_of)
        busy = set(ids[:full])
        for x in busy:
            last[x] = clock
        while len(cached) > cap:
            v = p.victim(p, clock)
            if not v:
                break
            s, (stamp, x) = v
            p.seg[s].remove(x)
            cached.discard(x)
            p.L = stamp[0]
            p.gone[x] = s
            if hasattr(p, "on_evict"):
                p.on_evict(x, s, clock - last[x])
            pa = parent.pop(x)
            if pa is not None:
                children[pa] -= 1
                if children[pa] == 0 and pa in cached and pa not in busy:
                    serial += 1
                    p.seg[seg_of[pa]].push(pa, p.stamp(pa, last[pa], serial))
        for x in ids[:full]:
            serial += 1
            if children[x] == 0:
                p.seg[seg_of[x]].push(x, p.stamp(x, clock, serial))
    return hit / total


def make_duel(probation=0.01, main_h=4.0, sample=32, margin=1.1, memory=4.0):
    """The horizon policy: SLRU's rule or the horizon rule, by sampled shadow caches."""
    horizon = rule_horizon(probation, main_h)

    def make(cap):
        p = Policy(cap, None)
        shadows = [Policy(max(cap // sample, 1), rule_slru), Policy(max(cap // sample, 1), horizon)]
        decay = 1 - 1 / (memory * shadows[0].cap)
        score = [0.0, 0.0]

        def on_request(keys, clock, seg_of):
            for x in keys:
                if hash((x, 7)) % sample:
                    continue
                for k, s in enumerate(shadows):
                    score[k] *= decay
                    s.serial = getattr(s, "serial", 0) + 1
                    if x in s.seg[0].live or x in s.seg[1].live:
                        score[k] += 1
                        s.seg[0].remove(x)
                        s.seg[1].remove(x)
                        s.seg[1].push(x, (clock, s.serial))
                        continue
                    s.seg[seg_of[x]].push(x, (clock, s.serial))
                    while len(s.seg[0].live) + len(s.seg[1].live) > s.cap:
                        seg, (_, y) = s.victim(s, clock)
                        s.seg[seg].remove(y)
            p.victim = horizon if score[1] > margin * score[0] else rule_slru

        p.on_request = on_request
        p.victim = rule_slru
        return p
    return make


def make_arc(step=0.003):
    """SLRU whose main share follows ghost hits (ARC's adaptation)."""
    def make(cap):
        p = Policy(cap, rule_slru)

        def on_ghost(segment):
            p.share = min(0.98, p.share + step) if segment == 1 else max(0.05, p.share - step)
        p.on_ghost = on_ghost
        return p
    return make


def make_lhd(buckets=64, scale=0.25, decay=0.9):
    """Hit density by (segment, age) learned from hit and eviction ages; the lower end goes."""
    def make(cap):
        p = Policy(cap, None)
        width = max(1, int(cap * scale))
        hits = [[0.0] * buckets for _ in range(2)]
        ends = [[0.0] * buckets for _ in range(2)]
        density = [[1.0 - a / buckets for a in range(buckets)] for _ in range(2)]
        events = [0]

        def bucket(age):
            return min(buckets - 1, age // width)

        def tick():
            events[0] += 1
            if events[0] % max(1, cap // 2):
                return
            for s in (0, 1):
                h = e = life = 0.0
                for a in range(buckets - 1, -1, -1):
                    h += hits[s][a]
                    e += hits[s][a] + ends[s][a]
                    life += e
                    density[s][a] = h / life if life else 0.0
                hits[s] = [x * decay for x in hits[s]]
                ends[s] = [x * decay for x in ends[s]]

        def on_hit(key, age):
            hits[1][bucket(age)] += 1  # counted for the segment it ends in; simple and stable
            tick()

        def on_evict(key, segment, age):
            ends[segment][bucket(age)] += 1
            tick()

        def victim(pp, now):
            best = None
            for s in (0, 1):
                for end in (pp.seg[s].oldest(), pp.seg[s].newest()):
                    if end:
                        d = density[s][bucket(now - end[0][0])]
                        if best is None or d < best[0]:
                            best = (d, s, end)
            return best and (best[1], best[2])

        p.on_hit, p.on_evict, p.victim = on_hit, on_evict, victim
        return p
    return make


CANDIDATES = {
    "lru": lambda cap: Policy(cap, rule_lru, ghosts=0),
    "slru": lambda cap: Policy(cap, rule_slru),
    "slru, ghosts unbounded": lambda cap: Policy(cap, rule_slru, ghosts=1e9),
    "recency + 1 capacity per reuse": lambda cap: Policy(
        cap, rule_lru, priority=lambda p, k, clock: clock + p.cap * min(p.uses[k] - 1, 3)),
    "GreedyDual (L + uses)": lambda cap: Policy(cap, rule_lru, priority=lambda p, k, clock: p.L + p.uses[k]),
    "ARC-adapted share": make_arc(),
    "LHD-style density": make_lhd(),
    "horizon order only, probation horizon 2": lambda cap: Policy(cap, rule_horizon(2.0, 4.0)),
    "horizon (duel), probation horizon 2": make_duel(probation=2.0),
    "horizon order only (probation horizon 0.01)": lambda cap: Policy(cap, rule_horizon(0.01, 4.0)),
    "horizon (duel; kvd's defaults)": make_duel(),
}


def main():
    path = sys.argv[1]
    caps = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "1000000,3000000,10000000").split(",")]
    trace = [json.loads(line) for line in open(path) if line.strip()]
    print("| candidate | " + " | ".join(f"{c / 1e6:g}M" for c in caps) + " |")
    print("|---|" + "---|" * len(caps))
    for name, make in CANDIDATES.items():
        rates = [simulate(trace, c // 512, make) for c in caps]
        print(f"| {name} | " + " | ".join(f"{100 * r:.2f} %" for r in rates) + " |", flush=True)


if __name__ == "__main__":
    main()
