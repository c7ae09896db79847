#include "server/core/ghost_list.h"

#include <algorithm>

#include "proto/vocab/status_macros.h"

namespace kvd {

GhostList::GhostList(int64_t capacity)
    : capacity_(std::clamp<int64_t>(capacity, 0, int64_t{1} << 30)), keys_(std::min<int64_t>(capacity_, 1 << 16)) {}

void GhostList::Add(const BlockKey& key) {
  if (capacity_ <= 0 || keys_.Find(key, KeyAt{this}) != KeyTable::kNone) return;
  if (static_cast<int64_t>(ring_.size()) < capacity_) {
    ring_.push_back(key);
    KVD_CHECK(keys_.Insert(key, static_cast<uint32_t>(ring_.size() - 1), KeyAt{this}));
    return;
  }
  // The oldest entry goes, and with it its key should that key be remembered (added again after
  // a Take, even this very key: then it is forgotten at once, as a FIFO of additions would).
  if (ring_[next_] == key) {
    next_ = (next_ + 1) % ring_.size();
    return;
  }
  keys_.Erase(ring_[next_], KeyAt{this});
  ring_[next_] = key;
  KVD_CHECK(keys_.Insert(key, static_cast<uint32_t>(next_), KeyAt{this}));
  next_ = (next_ + 1) % ring_.size();
}

}  // namespace kvd
