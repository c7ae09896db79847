#include "proto/vocab/block_key.h"

#include <catch2/catch.hpp>

#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using testing::Seq;

TEST_CASE("Block keys are deterministic and chained", "[core][key]") {
  Namespace ns{.pool = "m"};
  BlockKey root = NamespaceRootKey(ns);
  auto t = Seq(1, 4);
  BlockKey a = ChainBlockKey(BlockKey{}, root, t);
  REQUIRE(a == ChainBlockKey(BlockKey{}, root, t));
  // The same tokens under another parent are another block.
  BlockKey b = ChainBlockKey(a, root, t);
  REQUIRE(a != b);
  // Changing one token changes the key.
  auto u = t;
  u[3] += 1;
  REQUIRE(ChainBlockKey(BlockKey{}, root, u) != a);
  REQUIRE(a.ToHex().size() == 32);
}

TEST_CASE("Every namespace field separates roots", "[core][key]") {
  Namespace base{.pool = "m"};
  BlockKey k = NamespaceRootKey(base);
  Namespace n = base;
  n.adapter = "lora1";
  REQUIRE(NamespaceRootKey(n) != k);
  n = base;
  n.media_keys = {"img"};
  REQUIRE(NamespaceRootKey(n) != k);
  n = base;
  n.method = "x";
  REQUIRE(NamespaceRootKey(n) != k);
  n = base;
  n.cache_salt = "tenant";
  REQUIRE(NamespaceRootKey(n) != k);
  // Field boundaries are encoded: ("ab","c") differs from ("a","bc").
  Namespace x{.pool = "ab", .adapter = "c"};
  Namespace y{.pool = "a", .adapter = "bc"};
  REQUIRE(NamespaceRootKey(x) != NamespaceRootKey(y));
}

TEST_CASE("Long blocks hash through the streaming path consistently", "[core][key]") {
  BlockKey root = NamespaceRootKey(Namespace{.pool = "m"});
  auto t = Seq(7, 1024);
  REQUIRE(ChainBlockKey(BlockKey{}, root, t) == ChainBlockKey(BlockKey{}, root, t));
  auto u = t;
  u.back() ^= 1;
  REQUIRE(ChainBlockKey(BlockKey{}, root, t) != ChainBlockKey(BlockKey{}, root, u));
}

}  // namespace
}  // namespace kvd
