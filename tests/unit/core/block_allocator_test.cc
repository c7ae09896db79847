#include "server/core/block_allocator.h"

#include <catch2/catch.hpp>

#include "absl/container/flat_hash_set.h"

namespace kvd {
namespace {

TEST_CASE("BlockAllocator hands out each block once", "[core][allocator]") {
  BlockAllocator a(8);
  auto first = a.Allocate(5);
  REQUIRE(first.ok());
  auto second = a.Allocate(3);
  REQUIRE(second.ok());
  absl::flat_hash_set<BlockIndex> seen(first->begin(), first->end());
  for (BlockIndex b : *second) REQUIRE(seen.insert(b).second);
  REQUIRE(seen.size() == 8);
  REQUIRE(a.num_free() == 0);
}

TEST_CASE("BlockAllocator refuses what it cannot give and changes nothing", "[core][allocator]") {
  BlockAllocator a(4);
  REQUIRE(a.Allocate(3).ok());
  auto r = a.Allocate(2);
  REQUIRE(r.status().code() == absl::StatusCode::kResourceExhausted);
  REQUIRE(a.num_free() == 1);
  REQUIRE(a.Allocate(1).ok());
}

TEST_CASE("BlockAllocator reuses freed blocks", "[core][allocator]") {
  BlockAllocator a(2);
  auto r = a.Allocate(2);
  REQUIRE(r.ok());
  a.Free((*r)[1]);
  auto again = a.Allocate(1);
  REQUIRE(again.ok());
  REQUIRE((*again)[0] == (*r)[1]);
}

}  // namespace
}  // namespace kvd
