#include "server/core/event_log.h"

#include <catch2/catch.hpp>

namespace kvd {
namespace {

CacheEvent Stored(BlockIndex b) {
  CacheEvent e;
  e.kind = CacheEventKind::kStored;
  e.block = b;
  return e;
}

TEST_CASE("EventLog numbers events and replays what a watcher missed", "[core][events]") {
  EventLog log(4);
  for (BlockIndex b = 0; b < 3; ++b) REQUIRE(log.Append(Stored(b)) == b + 1);
  auto r = log.ReadAfter(1, 10);
  REQUIRE_FALSE(r.resync);
  REQUIRE(r.events.size() == 2);
  REQUIRE(r.events[0].sequence == 2);
  REQUIRE(r.events[1].sequence == 3);
  REQUIRE(log.ReadAfter(3, 10).events.empty());
  REQUIRE(log.ReadAfter(0, 2).events.size() == 2);
}

TEST_CASE("EventLog tells a watcher that fell behind to resync", "[core][events]") {
  EventLog log(2);
  for (BlockIndex b = 0; b < 5; ++b) log.Append(Stored(b));
  REQUIRE(log.ReadAfter(1, 10).resync);
  auto r = log.ReadAfter(3, 10);
  REQUIRE_FALSE(r.resync);
  REQUIRE(r.events.size() == 2);
  REQUIRE(r.events[0].sequence == 4);
}

TEST_CASE("EventLog replays every field of an event, payload included", "[core][events]") {
  EventLog log(8);
  CacheEvent e = Stored(7);
  e.time = absl::FromUnixMillis(1234567);
  e.pool = "llama";
  e.adapter = "sql-lora";
  e.key = BlockKey{1, 2};
  e.parent_key = BlockKey{3, 4};
  e.has_parent = true;
  e.block_tokens = 4;
  e.tokens = {10, 11, 12, 13};
  e.medium = "disk";
  log.Append(e);
  CacheEvent removed;
  removed.kind = CacheEventKind::kRemoved;
  removed.pool = "llama";
  removed.key = BlockKey{1, 2};
  log.Append(removed);
  auto r = log.ReadAfter(0, 10);
  REQUIRE(r.events.size() == 2);
  const CacheEvent& got = r.events[0];
  REQUIRE(got.sequence == 1);
  REQUIRE(got.kind == CacheEventKind::kStored);
  REQUIRE(got.time == e.time);
  REQUIRE(got.pool == "llama");
  REQUIRE(got.adapter == "sql-lora");
  REQUIRE(got.key == e.key);
  REQUIRE(got.parent_key == e.parent_key);
  REQUIRE(got.has_parent);
  REQUIRE(got.block == 7);
  REQUIRE(got.block_tokens == 4);
  REQUIRE(got.tokens == e.tokens);
  REQUIRE(got.medium == "disk");
  REQUIRE(r.events[1].kind == CacheEventKind::kRemoved);
  REQUIRE(r.events[1].tokens.empty());
  REQUIRE(r.events[1].adapter.empty());
}

TEST_CASE("EventLog's memory is fixed: long blocks shorten replay, never grow the log", "[core][events]") {
  EventLog log(1024);
  const size_t bytes = log.memory_bytes();
  CacheEvent big = Stored(0);
  big.pool = "m";
  big.tokens.assign(4096, 9);  // 16 KiB of tokens each: the byte ring holds only a few
  uint64_t seq = 0;
  for (int i = 0; i < 100; ++i) {
    big.tokens[0] = static_cast<Token>(i);
    seq = log.Append(big);
  }
  REQUIRE(log.memory_bytes() == bytes);
  REQUIRE(log.ReadAfter(0, 1000).resync);  // its payload was overwritten: resync, not a gap
  auto recent = log.ReadAfter(seq - 2, 10);
  REQUIRE_FALSE(recent.resync);
  REQUIRE(recent.events.size() == 2);
  REQUIRE(recent.events[1].tokens.size() == 4096);
  REQUIRE(recent.events[1].tokens[0] == 99);
  // One event larger than the whole byte ring cannot be replayed whole: resync.
  CacheEvent huge = Stored(1);
  huge.tokens.assign(bytes, 1);
  const uint64_t h = log.Append(huge);
  REQUIRE(log.ReadAfter(h - 1, 10).resync);
  REQUIRE(log.memory_bytes() == bytes);
  // A 16-token block fits kPayloadBytesPerEvent with its names: a full ring of them replays.
  EventLog small(4096);
  CacheEvent b16 = Stored(2);
  b16.pool = "llama-3-8b";
  b16.adapter = "lora";
  b16.tokens.assign(16, 5);
  for (int i = 0; i < 10000; ++i) small.Append(b16);
  auto all = small.ReadAfter(10000 - 4096, 5000);
  REQUIRE_FALSE(all.resync);
  REQUIRE(all.events.size() == 4096);
  REQUIRE(small.ReadAfter(10000 - 4097, 10).resync);
}

}  // namespace
}  // namespace kvd
