// Redis Cluster routing without a cluster: hash slots (the values the cluster specification and
// CLUSTER KEYSLOT give), hash tags, MOVED/ASK parsing, and the slot map read from a CLUSTER SLOTS
// reply. tests/integration/redis_cluster_test.cc runs the tier against a real cluster.
#include <hiredis/hiredis.h>

#include <catch2/catch.hpp>

#include "server/store/redis_cluster.h"

namespace kvd {
namespace {

TEST_CASE("Hash slots are CRC16-XMODEM mod 16384, of the hash tag when there is one", "[store][cluster]") {
  REQUIRE(RedisKeySlot("123456789") == 0x31C3 % 16384);  // the specification's CRC16 check value
  REQUIRE(RedisKeySlot("foo") == 12182);                 // CLUSTER KEYSLOT foo
  REQUIRE(RedisKeySlot("{user1000}.following") == RedisKeySlot("{user1000}.followers"));
  REQUIRE(RedisKeySlot("{user1000}.following") == RedisKeySlot("user1000"));
  REQUIRE(RedisKeySlot("foo{}{bar}") == RedisKeySlot("foo{}{bar}"));
  REQUIRE(RedisKeySlot("foo{}{bar}") != RedisKeySlot("bar"));          // an empty first tag: the whole key
  REQUIRE(RedisKeySlot("foo{{bar}}zap") == RedisKeySlot("{bar"));      // the tag ends at the first '}'
  REQUIRE(RedisKeySlot("foo{bar}{zap}") == RedisKeySlot("bar"));       // only the first tag counts
  REQUIRE(RedisKeySlot("") == 0);
}

TEST_CASE("MOVED and ASK name a slot and a node; other errors are not redirections", "[store][cluster]") {
  const std::optional<RedisRedirect> moved = ParseRedisRedirect("MOVED 3999 127.0.0.1:6381");
  REQUIRE(moved.has_value());
  CHECK_FALSE(moved->ask);
  CHECK(moved->slot == 3999);
  CHECK(moved->to == RedisEndpoint{"127.0.0.1", 6381});
  const std::optional<RedisRedirect> ask = ParseRedisRedirect("ASK 16383 ::1:7002");
  REQUIRE(ask.has_value());
  CHECK(ask->ask);
  CHECK(ask->to.host == "::1");
  CHECK(ask->to.port == 7002);
  for (const char* other : {"CLUSTERDOWN The cluster is down", "MOVED 16384 a:1", "MOVED x a:1", "ASK 1 a",
                            "TRYAGAIN Multiple keys request during rehashing of slot", "OOM command not allowed"}) {
    INFO(other);
    CHECK_FALSE(ParseRedisRedirect(other).has_value());
  }
}

// A redisReply tree built by hand, as hiredis would decode CLUSTER SLOTS.
struct FakeReply {
  redisReply r{};
  std::vector<std::unique_ptr<FakeReply>> kids;
  std::vector<redisReply*> ptrs;
  std::string text;
  static std::unique_ptr<FakeReply> Int(long long v) {
    auto f = std::make_unique<FakeReply>();
    f->r.type = REDIS_REPLY_INTEGER;
    f->r.integer = v;
    return f;
  }
  static std::unique_ptr<FakeReply> Str(std::string s) {
    auto f = std::make_unique<FakeReply>();
    f->text = std::move(s);
    f->r.type = REDIS_REPLY_STRING;
    f->r.str = f->text.data();
    f->r.len = f->text.size();
    return f;
  }
  static std::unique_ptr<FakeReply> Arr(std::vector<std::unique_ptr<FakeReply>> items) {
    auto f = std::make_unique<FakeReply>();
    f->kids = std::move(items);
    for (auto& k : f->kids) f->ptrs.push_back(&k->r);
    f->r.type = REDIS_REPLY_ARRAY;
    f->r.elements = f->ptrs.size();
    f->r.element = f->ptrs.data();
    return f;
  }
};

std::unique_ptr<FakeReply> Range(long long first, long long last, std::string host, long long port) {
  std::vector<std::unique_ptr<FakeReply>> master;
  master.push_back(FakeReply::Str(std::move(host)));
  master.push_back(FakeReply::Int(port));
  master.push_back(FakeReply::Str("id"));
  std::vector<std::unique_ptr<FakeReply>> range;
  range.push_back(FakeReply::Int(first));
  range.push_back(FakeReply::Int(last));
  range.push_back(FakeReply::Arr(std::move(master)));
  return FakeReply::Arr(std::move(range));
}

TEST_CASE("The slot map names each slot's master; an empty host is the node asked", "[store][cluster]") {
  std::vector<std::unique_ptr<FakeReply>> ranges;
  ranges.push_back(Range(0, 5460, "10.0.0.1", 7000));
  ranges.push_back(Range(5461, 10922, "", 7001));
  ranges.push_back(Range(10923, 16000, "10.0.0.3", 7002));
  ranges.push_back(Range(16001, 16383, "10.0.0.1", 7000));
  auto reply = FakeReply::Arr(std::move(ranges));
  absl::StatusOr<RedisSlotMap> map = RedisSlotMap::FromClusterSlots(reply->r, "10.0.0.2");
  REQUIRE(map.ok());
  CHECK(map->masters().size() == 3);
  CHECK(map->served_slots() == 16384);
  CHECK(*map->MasterOf(0) == RedisEndpoint{"10.0.0.1", 7000});
  CHECK(*map->MasterOf(5461) == RedisEndpoint{"10.0.0.2", 7001});
  CHECK(*map->MasterOf(16383) == RedisEndpoint{"10.0.0.1", 7000});

  std::vector<std::unique_ptr<FakeReply>> partial;
  partial.push_back(Range(0, 99, "a", 1));
  auto half = FakeReply::Arr(std::move(partial));
  absl::StatusOr<RedisSlotMap> some = RedisSlotMap::FromClusterSlots(half->r, "a");
  REQUIRE(some.ok());
  CHECK(some->MasterOf(100) == nullptr);  // unserved: the caller fails the call, never guesses

  std::vector<std::unique_ptr<FakeReply>> bad;
  bad.push_back(Range(10, 5, "a", 1));
  auto backwards = FakeReply::Arr(std::move(bad));
  CHECK(RedisSlotMap::FromClusterSlots(backwards->r, "a").status().code() == absl::StatusCode::kInvalidArgument);
  auto not_array = FakeReply::Int(1);
  CHECK(RedisSlotMap::FromClusterSlots(not_array->r, "a").status().code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvd
