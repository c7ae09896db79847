#include "server/core/prefix_index.h"

#include <catch2/catch.hpp>

#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using testing::Seq;

// One pool "m" of 4-token blocks with room for 16.
std::vector<PoolGeometry> Pools() {
  PoolGeometry g;
  g.name = "m";
  g.block_tokens = 4;
  g.capacity_blocks = 16;
  return {g};
}

TEST_CASE("PrefixIndex matches the longest cached chain", "[core][index]") {
  PrefixIndex index(Pools());
  Namespace ns{.pool = "m"};
  NamespaceRoot* root = index.GetOrCreateRoot(ns, 0);
  auto tokens = Seq(0, 12);
  CachedBlock* b0 = index.Insert(root, nullptr, absl::MakeSpan(tokens).subspan(0, 4), {0, 10});
  CachedBlock* b1 = index.Insert(root, b0, absl::MakeSpan(tokens).subspan(4, 4), {0, 11});
  REQUIRE(b0 != nullptr);
  REQUIRE(b1 != nullptr);
  REQUIRE(b0->num_children == 1);
  auto m = index.Match(root, tokens, 4, 100);
  REQUIRE(m.size() == 2);
  REQUIRE(m[0] == b0);
  REQUIRE(m[1] == b1);
  REQUIRE(index.Match(root, tokens, 4, 1).size() == 1);
  // A different second block stops the match after the first.
  auto other = tokens;
  other[5] = 999;
  REQUIRE(index.Match(root, other, 4, 100).size() == 1);
}

TEST_CASE("A key hit with different tokens is a miss (collision safety)", "[core][index]") {
  PrefixIndex index(Pools());
  NamespaceRoot* root = index.GetOrCreateRoot(Namespace{.pool = "m"}, 0);
  auto tokens = Seq(0, 4);
  CachedBlock* b = index.Insert(root, nullptr, tokens, {0, 0});
  REQUIRE(index.Match(root, tokens, 4, 10).size() == 1);
  // Simulate a 128-bit collision: the stored block's tokens no longer equal the lookup's.
  const_cast<Token&>(index.TokensOf(*b)[2]) = 77;  // the slab is the index's own memory
  REQUIRE(index.Match(root, tokens, 4, 10).empty());
  REQUIRE(index.FindChild(*root, nullptr, tokens) == nullptr);
}

TEST_CASE("Namespaces are separate roots and empty roots go away", "[core][index]") {
  PrefixIndex index(Pools());
  Namespace a{.pool = "m"};
  Namespace b{.pool = "m", .cache_salt = "t2"};
  auto tokens = Seq(0, 4);
  CachedBlock* blk = index.Insert(index.GetOrCreateRoot(a, 0), nullptr, tokens, {0, 0});
  REQUIRE(index.FindRoot(b) == nullptr);
  REQUIRE(index.Match(index.FindRoot(b), tokens, 4, 10).empty());
  REQUIRE(index.num_roots() == 1);
  index.Erase(blk);
  REQUIRE(index.num_roots() == 0);
  REQUIRE(index.num_blocks() == 0);
}

}  // namespace
}  // namespace kvd
