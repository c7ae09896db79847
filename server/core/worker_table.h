// WorkerTable is what the cache knows per worker (attachment): a small index recorded in the
// blocks it publishes (so readers can be told whose writes to wait for), and what its live
// requests hold, for per-worker limits.
// Thread-compatible: the caller (KvCache) serializes access.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "proto/vocab/types.h"

namespace kvd {

class WorkerTable {
 public:
  struct Usage {
    int64_t requests = 0;
    int64_t reserved_bytes = 0;
  };

  // The index of `worker` (assigned on first use); 0 for the empty id. A forgotten worker's index
  // is recycled: blocks it published may then name the new holder, which only makes a reader
  // wait longer than needed.
  uint32_t Index(const WorkerId& worker);
  // The worker of an index; empty for 0 or a forgotten worker.
  const WorkerId& Name(uint32_t index) const { return names_[index]; }
  // The worker is gone: its index becomes free (its usage stays until its requests are released).
  void Forget(const WorkerId& worker);

  // Adds (or, negative, removes) live requests and reserved bytes of `worker`.
  void AddUsage(const WorkerId& worker, int64_t requests, int64_t bytes);
  Usage usage(const WorkerId& worker) const;
  const absl::flat_hash_map<WorkerId, Usage>& all_usage() const { return usage_; }

 private:
  absl::flat_hash_map<WorkerId, uint32_t> index_;
  std::vector<WorkerId> names_ = {WorkerId()};  // slot 0 unused
  std::vector<uint32_t> free_;
  absl::flat_hash_map<WorkerId, Usage> usage_;
};

}  // namespace kvd
