#include "server/core/worker_table.h"

namespace kvd {

uint32_t WorkerTable::Index(const WorkerId& worker) {
  if (worker.empty()) return 0;
  auto [it, inserted] = index_.try_emplace(worker, 0);
  if (!inserted) return it->second;
  if (!free_.empty()) {
    it->second = free_.back();
    free_.pop_back();
    names_[it->second] = worker;
  } else {
    it->second = static_cast<uint32_t>(names_.size());
    names_.push_back(worker);
  }
  return it->second;
}

void WorkerTable::Forget(const WorkerId& worker) {
  auto it = index_.find(worker);
  if (it == index_.end()) return;
  names_[it->second] = WorkerId();
  free_.push_back(it->second);
  index_.erase(it);
}

void WorkerTable::AddUsage(const WorkerId& worker, int64_t requests, int64_t bytes) {
  Usage& u = usage_[worker];
  u.requests += requests;
  u.reserved_bytes += bytes;
  if (u.requests == 0 && u.reserved_bytes == 0) usage_.erase(worker);
}

WorkerTable::Usage WorkerTable::usage(const WorkerId& worker) const {
  auto it = usage_.find(worker);
  return it == usage_.end() ? Usage{} : it->second;
}

}  // namespace kvd
