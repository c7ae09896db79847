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

namespace kvd {
namespace {

TEST_CASE("Claim takes exactly the named blocks, or none of them", "[core][allocator]") {
  BlockAllocator a(8);
  REQUIRE(a.Claim(std::vector<BlockIndex>{5, 0, 3}).ok());
  REQUIRE(a.num_free() == 5);
  auto rest = a.Allocate(5);
  REQUIRE(rest.ok());
  REQUIRE(*rest == std::vector<BlockIndex>{1, 2, 4, 6, 7});  // the stack's order kept
  a.Free(std::vector<BlockIndex>{1, 2, 4, 6, 7});
  REQUIRE(absl::IsInvalidArgument(a.Claim(std::vector<BlockIndex>{1, 3})));    // 3 is not free
  REQUIRE(absl::IsInvalidArgument(a.Claim(std::vector<BlockIndex>{1, 1})));    // repeated
  REQUIRE(absl::IsInvalidArgument(a.Claim(std::vector<BlockIndex>{1, 8})));    // out of range
  REQUIRE(a.num_free() == 5);
}

}  // namespace
}  // namespace kvd
