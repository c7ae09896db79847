#include "server/core/policy_duel.h"

#include <algorithm>
#include <limits>

namespace kvd {

PolicyDuel::PolicyDuel(const Options& options) : options_(options) {
  // A big pool samples more sparsely, so that a shadow stays small enough to sit in cache.
  options_.sample_every = std::max({int64_t{1}, options_.sample_every, options.capacity_blocks / kMaxShadowKeys});
  capacity_ = std::max<int64_t>(1, options.capacity_blocks / options_.sample_every);
  decay_ = 1 - 1 / (std::max(options_.memory, 0.01) * static_cast<double>(capacity_));
  threshold_ = UINT64_MAX / static_cast<uint64_t>(options_.sample_every);
  for (Shadow& s : shadows_) {
    s.queue.set_main_limits(options_.main_share, std::numeric_limits<int64_t>::max());
    s.queue.set_horizons(options_.probation_horizon, options_.main_horizon);
  }
  shadows_[0].queue.set_order(EvictionQueue::Order::kRecency);
  shadows_[1].queue.set_order(EvictionQueue::Order::kHorizon);
}

void PolicyDuel::Access(const BlockKey& key, bool reused, uint64_t clock) {
  if (!Sampled(key)) return;
  ++serial_;
  for (Shadow& s : shadows_) {
    s.score *= decay_;
    Touch(s, key, reused, clock);
  }
}

void PolicyDuel::Touch(Shadow& s, const BlockKey& key, bool reused, uint64_t clock) {
  auto [it, stored] = s.blocks.try_emplace(key);
  CachedBlock& b = it->second;
  if (stored) {
    b.key = key;
    b.reused = reused;
  } else {  // a hit in this shadow: the key moves to main, newest
    s.score += 1;
    s.queue.Remove(&b);
    b.reused = true;
  }
  // Accesses are stamped in order, so recency is the access count; ages are in the pool's clock.
  b.serial = serial_;
  b.last_use = serial_;
  b.use_clock = static_cast<uint32_t>(clock);
  s.queue.set_clock(clock);
  s.queue.Push(&b);
  while (static_cast<int64_t>(s.blocks.size()) > capacity_) {
    CachedBlock* victim = s.queue.Peek();
    s.queue.Remove(victim);
    s.blocks.erase(victim->key);
  }
}

}  // namespace kvd
