#include "server/core/policy_duel.h"

#include <algorithm>

namespace kvd {

PolicyDuel::PolicyDuel(const Options& options) : options_(options) {
  // A big pool samples more sparsely, so that a shadow stays small enough to sit in cache.
  options_.sample_every = std::max({int64_t{1}, options_.sample_every, options.capacity_blocks / kMaxShadowKeys});
  capacity_ = std::max<int64_t>(1, options.capacity_blocks / options_.sample_every);
  decay_ = 1 - 1 / (std::max(options_.memory, 0.01) * static_cast<double>(capacity_));
  threshold_ = UINT64_MAX / static_cast<uint64_t>(options_.sample_every);
  shadows_[0].order = EvictionQueue::Order::kRecency;
  shadows_[1].order = EvictionQueue::Order::kHorizon;
}

void PolicyDuel::Access(const BlockKey& key, bool reused, uint64_t clock) {
  if (!Sampled(key)) return;
  for (Shadow& s : shadows_) {
    s.score *= decay_;
    Touch(s, key, reused, clock);
  }
}

void PolicyDuel::Touch(Shadow& s, const BlockKey& key, bool reused, uint64_t clock) {
  const Stamp stamp{clock, ++serial_};
  auto it = s.entries.find(key);
  if (it != s.entries.end()) {  // a hit in this shadow: the key moves to main, newest
    s.score += 1;
    s.segments[it->second.main].erase(it->second.stamp);
    it->second = Entry{true, stamp};
    s.segments[1].emplace(stamp, key);
    return;
  }
  s.entries.emplace(key, Entry{reused, stamp});
  s.segments[reused].emplace(stamp, key);
  while (static_cast<int64_t>(s.entries.size()) > capacity_) EvictOne(s, clock);
}

void PolicyDuel::EvictOne(Shadow& s, uint64_t clock) {
  auto& probation = s.segments[0];
  auto& main = s.segments[1];
  // The shadow's clock runs at the pool's pace while it holds 1/sample_every of the keys, so the
  // horizons (in the pool's stored blocks) apply unscaled.
  auto overdue = [clock](const absl::btree_map<Stamp, BlockKey>& seg, int64_t horizon) {
    return !seg.empty() && static_cast<int64_t>(clock - seg.begin()->first.first) > horizon;
  };
  absl::btree_map<Stamp, BlockKey>* from = nullptr;
  bool newest = false;
  if (s.order == EvictionQueue::Order::kRecency) {
    const double m = static_cast<double>(main.size());
    const double all = m + static_cast<double>(probation.size());
    from = (!main.empty() && (m > options_.main_share * all || probation.empty())) ? &main : &probation;
  } else if (overdue(probation, options_.probation_horizon)) {
    from = &probation;
  } else if (overdue(main, options_.main_horizon)) {
    from = &main;
  } else {
    from = probation.empty() ? &main : &probation;
    newest = true;
  }
  auto victim = newest ? std::prev(from->end()) : from->begin();
  s.entries.erase(victim->second);
  from->erase(victim);
}

}  // namespace kvd
