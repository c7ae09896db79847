// TierStore::Stats() keeps its gauges incrementally (tier_store.h, Tally): a randomized mix of
// every operation that changes an entry, with the counts checked against a full scan after each
// step — while the writer thread may still be writing — and after a restart.
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "tests/unit/store/store_fixture.h"

namespace kvd {
namespace {

using namespace kvd::testing;

void RequireCounts(Node& node, int step, const std::string& op) {
  const absl::Status s = node.store->CheckStatsForTesting();
  INFO("step " << step << " (" << op << "): " << s.ToString());
  REQUIRE(s.ok());
}

TEST_CASE("Tier gauges kept incrementally equal a scan after every operation", "[store]") {
  const ScopedDir dir;
  TierOptions t = Tiers(dir, Codec::kNone, /*host_blocks=*/3);
  t.segment_bytes = 2 * testing::kBlockBytes;
  t.disk_bytes = 12 * (testing::kBlockBytes + 256);  // small: segments are evicted too
  const uint32_t seed = std::random_device{}();
  INFO("seed " << seed);
  std::mt19937 rng(seed);
  auto node = std::make_unique<Node>(t, /*capacity_blocks=*/8);
  int serial = 0;
  std::vector<std::string> objects;
  for (int step = 0; step < 400; ++step) {
    const int op = static_cast<int>(rng() % 10);
    // Prompts share first blocks (a few families), so blocks come back from every tier.
    const Token family = static_cast<Token>(1 + 100 * (rng() % 6));
    const std::vector<Token> prompt = testing::Concat(Seq(family, 8), Seq(family + 10 + rng() % 3, 5));
    const std::string id = "r" + std::to_string(++serial);
    std::string name;
    switch (op) {
      case 0:
      case 1:
        name = "publish";
        node->Publish(id, prompt);
        break;
      case 2:
      case 3:
        name = "serve";
        node->Serve(id, prompt);
        break;
      case 4: {  // a checkpoint left by an interrupted generation (orphaned), or re-taken
        name = "checkpoint";
        RequestSpec spec = Spec(id, prompt, /*max_new=*/4);
        testing::Start(*node->cache, spec);
        const int64_t n = 4 + static_cast<int64_t>(rng() % 9);
        const std::vector<Token> tokens(prompt.begin(), prompt.begin() + n);
        REQUIRE(node->cache->Checkpoint(spec.id, tokens, "state" + std::to_string(rng() % 2)).ok());
        if (rng() % 2 == 0) REQUIRE(node->cache->Checkpoint(spec.id, tokens, "again").ok());
        REQUIRE(node->cache->Release(spec.id, /*completed=*/rng() % 3 == 0).ok());
        break;
      }
      case 5: {
        name = "object";
        Namespace ns;
        ns.pool = "m";
        const std::string key = "o" + std::to_string(rng() % 5);
        if (rng() % 3 == 0) {
          (void)node->store->DeleteObject(ns, key);
        } else {
          (void)node->store->PutObject(ns, key, std::string(1 + rng() % (3 * testing::kBlockBytes), 'x'));
        }
        break;
      }
      case 6:
        name = "flush";
        REQUIRE(node->store->Flush().ok());
        break;
      case 7:
        name = "clear";
        node->cache->ClearCache();
        break;
      case 8:
        name = "boundary+demote";
        node->cache->Boundary();
        node->store->DemoteIdle();
        break;
      default:
        name = "restart";
        node->CheckStats();
        node.reset();
        node = std::make_unique<Node>(t, 8);
        break;
    }
    RequireCounts(*node, step, name);
  }
  node->CheckStats();
  const TierStats s = node->store->Stats();
  REQUIRE(s.disk_records >= 0);
  REQUIRE(s.pending_spill_records >= 0);
}

TEST_CASE("A flushed checkpoint stops counting as pending until it changes or its copy is lost", "[store]") {
  const ScopedDir dir;
  TierOptions t = Tiers(dir);
  t.segment_bytes = 3 * testing::kBlockBytes;  // one object per segment
  t.disk_bytes = 3 * (3 * testing::kBlockBytes + 256);
  Node node(t);
  const std::vector<Token> prompt = Seq(1, 9);
  RequestSpec spec = Spec("ck", prompt, 4);
  testing::Start(*node.cache, spec);
  REQUIRE(node.cache->Checkpoint(spec.id, Seq(1, 8), "s1").ok());
  REQUIRE(node.store->Stats().pending_checkpoints == 1);
  REQUIRE(node.store->Flush().ok());
  REQUIRE(node.store->Stats().pending_checkpoints == 0);
  // Same tokens, new engine state: a new version, written again by the next flush.
  REQUIRE(node.cache->Checkpoint(spec.id, Seq(1, 8), "s2").ok());
  REQUIRE(node.store->Stats().pending_checkpoints == 1);
  auto r = node.store->Flush();
  REQUIRE(r.ok());
  REQUIRE(r->written_blocks >= 1);
  REQUIRE(node.store->Stats().pending_checkpoints == 0);
  RequireCounts(node, 0, "flushed");
  // The disk budget evicts its segment: pending again.
  for (int i = 0; i < 12; ++i) {
    Namespace ns;
    ns.pool = "m";
    REQUIRE(node.store->PutObject(ns, "big" + std::to_string(i), std::string(3 * testing::kBlockBytes, 'y')).ok());
  }
  node.store->WaitIdleForTesting();
  INFO("disk used " << node.store->Stats().disk_used_bytes << ", records " << node.store->Stats().disk_records);
  REQUIRE(node.store->Stats().pending_checkpoints == 1);
  RequireCounts(node, 1, "evicted");
  REQUIRE(node.cache->Release(spec.id, true).ok());
  REQUIRE(node.store->Stats().pending_checkpoints == 0);
}

}  // namespace
}  // namespace kvd
