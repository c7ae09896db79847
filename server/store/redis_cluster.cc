#include "server/store/redis_cluster.h"

#include <hiredis/hiredis.h>

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvd {
namespace {

uint16_t Crc16Xmodem(absl::string_view data) {
  uint16_t crc = 0;
  for (unsigned char byte : data) {
    crc ^= static_cast<uint16_t>(byte) << 8;
    for (int bit = 0; bit < 8; ++bit) {
      crc = (crc & 0x8000) != 0 ? static_cast<uint16_t>((crc << 1) ^ 0x1021) : static_cast<uint16_t>(crc << 1);
    }
  }
  return crc;
}

}  // namespace

absl::StatusOr<RedisEndpoint> ParseRedisEndpoint(absl::string_view text) {
  const size_t colon = text.rfind(':');
  RedisEndpoint ep;
  if (colon == absl::string_view::npos || colon == 0 || !absl::SimpleAtoi(text.substr(colon + 1), &ep.port) ||
      ep.port <= 0 || ep.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("want host:port, not '", text, "'"));
  }
  ep.host = std::string(text.substr(0, colon));
  if (ep.host.size() > 2 && ep.host.front() == '[' && ep.host.back() == ']') ep.host = ep.host.substr(1, ep.host.size() - 2);
  return ep;
}

uint16_t RedisKeySlot(absl::string_view key) {
  if (const size_t open = key.find('{'); open != absl::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != absl::string_view::npos && close > open + 1) key = key.substr(open + 1, close - open - 1);
  }
  return Crc16Xmodem(key) % kRedisClusterSlots;
}

std::optional<RedisRedirect> ParseRedisRedirect(absl::string_view error) {
  const std::vector<absl::string_view> parts = absl::StrSplit(error, ' ', absl::SkipEmpty());
  if (parts.size() != 3 || (parts[0] != "MOVED" && parts[0] != "ASK")) return std::nullopt;
  RedisRedirect r;
  r.ask = parts[0] == "ASK";
  if (!absl::SimpleAtoi(parts[1], &r.slot) || r.slot < 0 || r.slot >= kRedisClusterSlots) return std::nullopt;
  absl::StatusOr<RedisEndpoint> to = ParseRedisEndpoint(parts[2]);
  if (!to.ok()) return std::nullopt;
  r.to = *std::move(to);
  return r;
}

absl::StatusOr<RedisSlotMap> RedisSlotMap::FromClusterSlots(const redisReply& reply, const std::string& asked_host) {
  if (reply.type != REDIS_REPLY_ARRAY) return absl::InvalidArgumentError("CLUSTER SLOTS: not an array");
  RedisSlotMap map;
  for (size_t i = 0; i < reply.elements; ++i) {
    const redisReply* range = reply.element[i];
    if (range->type != REDIS_REPLY_ARRAY || range->elements < 3 || range->element[0]->type != REDIS_REPLY_INTEGER ||
        range->element[1]->type != REDIS_REPLY_INTEGER || range->element[2]->type != REDIS_REPLY_ARRAY ||
        range->element[2]->elements < 2 || range->element[2]->element[1]->type != REDIS_REPLY_INTEGER) {
      return absl::InvalidArgumentError(absl::StrCat("CLUSTER SLOTS: range ", i, " is malformed"));
    }
    const long long first = range->element[0]->integer;
    const long long last = range->element[1]->integer;
    if (first < 0 || last >= kRedisClusterSlots || first > last) {
      return absl::InvalidArgumentError(absl::StrCat("CLUSTER SLOTS: bad range ", first, "-", last));
    }
    const redisReply* master = range->element[2];
    RedisEndpoint ep;
    if (master->element[0]->type == REDIS_REPLY_STRING && master->element[0]->len > 0) {
      ep.host.assign(master->element[0]->str, master->element[0]->len);
    } else {
      ep.host = asked_host;  // "" or NULL: the node that answered
    }
    ep.port = static_cast<int>(master->element[1]->integer);
    auto it = std::find(map.masters_.begin(), map.masters_.end(), ep);
    const int16_t index = static_cast<int16_t>(it - map.masters_.begin());
    if (it == map.masters_.end()) map.masters_.push_back(ep);
    std::fill(map.owner_.begin() + first, map.owner_.begin() + last + 1, index);
  }
  return map;
}

const RedisEndpoint* RedisSlotMap::MasterOf(uint16_t slot) const {
  const int16_t i = owner_[slot % kRedisClusterSlots];
  return i < 0 ? nullptr : &masters_[static_cast<size_t>(i)];
}

int64_t RedisSlotMap::served_slots() const {
  return std::count_if(owner_.begin(), owner_.end(), [](int16_t o) { return o >= 0; });
}

}  // namespace kvd
