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

}  // namespace
}  // namespace kvd
