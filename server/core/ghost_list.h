// GhostList remembers the keys of recently evicted blocks, FIFO-bounded, so that the SLRU policy
// can recognise a block that is stored again soon after it was evicted (and keep it longer).
//
// Fixed-size: a ring of the last `capacity` keys added (at most 2^30) and an open-addressing
// table from each key still remembered to its ring position (KeyTable), so adding and taking
// touch a few cache lines and allocate nothing once the ring is full. A key taken since it was
// added keeps its place in the ring until it falls out (and then forgets that key, should it have
// been added again meanwhile): exactly a FIFO of additions over a set.
// Thread-compatible: the caller serializes access.
#pragma once

#include <cstdint>
#include <vector>

#include "proto/vocab/block_key.h"
#include "server/core/key_table.h"

namespace kvd {

class GhostList {
 public:
  // Remembers at most `capacity` keys (0: remembers nothing).
  explicit GhostList(int64_t capacity);

  // Remembers `key`; past `capacity` additions, the oldest is forgotten.
  void Add(const BlockKey& key);
  // True, and forgets the key, when `key` is remembered.
  bool Take(const BlockKey& key) { return capacity_ > 0 && keys_.Erase(key, KeyAt{this}); }
  int64_t size() const { return keys_.size(); }

 private:
  struct KeyAt {  // a table value is a ring position
    const GhostList* list;
    const BlockKey& operator()(uint32_t pos) const { return list->ring_[pos]; }
  };
  const int64_t capacity_;
  KeyTable keys_;  // remembered keys -> their ring position
  std::vector<BlockKey> ring_;  // insertion order; grows to capacity_, then wraps at next_
  size_t next_ = 0;             // once full: the oldest entry, overwritten by the next Add
};

}  // namespace kvd
