// SideQueue orders the evictable units of one group of a hybrid pool other than its spine group
// (docs/hybrid.md §2.8): cached blocks or checkpoint slots that nothing references. KvCache pushes a
// unit when its last reference goes and erases it when it is referenced again or leaves the cache;
// the group's pressure takes Victim().
//
// Two segments, each oldest first:
//   hot      - units in release order: every state checkpoint and further full group's block, and
//              the window blocks a hit at a chain's end, at an anchor (HybridSpine::WindowAnchor)
//              or a past hit reads (a request releasing the window blocks its hit referenced files
//              them here anew, as newest);
//   interior - the other window blocks: no hit has read them and none at a chain end or an anchor
//              would (MakeInterior), in the order they became interior.
// Victim() is the oldest interior block while there is one, then the oldest hot unit: interior
// blocks go first, oldest first, so a recent chain's interior outlives an old chain's and every
// block that a hit has read or that a hit at a chain end or anchor would read outlives them all.
// Every operation is O(1): list splices and one hash lookup, no scan.
// Thread-compatible: the caller (KvCache, under its engine lock) serializes access.
#pragma once

#include <cstdint>
#include <list>

#include "absl/container/flat_hash_map.h"
#include "proto/vocab/types.h"

namespace kvd {

class SideQueue {
 public:
  // REQUIRES: !contains(index). Files it as the newest hot unit.
  void Push(BlockIndex index) { where_[index] = Entry{hot_.insert(hot_.end(), index), false}; }
  // REQUIRES: contains(index).
  void Erase(BlockIndex index) {
    auto it = where_.find(index);
    (it->second.interior ? interior_ : hot_).erase(it->second.at);
    where_.erase(it);
  }
  // Files a queued hot unit as the newest interior block; no-op when the unit is not queued
  // (referenced or freed) or already interior.
  void MakeInterior(BlockIndex index) {
    auto it = where_.find(index);
    if (it == where_.end() || it->second.interior) return;
    interior_.splice(interior_.end(), hot_, it->second.at);
    it->second.interior = true;
  }
  bool contains(BlockIndex index) const { return where_.contains(index); }
  bool interior(BlockIndex index) const {
    auto it = where_.find(index);
    return it != where_.end() && it->second.interior;
  }
  int64_t size() const { return static_cast<int64_t>(where_.size()); }
  bool empty() const { return where_.empty(); }
  int64_t interior_size() const { return static_cast<int64_t>(interior_.size()); }
  // The hot segment, oldest first (a state group's or further full group's whole queue).
  const std::list<BlockIndex>& hot() const { return hot_; }
  // The unit pressure takes first. REQUIRES: !empty().
  BlockIndex Victim() const { return interior_.empty() ? hot_.front() : interior_.front(); }

 private:
  struct Entry {
    std::list<BlockIndex>::iterator at;
    bool interior = false;
  };
  std::list<BlockIndex> hot_;
  std::list<BlockIndex> interior_;
  absl::flat_hash_map<BlockIndex, Entry> where_;
};

}  // namespace kvd
