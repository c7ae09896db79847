#include "server/core/ghost_list.h"

namespace kvd {

void GhostList::Add(const BlockKey& key) {
  if (capacity_ <= 0) return;
  if (keys_.insert(key).second) order_.push_back(key);
  // The FIFO bounds memory; a key taken since it was added simply leaves the order queue later.
  while (static_cast<int64_t>(order_.size()) > capacity_) {
    keys_.erase(order_.front());
    order_.pop_front();
  }
}

}  // namespace kvd
