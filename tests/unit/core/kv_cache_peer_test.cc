// PinPrefix: what a peer's Offer pins (docs/transfer.md). The pins keep the prefix cached and
// where it lies until UnpinBlocks, whatever Gc and ClearCache do meanwhile.
#include <catch2/catch.hpp>

#include "server/core/kv_cache.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using namespace kvd::testing;

TEST_CASE("PinPrefix pins the cached prefix past skip_blocks, never the last token's block", "[core][peer]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  const std::vector<Token> prompt = Seq(1, 17);  // 4 full blocks and one token
  RequestSpec spec = Spec("r", prompt);
  AcquireResult acq = Start(*cache, spec);
  PublishAll(*cache, spec, prompt, acq);
  REQUIRE(cache->Release(spec.id, true).ok());

  Namespace ns;
  ns.pool = "m";
  auto all = cache->PinPrefix(ns, prompt, 0, 0);
  REQUIRE(all.ok());
  CHECK(all->blocks == std::vector<BlockIndex>(acq.blocks.begin(), acq.blocks.begin() + 4));
  CHECK(all->serials.size() == 4);
  // A prompt of exactly 4 blocks: the 4th holds its last token, which the puller computes.
  auto exact = cache->PinPrefix(ns, Seq(1, 16), 0, 0);
  REQUIRE(exact.ok());
  CHECK(exact->blocks.size() == 3);
  auto tail = cache->PinPrefix(ns, prompt, 1, 2);
  REQUIRE(tail.ok());
  CHECK(tail->blocks == std::vector<BlockIndex>{acq.blocks[1], acq.blocks[2]});
  auto past = cache->PinPrefix(ns, prompt, 9, 0);
  REQUIRE(past.ok());
  CHECK(past->blocks.empty());
  Namespace other = ns;
  other.cache_salt = "tenant-b";
  auto salted = cache->PinPrefix(other, prompt, 0, 0);
  REQUIRE(salted.ok());
  CHECK(salted->blocks.empty());  // another namespace's blocks are never offered
  ns.pool = "nope";
  CHECK(absl::IsNotFound(cache->PinPrefix(ns, prompt, 0, 0).status()));
  ns.pool = "m";

  // Pinned blocks survive Gc and ClearCache; once every pin is gone they can go.
  CHECK(cache->ClearCache() == 0);
  CHECK(*cache->PeekPrefixLen(ns, prompt) == 16);
  REQUIRE(cache->CheckInvariantsForTesting().ok());
  cache->UnpinBlocks(all->pool, all->blocks);
  cache->UnpinBlocks(exact->pool, exact->blocks);
  CHECK(*cache->PeekPrefixLen(ns, prompt) == 16);  // tail still pins blocks 1 and 2
  cache->UnpinBlocks(tail->pool, tail->blocks);
  CHECK(cache->ClearCache() == 4);
  CHECK(*cache->PeekPrefixLen(ns, prompt) == 0);
  REQUIRE(cache->CheckInvariantsForTesting().ok());
}

TEST_CASE("A block cached again at the same index gets a new serial", "[core][peer]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(4), &clock);
  Namespace ns;
  ns.pool = "m";
  const std::vector<Token> prompt = Seq(1, 5);
  uint64_t first = 0;
  for (int round = 0; round < 2; ++round) {
    RequestSpec spec = Spec("r" + std::to_string(round), prompt);
    AcquireResult acq = Start(*cache, spec);
    PublishAll(*cache, spec, prompt, acq);
    REQUIRE(cache->Release(spec.id, true).ok());
    auto pinned = cache->PinPrefix(ns, prompt, 0, 0);
    REQUIRE(pinned.ok());
    REQUIRE(pinned->serials.size() == 1);
    if (round == 0) first = pinned->serials[0];
    else CHECK(pinned->serials[0] != first);  // a kept checksum of the old bytes cannot match
    cache->UnpinBlocks(pinned->pool, pinned->blocks);
    CHECK(cache->ClearCache() == 1);
  }
}

}  // namespace
}  // namespace kvd
