// InflightIndex: the prompt blocks live requests are computing now (docs/architecture.md,
// "Prefixes in flight"), so that a start whose lookup stops at one learns who computes it and may
// wait for it instead of computing it a second time.
//
// An entry maps a block's chained key (ChainKeys: the key covers the namespace, tenant salt
// included, and every token before it) to the one request that holds that block writable and has
// not published it yet, and the block's position in that request's chain. The first request to
// acquire a position holds it; another request computing the same block meanwhile (it started
// without waiting) holds nothing there. A holder's entries go when it publishes those positions
// (whatever the outcome), and all of them when it ends in any way (end, release, preempt, fence,
// its worker gone). Only prompt blocks are entered: a request's generated tokens are not known at
// start. Resumed requests enter nothing (their prefix is their own checkpoint).
//
// Plain data, no locking: KvCache keeps one under its mutex.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"
#include "proto/vocab/block_key.h"
#include "proto/vocab/types.h"

namespace kvd {

class InflightIndex {
 public:
  // The run of a prober's next blocks one holder computes.
  struct Run {
    RequestId holder;
    uint64_t serial = 0;        // the holder's request serial (a request id may be reused)
    int64_t first = 0;          // position of the first block in flight (the prober's hit, in blocks)
    int64_t blocks = 0;         // consecutive positions from `first` the holder holds
    int64_t holder_first = 0;   // the lowest position the holder still holds (what it published is below)
    std::vector<BlockKey> keys; // the run's keys: what a wait watches
  };

  // Enters keys[from, keys.size()) for the request `serial` (`id`, namespace `ns`); a key another
  // request holds is skipped. Returns how many were entered. REQUIRES: serial holds nothing yet.
  int64_t Hold(uint64_t serial, const RequestId& id, const Namespace& ns, absl::Span<const BlockKey> keys,
               int64_t from);
  // The holder published its chain's positions [0, n): those entries go. Returns how many went.
  int64_t Published(uint64_t serial, int64_t n);
  // The holder ended: every entry of it goes. Returns how many went.
  int64_t End(uint64_t serial);

  // Where a start of namespace `ns` with chain keys `keys` whose lookup stopped at position `from`
  // finds its next blocks in flight: the holder of keys[from] (when it is in `ns`, never another
  // namespace's) and how many positions in a row it holds. nullopt when keys[from] is not in
  // flight or `from` is past the keys.
  std::optional<Run> Probe(const Namespace& ns, absl::Span<const BlockKey> keys, int64_t from) const;
  // Whether `serial` still holds any of `keys`.
  bool HoldsAny(uint64_t serial, absl::Span<const BlockKey> keys) const;

  int64_t size() const { return static_cast<int64_t>(entries_.size()); }
  int64_t holders() const { return static_cast<int64_t>(holders_.size()); }
  // For the invariant checker: calls fn(serial, id, position, key) for every entry.
  template <typename Fn>
  void ForEach(Fn fn) const {
    for (const auto& [serial, h] : holders_) {
      for (const auto& [pos, key] : h.held) fn(serial, h.id, pos, key);
    }
  }

 private:
  struct Entry {
    uint64_t serial = 0;
    int64_t position = 0;
  };
  struct Holder {
    RequestId id;
    Namespace ns;
    std::vector<std::pair<int64_t, BlockKey>> held;  // by position, ascending
  };
  absl::flat_hash_map<BlockKey, Entry> entries_;
  absl::flat_hash_map<uint64_t, Holder> holders_;
};

}  // namespace kvd
