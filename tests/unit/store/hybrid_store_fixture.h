// Test fixtures for the tier store on a hybrid pool (docs/hybrid.md §2.9): the pool, a unit's byte
// pattern, and a published unit of [1, 9) served back unit by unit. Shared by
// tier_store_units_test.cc, tier_store_units_remote_test.cc and disk_recovery_test.cc.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/synchronization/notification.h"
#include "tests/unit/store/store_fixture.h"

namespace kvd {
namespace testing {

inline constexpr int kRec = 2;  // the state group's index

// Pool "m": full (layers 0, 3), a `window`-token window (layer 1), state every 2 blocks (layer 2);
// 16 full and 16 window blocks, 6 state slots (one 63-token request takes every full block).
inline PoolGeometry HybridGeometry(int32_t window = 6) {
  PoolGeometry g;
  g.name = "m";
  g.block_tokens = 4;
  g.num_layers = 4;
  g.bytes_per_token_per_layer = 8;
  g.max_model_len = 64;
  g.step_tokens = 8;
  g.groups.push_back(KvGroup{.name = "full", .kind = KvGroupKind::kFull, .layers = {0, 3}, .capacity = 16});
  g.groups.push_back(
      KvGroup{.name = "swa", .kind = KvGroupKind::kSlidingWindow, .layers = {1}, .window = window, .capacity = 16});
  g.groups.push_back(KvGroup{.name = "rec", .kind = KvGroupKind::kState, .layers = {2}, .bytes_per_state = 48,
                             .checkpoint_every_blocks = 2, .checkpoint_at_end = false, .capacity = 6});
  REQUIRE(g.ResolveGroups().ok());
  return g;
}

// SmallOptions with HybridGeometry(window) as its only pool.
inline CacheOptions HybridOptions(int32_t window = 6) {
  CacheOptions o = SmallOptions();
  o.pools = {HybridGeometry(window)};
  return o;
}

// A unit's pattern: `seed` is its group and position's, so a unit restored elsewhere compares equal
// (the index matters only through its group's unit size).
inline std::vector<uint8_t> Bytes(const PoolGeometry& g, BlockIndex index, uint8_t seed) {
  std::vector<uint8_t> v(static_cast<size_t>(g.GroupUnitBytes(g.GroupOf(index)) * g.num_shards));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(seed * 37 + i * 3);
  return v;
}

// Every shard of unit `index` of the node's first pool.
inline std::vector<uint8_t> Read(Node& node, BlockIndex index) {
  const PoolGeometry& g = node.cache->pools()[0];
  std::vector<uint8_t> v(static_cast<size_t>(g.GroupUnitBytes(g.GroupOf(index)) * g.num_shards));
  REQUIRE(node.arena->ReadBlock(0, index, v.data()).ok());
  return v;
}

// Publishes [1, 9) with the window blocks and the state at 8, every unit filled with its pattern
// (seeds: full 10 + position, swa 20 + position, the state 30).
inline void PublishUnit(Node& node) {
  const PoolGeometry& g = node.cache->pools()[0];
  const RequestSpec a = Spec("a", Seq(1, 9));
  const AcquireResult ra = Start(*node.cache, a);
  const BlockIndex slot = ra.group_tables[kRec].blocks[1];
  for (int i = 0; i < 2; ++i) {
    REQUIRE(node.arena->WriteBlock(0, ra.blocks[i], Bytes(g, ra.blocks[i], 10 + i).data()).ok());
    const BlockIndex w = ra.group_tables[1].blocks[i];
    REQUIRE(node.arena->WriteBlock(0, w, Bytes(g, w, 20 + i).data()).ok());
  }
  REQUIRE(node.arena->WriteBlock(0, slot, Bytes(g, slot, 30).data()).ok());
  auto p = node.cache->Publish(a.id, absl::MakeConstSpan(a.prompt).first(8), {ra.blocks[0], ra.blocks[1]},
                               std::vector<StateCheckpoint>{{kRec, 8, slot}});
  REQUIRE(p.ok());
  REQUIRE(p->checkpoint_outcomes == std::vector<CheckpointOutcome>{CheckpointOutcome::kKept});
  REQUIRE(node.cache->Release(a.id, true).ok());
}

// Brings the tiers' units back, then starts a prompt sharing the 8 tokens: the hit, checked unit
// by unit against PublishUnit's patterns when it is 8; any other hit restores no state.
inline int64_t Serve(Node& node, const std::string& id) {
  const PoolGeometry& g = node.cache->pools()[0];
  const RequestSpec s = Spec(id, Concat(Seq(1, 8), Seq(500, 5)));
  absl::Notification done;
  if (node.store->InstallUnits(s, [&] { done.Notify(); })) done.WaitForNotification();
  const AcquireResult r = Start(*node.cache, s);
  if (r.cached_tokens == 8) {
    for (int i = 0; i < 2; ++i) {
      CHECK(Read(node, r.blocks[i]) == Bytes(g, r.blocks[i], 10 + i));
      CHECK(Read(node, r.group_tables[1].blocks[i]) == Bytes(g, r.group_tables[1].blocks[i], 20 + i));
    }
    const BlockIndex ckpt = static_cast<BlockIndex>(r.group_tables[kRec].checkpoint_slot);
    CHECK(Read(node, ckpt) == Bytes(g, ckpt, 30));
  } else {
    CHECK(r.group_tables[kRec].checkpoint_slot == -1);
  }
  REQUIRE(node.cache->Release(s.id, true).ok());
  REQUIRE(node.cache->CheckInvariantsForTesting().ok());
  node.CheckStats();
  return r.cached_tokens;
}

}  // namespace testing
}  // namespace kvd
