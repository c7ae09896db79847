// Small value types shared by the core: token ids, distinct id types, block addresses.
//
// Ids that cross the API are strings chosen by clients (request ids, session ids) wrapped in
// distinct types so that a session id can never be passed where a request id is expected.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "absl/hash/hash.h"

namespace kvd {

using Token = uint32_t;
using PoolId = uint32_t;      // index of a pool in the cache's pool list
using BlockIndex = uint32_t;  // index of a block inside its pool, [0, capacity_blocks)

// A string id with a tag type, so that ids of different kinds cannot be mixed up.
template <typename Tag>
class StringId {
 public:
  StringId() = default;
  explicit StringId(std::string value) : value_(std::move(value)) {}
  const std::string& value() const { return value_; }
  bool empty() const { return value_.empty(); }
  friend bool operator==(const StringId& a, const StringId& b) { return a.value_ == b.value_; }
  friend bool operator!=(const StringId& a, const StringId& b) { return a.value_ != b.value_; }
  friend bool operator<(const StringId& a, const StringId& b) { return a.value_ < b.value_; }
  template <typename H>
  friend H AbslHashValue(H h, const StringId& id) {
    return H::combine(std::move(h), id.value_);
  }

 private:
  std::string value_;
};

struct RequestIdTag {};
struct SessionIdTag {};
struct WorkerIdTag {};
using RequestId = StringId<RequestIdTag>;
using SessionId = StringId<SessionIdTag>;
using WorkerId = StringId<WorkerIdTag>;

// Where a block lives: its pool and its index inside the pool.
struct BlockAddress {
  PoolId pool = 0;
  BlockIndex index = 0;
  friend bool operator==(const BlockAddress& a, const BlockAddress& b) {
    return a.pool == b.pool && a.index == b.index;
  }
  template <typename H>
  friend H AbslHashValue(H h, const BlockAddress& b) {
    return H::combine(std::move(h), b.pool, b.index);
  }
};

}  // namespace kvd
