// Redis Cluster routing, as the cluster specification defines it (redis.io, "Redis cluster
// specification": key distribution model, hash tags, MOVED and ASK redirection): which of the
// 16,384 hash slots a key belongs to, which master serves each slot (read from CLUSTER SLOTS),
// and what a MOVED or ASK error names. Plain values: no I/O here (remote_tier.h talks to the
// nodes). Thread-compatible.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

struct redisReply;

namespace kvd {

inline constexpr int kRedisClusterSlots = 16384;

struct RedisEndpoint {
  std::string host;
  int port = 0;
  std::string name() const { return host + ":" + std::to_string(port); }
  bool operator==(const RedisEndpoint& o) const { return host == o.host && port == o.port; }
};

// "host:port" or "[v6 address]:port" (split at the last colon); INVALID_ARGUMENT naming the text.
absl::StatusOr<RedisEndpoint> ParseRedisEndpoint(absl::string_view text);

// CRC16-XMODEM of the key, or of its hash tag — the text between the first '{' and the next '}'
// when that is not empty — modulo 16,384.
uint16_t RedisKeySlot(absl::string_view key);

// A node's answer "MOVED <slot> <host>:<port>" (the slot lives there now: refresh the map) or
// "ASK <slot> <host>:<port>" (this one key, once, with ASKING first: the slot is migrating).
struct RedisRedirect {
  bool ask = false;
  int slot = 0;
  RedisEndpoint to;
};
std::optional<RedisRedirect> ParseRedisRedirect(absl::string_view error);

// Which master serves each slot.
class RedisSlotMap {
 public:
  // From a CLUSTER SLOTS reply: [[first, last, [host, port, id, ...], replica..., ], ...]. A master
  // announced with an empty host is reached at `asked_host` (the node that answered).
  // INVALID_ARGUMENT for a reply of another shape.
  static absl::StatusOr<RedisSlotMap> FromClusterSlots(const redisReply& reply, const std::string& asked_host);

  // The master serving `slot`, or nullptr for a slot no node serves.
  const RedisEndpoint* MasterOf(uint16_t slot) const;
  const std::vector<RedisEndpoint>& masters() const { return masters_; }
  int64_t served_slots() const;

 private:
  std::vector<RedisEndpoint> masters_;
  std::vector<int16_t> owner_ = std::vector<int16_t>(kRedisClusterSlots, -1);  // index into masters_
};

}  // namespace kvd
