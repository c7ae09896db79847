#include "server/core/inflight_index.h"

#include <algorithm>

namespace kvd {

int64_t InflightIndex::Hold(uint64_t serial, const RequestId& id, const Namespace& ns,
                            absl::Span<const BlockKey> keys, int64_t from) {
  std::vector<std::pair<int64_t, BlockKey>> held;
  for (int64_t i = std::max<int64_t>(0, from); i < static_cast<int64_t>(keys.size()); ++i) {
    if (entries_.try_emplace(keys[i], Entry{serial, i}).second) held.emplace_back(i, keys[i]);
  }
  if (held.empty()) return 0;
  Holder& h = holders_[serial];
  h.id = id;
  h.ns = ns;
  h.held = std::move(held);
  return static_cast<int64_t>(h.held.size());
}

int64_t InflightIndex::Published(uint64_t serial, int64_t n) {
  auto it = holders_.find(serial);
  if (it == holders_.end()) return 0;
  auto& held = it->second.held;
  size_t gone = 0;
  while (gone < held.size() && held[gone].first < n) entries_.erase(held[gone++].second);
  held.erase(held.begin(), held.begin() + gone);
  if (held.empty()) holders_.erase(it);
  return static_cast<int64_t>(gone);
}

int64_t InflightIndex::End(uint64_t serial) {
  auto it = holders_.find(serial);
  if (it == holders_.end()) return 0;
  const int64_t gone = static_cast<int64_t>(it->second.held.size());
  for (const auto& [pos, key] : it->second.held) entries_.erase(key);
  holders_.erase(it);
  return gone;
}

std::optional<InflightIndex::Run> InflightIndex::Probe(const Namespace& ns, absl::Span<const BlockKey> keys,
                                                       int64_t from) const {
  if (from < 0 || from >= static_cast<int64_t>(keys.size())) return std::nullopt;
  auto e = entries_.find(keys[from]);
  if (e == entries_.end()) return std::nullopt;
  auto h = holders_.find(e->second.serial);
  // The key covers the namespace; comparing it too means a collision can never name another
  // tenant's request.
  if (h == holders_.end() || !(h->second.ns == ns) || e->second.position != from) return std::nullopt;
  Run run;
  run.holder = h->second.id;
  run.serial = e->second.serial;
  run.first = from;
  run.holder_first = h->second.held.front().first;
  for (int64_t i = from; i < static_cast<int64_t>(keys.size()); ++i) {
    auto f = entries_.find(keys[i]);
    if (f == entries_.end() || f->second.serial != run.serial || f->second.position != i) break;
    run.keys.push_back(keys[i]);
  }
  run.blocks = static_cast<int64_t>(run.keys.size());
  return run;
}

bool InflightIndex::HoldsAny(uint64_t serial, absl::Span<const BlockKey> keys) const {
  for (const BlockKey& k : keys) {
    auto e = entries_.find(k);
    if (e != entries_.end() && e->second.serial == serial) return true;
  }
  return false;
}

}  // namespace kvd
