// EvictionQueue's recency lists and spill answer exactly as one ordered set per tier would, for
// blocks pushed at either end, inside the range, removed from anywhere and moved between tiers.
#include <catch2/catch.hpp>

#include <algorithm>
#include <deque>
#include <map>
#include <random>
#include <set>
#include <utility>

#include "server/core/eviction_queue.h"

namespace kvd {
namespace {

using Key = std::pair<uint64_t, uint64_t>;  // (last_use, serial), the queue's order

Key KeyOf(const CachedBlock* b) { return {b->last_use, b->serial}; }

// The model: one ordered set per tier.
struct Model {
  std::set<Key> tiers[3];
  std::map<Key, CachedBlock*> blocks;
  static int TierOf(const CachedBlock* b) { return b->protect_count > 0 ? 2 : b->reused ? 1 : 0; }
};

void CheckAgainst(const EvictionQueue& q, const Model& m) {
  int64_t total = 0;
  for (int t = 0; t < 3; ++t) {
    const auto tier = static_cast<EvictionQueue::Tier>(t);
    REQUIRE(q.size(tier) == static_cast<int64_t>(m.tiers[t].size()));
    total += q.size(tier);
    if (m.tiers[t].empty()) {
      REQUIRE(q.Oldest(tier) == nullptr);
      REQUIRE(q.Newest(tier) == nullptr);
    } else {
      REQUIRE(KeyOf(q.Oldest(tier)) == *m.tiers[t].begin());
      REQUIRE(KeyOf(q.Newest(tier)) == *m.tiers[t].rbegin());
    }
  }
  REQUIRE(q.size() == total);
}

TEST_CASE("EvictionQueue orders each tier exactly, whatever end or middle a block enters at", "[core][queue]") {
  const uint32_t seed = GENERATE(1u, 2u, 3u);
  std::mt19937 rng(seed);
  EvictionQueue q;
  Model m;
  std::deque<CachedBlock> storage;  // stable addresses
  std::vector<CachedBlock*> queued;
  uint64_t tick = 1000;
  uint64_t serial = 0;
  for (int step = 0; step < 4000; ++step) {
    const int op = static_cast<int>(rng() % 10);
    if (op < 6 || queued.empty()) {
      CachedBlock& b = storage.emplace_back();
      b.serial = ++serial;
      // Mostly the newest (a release) or older than everything (a parent whose leaf went), now and
      // then anywhere inside (a prefix released tail first, an import with its old recency).
      const int where = static_cast<int>(rng() % 4);
      b.last_use = where == 0 ? ++tick : where == 1 ? 1000 - serial : 500 + rng() % 2000;
      b.reused = rng() % 3 == 0;
      b.protect_count = rng() % 8 == 0 ? 1 : 0;
      q.Push(&b);
      m.tiers[Model::TierOf(&b)].insert(KeyOf(&b));
      queued.push_back(&b);
    } else if (op < 9) {  // remove any queued block (a hit, a victim)
      const size_t i = rng() % queued.size();
      CachedBlock* b = queued[i];
      REQUIRE(b->queued);
      q.Remove(b);
      REQUIRE(!b->queued);
      m.tiers[b->queue_tier].erase(KeyOf(b));
      queued[i] = queued.back();
      queued.pop_back();
    } else {  // the victim goes, as KvCache takes it
      CachedBlock* v = q.Peek();
      REQUIRE(v != nullptr);
      const int lowest = !m.tiers[0].empty() ? 0 : !m.tiers[1].empty() ? 1 : 2;
      const int tier = v->queue_tier;
      REQUIRE(KeyOf(v) == *m.tiers[tier].begin());
      REQUIRE(tier == lowest);  // main_share 1.0: the lowest non-empty tier
      q.Remove(v);
      m.tiers[tier].erase(KeyOf(v));
      queued.erase(std::find(queued.begin(), queued.end(), v));
    }
    CheckAgainst(q, m);
  }
  // Blocks entered inside the list's range, so some were spilled; the order held regardless.
  REQUIRE(q.spilled() > 0);
  while (CachedBlock* v = q.Peek()) q.Remove(v);
  REQUIRE(q.size() == 0);
  REQUIRE(q.spilled() == 0);
}

TEST_CASE("EvictionQueue keeps pushes at either end out of its spill", "[core][queue]") {
  std::deque<CachedBlock> storage;
  EvictionQueue q;
  for (uint64_t i = 0; i < 100; ++i) {  // released in order: each the newest
    CachedBlock& b = storage.emplace_back();
    b.serial = i + 1;
    b.last_use = 1000 + i;
    q.Push(&b);
  }
  for (uint64_t i = 0; i < 100; ++i) {  // parents re-queued as their leaves go: each the oldest
    CachedBlock& b = storage.emplace_back();
    b.serial = 200 + i;
    b.last_use = 999 - i;
    q.Push(&b);
  }
  REQUIRE(q.spilled() == 0);
  REQUIRE(q.Peek()->last_use == 900);
  REQUIRE(q.Newest(EvictionQueue::kProbation)->last_use == 1099);
}

}  // namespace
}  // namespace kvd
