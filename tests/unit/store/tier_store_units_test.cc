// The tier store on a hybrid pool (docs/hybrid.md §2.9, step 6): unit records round-trip their
// parts (block records unchanged), a hybrid pool's layout tag covers its groups, and a flushed
// unit comes back whole after a restart while a unit cut short on disk is dropped, never served;
// the store's gauges agree with a scan of every index each time (CheckStatsForTesting).
#include <filesystem>

#include <catch2/catch.hpp>

#include "absl/synchronization/notification.h"
#include "tests/unit/store/store_fixture.h"

namespace kvd {
namespace {

using testing::Concat;
using testing::Seq;
using testing::Spec;

constexpr int kRec = 2;

// full (layers 0, 3), a 6-token window (layer 1), state every 2 blocks (layer 2).
PoolGeometry Hybrid(int32_t window = 6) {
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

CacheOptions Options(int32_t window = 6) {
  CacheOptions o = testing::SmallOptions();
  o.pools = {Hybrid(window)};
  return o;
}

std::vector<uint8_t> Bytes(const PoolGeometry& g, BlockIndex index, uint8_t seed) {
  std::vector<uint8_t> v(static_cast<size_t>(g.GroupUnitBytes(g.GroupOf(index)) * g.num_shards));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(seed * 37 + i * 3);
  return v;
}

std::vector<uint8_t> Read(testing::Node& node, BlockIndex index) {
  const PoolGeometry& g = node.cache->pools()[0];
  std::vector<uint8_t> v(static_cast<size_t>(g.GroupUnitBytes(g.GroupOf(index)) * g.num_shards));
  REQUIRE(node.arena->ReadBlock(0, index, v.data()).ok());
  return v;
}

// Publishes [1, 9) with the window blocks and the state at 8, every unit filled with its pattern.
void PublishUnit(testing::Node& node) {
  const PoolGeometry& g = node.cache->pools()[0];
  const RequestSpec a = Spec("a", Seq(1, 9));
  const AcquireResult ra = testing::Start(*node.cache, a);
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

// Brings the tiers' units back, then starts `prompt`: the hit, checked unit by unit against the
// patterns PublishUnit wrote (seeds by position, not by index).
int64_t Serve(testing::Node& node, const std::string& id) {
  const PoolGeometry& g = node.cache->pools()[0];
  const RequestSpec s = Spec(id, Concat(Seq(1, 8), Seq(500, 5)));
  absl::Notification done;
  if (node.store->InstallUnits(s, [&] { done.Notify(); })) done.WaitForNotification();
  const AcquireResult r = testing::Start(*node.cache, s);
  if (r.cached_tokens == 8) {
    for (int i = 0; i < 2; ++i) {
      // Bytes() depends on the index only through its group's size: the seed is the position's.
      CHECK(Read(node, r.blocks[i]) == Bytes(g, r.blocks[i], 10 + i));
      CHECK(Read(node, r.group_tables[1].blocks[i]) == Bytes(g, r.group_tables[1].blocks[i], 20 + i));
    }
    const BlockIndex ckpt = static_cast<BlockIndex>(r.group_tables[kRec].checkpoint_slot);
    CHECK(Read(node, ckpt) == Bytes(g, ckpt, 30));
  }
  REQUIRE(node.cache->Release(s.id, true).ok());
  REQUIRE(node.cache->CheckInvariantsForTesting().ok());
  node.CheckStats();
  return r.cached_tokens;
}

TEST_CASE("Unit records round-trip their parts; block records are unchanged; garbage is DATA_LOSS",
          "[store][hybrid]") {
  RecordHeader h;
  h.ns.pool = "m";
  h.tokens = {1, 2, 3, 4};
  h.key = BlockKey{1, 2};
  h.raw_length = 64;
  std::string block;
  EncodeRecordHeader(h, &block);
  h.kind = RecordKind::kUnit;
  h.parts = {{1, false}, {2, true}};
  std::string unit;
  EncodeRecordHeader(h, &unit);
  CHECK(unit.size() == block.size() + 1 + 2 * 2);
  CHECK(unit.substr(1, block.size() - 1) == block.substr(1));  // the block part is the block's
  absl::string_view in(unit);
  auto back = DecodeRecordHeader(&in);
  REQUIRE(back.ok());
  CHECK(back->kind == RecordKind::kUnit);
  CHECK(back->parts == h.parts);
  CHECK(in.empty());
  for (size_t cut = 0; cut < unit.size(); ++cut) {
    absl::string_view part(unit.data(), cut);
    CHECK(DecodeRecordHeader(&part).status().code() == absl::StatusCode::kDataLoss);
  }
  std::string bad = unit;
  bad[block.size() + 1] = 9;  // a group index past kMaxKvGroups
  absl::string_view b(bad);
  CHECK(DecodeRecordHeader(&b).status().code() == absl::StatusCode::kDataLoss);
  // Another grouping never shares a tag; a pool without groups keeps its own.
  CHECK(LayoutTag(Hybrid(6)) != LayoutTag(Hybrid(5)));
  PoolGeometry plain = Hybrid();
  plain.groups.clear();
  CHECK(LayoutTag(plain) != LayoutTag(Hybrid()));
}

TEST_CASE("A hybrid unit survives a flush and a restart whole; one cut short on disk is never served",
          "[store][hybrid]") {
  const testing::ScopedDir dir;
  {
    testing::Node node(testing::Tiers(dir), Options());
    PublishUnit(node);
    auto f = node.store->Flush();
    REQUIRE(f.ok());
    REQUIRE(f->durable);
    CHECK(f->written_blocks == 2);  // two units: the checkpoint and window blocks travel with them
  }
  {
    testing::Node node(testing::Tiers(dir), Options());
    CHECK(node.store->Stats().reloaded_records == 2);
    CHECK(Serve(node, "b") == 8);
    CHECK(node.store->Stats().promotions[2] == 2);
  }
  {
    testing::Node node(testing::Tiers(dir), Options(5));  // another window: another grouping
    CHECK(node.store->Stats().incompatible == 2);
    CHECK(Serve(node, "c") == 0);
  }
  // Cut the segment's last payload short by a byte: its unit is dropped when read.
  for (const auto& e : std::filesystem::directory_iterator(dir.path)) {
    if (e.path().filename().string().rfind("seg-", 0) == 0) {
      std::filesystem::resize_file(e.path(), std::filesystem::file_size(e.path()) - 1);
    }
  }
  testing::Node node(testing::Tiers(dir), Options());
  CHECK(Serve(node, "d") == 0);
  const TierStats s = node.store->Stats();
  // Load skips a record whose payload runs past the end, or the read fails its checksum.
  CHECK((s.reloaded_records < 2 || s.checksum_failures + s.read_errors >= 1));
}

}  // namespace
}  // namespace kvd
