// GhostList remembers the keys of recently evicted blocks, FIFO-bounded, so that the SLRU policy
// can recognise a block that is stored again soon after it was evicted (and keep it longer).
// Thread-compatible: the caller serializes access.
#pragma once

#include <cstdint>
#include <deque>

#include "absl/container/flat_hash_set.h"
#include "proto/vocab/block_key.h"

namespace kvd {

class GhostList {
 public:
  // Remembers at most `capacity` keys (0: remembers nothing).
  explicit GhostList(int64_t capacity) : capacity_(capacity) {}

  // Remembers `key`; past `capacity` additions, the oldest is forgotten.
  void Add(const BlockKey& key);
  // True, and forgets the key, when `key` is remembered.
  bool Take(const BlockKey& key) { return keys_.erase(key) > 0; }
  int64_t size() const { return static_cast<int64_t>(keys_.size()); }

 private:
  int64_t capacity_;
  absl::flat_hash_set<BlockKey> keys_;
  // Insertion order, at most `capacity_` entries; may hold keys already taken.
  std::deque<BlockKey> order_;
};

}  // namespace kvd
