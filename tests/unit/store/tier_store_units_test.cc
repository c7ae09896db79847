// The tier store on a hybrid pool (docs/hybrid.md §2.9, step 6): unit records round-trip their
// parts (block records unchanged), a hybrid pool's layout tag covers its groups, and a flushed
// unit comes back whole after a restart while a unit cut short on disk is dropped, never served;
// the store's gauges agree with a scan of every index each time (CheckStatsForTesting).
#include <filesystem>
#include <fstream>

#include <catch2/catch.hpp>

#include "absl/synchronization/notification.h"
#include "tests/unit/store/hybrid_store_fixture.h"
#include "tests/unit/store/store_fixture.h"

namespace kvd {
namespace {

using testing::Concat;
using testing::HybridGeometry;
using testing::HybridOptions;
using testing::PublishUnit;
using testing::Seq;
using testing::Serve;
using testing::Spec;

// A node over the disk tier in `dir` publishes PublishUnit's unit and flushes it; the flush's answer.
absl::StatusOr<FlushResult> PublishFlushed(const std::string& dir) {
  testing::Node node(testing::Tiers(dir), HybridOptions());
  PublishUnit(node);
  return node.store->Flush();
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
  CHECK(LayoutTag(HybridGeometry(6)) != LayoutTag(HybridGeometry(5)));
  PoolGeometry plain = HybridGeometry();
  plain.groups.clear();
  CHECK(LayoutTag(plain) != LayoutTag(HybridGeometry()));
}

TEST_CASE("A hybrid unit survives a flush and a restart whole; one cut short on disk is never served",
          "[store][hybrid]") {
  const testing::ScopedDir dir;
  {
    absl::StatusOr<FlushResult> f = PublishFlushed(dir);
    REQUIRE(f.ok());
    REQUIRE(f->durable);
    CHECK(f->written_blocks == 2);  // two units: the checkpoint and window blocks travel with them
  }
  {
    testing::Node node(testing::Tiers(dir), HybridOptions());
    CHECK(node.store->Stats().reloaded_records == 2);
    CHECK(Serve(node, "b") == 8);
    CHECK(node.store->Stats().promotions[2] == 2);
  }
  {
    testing::Node node(testing::Tiers(dir), HybridOptions(5));  // another window: another grouping
    CHECK(node.store->Stats().incompatible == 2);
    CHECK(Serve(node, "c") == 0);
  }
  // Cut the segment's last payload short by a byte: its unit is dropped when read.
  for (const auto& e : std::filesystem::directory_iterator(dir.path)) {
    if (e.path().filename().string().rfind("seg-", 0) == 0) {
      std::filesystem::resize_file(e.path(), std::filesystem::file_size(e.path()) - 1);
    }
  }
  testing::Node node(testing::Tiers(dir), HybridOptions());
  CHECK(Serve(node, "d") == 0);
  const TierStats s = node.store->Stats();
  // Load skips a record whose payload runs past the end, or the read fails its checksum.
  CHECK((s.reloaded_records < 2 || s.checksum_failures + s.read_errors >= 1));
}

// Prefetch on a hybrid pool, waited for: what the call answered.
absl::StatusOr<PrefetchInfo> PrefetchNow(testing::Node& node, const Namespace& ns, const std::vector<Token>& prompt,
                                         const std::string& worker) {
  absl::Notification done;
  PrefetchInfo info;
  absl::StatusOr<bool> units = node.store->PrefetchUnits(ns, prompt, WorkerId(worker), [&](PrefetchInfo i) {
    info = i;
    done.Notify();
  });
  if (!units.ok()) return units.status();
  REQUIRE(*units);
  done.WaitForNotification();
  return info;
}

TEST_CASE("Peek sees a hybrid pool's units on disk; prefetch brings them into G1 so the start installs nothing",
          "[store][hybrid][peek]") {
  const testing::ScopedDir dir;
  {
    absl::StatusOr<FlushResult> f = PublishFlushed(dir);
    REQUIRE(f.ok());
    REQUIRE(f->durable);
  }
  TierOptions tiers = testing::Tiers(dir);
  tiers.max_prefetch_handles_per_worker = 2;
  testing::Node node(std::move(tiers), HybridOptions());
  const Namespace ns{.pool = "m"};
  const Namespace other{.pool = "m", .cache_salt = "tenant-b"};
  const std::vector<Token> prompt = Concat(Seq(1, 8), Seq(500, 5));
  CHECK(*node.cache->PeekPrefixLen(ns, prompt) == 0);
  CHECK(node.store->PeekUnits(ns, prompt) == 8);
  CHECK(node.store->PeekUnits(ns, Seq(1, 8)) == 0);  // 8 tokens: one unit may hit, and it has no checkpoint
  // Another tenant's salt, another adapter, an unknown pool: nothing.
  CHECK(node.store->PeekUnits(other, prompt) == 0);
  CHECK(node.store->PeekUnits(Namespace{.pool = "m", .adapter = "lora"}, prompt) == 0);
  CHECK(node.store->PeekUnits(Namespace{.pool = "nope"}, prompt) == 0);
  CHECK(absl::IsNotFound(node.store->PrefetchUnits(Namespace{.pool = "nope"}, prompt, WorkerId("w"), [](PrefetchInfo) {}).status()));
  absl::StatusOr<PrefetchInfo> hostile = PrefetchNow(node, other, prompt, "b");
  REQUIRE(hostile.ok());
  CHECK(hostile->found_blocks == 0);
  CHECK(node.store->Stats().promotions[2] == 0);
  REQUIRE(node.store->ReleasePrefetch(hostile->handle, WorkerId("b")).ok());

  absl::StatusOr<PrefetchInfo> got = PrefetchNow(node, ns, prompt, "w");
  REQUIRE(got.ok());
  CHECK(got->found_blocks == 2);
  CHECK(got->loading_blocks == 0);
  CHECK(node.store->Stats().promotions[2] == 2);
  REQUIRE(node.cache->CheckInvariantsForTesting().ok());
  CHECK(*node.cache->PeekPrefixLen(ns, prompt) == 8);  // in G1 now
  CHECK(node.store->PeekUnits(ns, prompt) == 0);        // nothing below G1 extends it
  // The start installs nothing (no promotion counted) and reads the publisher's bytes.
  CHECK(!node.store->InstallUnits(Spec("b", prompt), [] {}));
  CHECK(Serve(node, "b") == 8);
  CHECK(node.store->Stats().promotions[2] == 2);
  // Handles count against the limit like any prefetch's, and a release frees one.
  absl::StatusOr<PrefetchInfo> again = PrefetchNow(node, ns, prompt, "w");
  REQUIRE(again.ok());
  CHECK(again->found_blocks == 0);
  CHECK(absl::IsResourceExhausted(PrefetchNow(node, ns, prompt, "w").status()));
  CHECK(absl::IsPermissionDenied(node.store->ReleasePrefetch(got->handle, WorkerId("b"))));
  REQUIRE(node.store->ReleasePrefetch(got->handle, WorkerId("w")).ok());
  node.store->ReleasePrefetchesOf(WorkerId("w"));
  CHECK(absl::IsNotFound(node.store->ReleasePrefetch(again->handle, WorkerId("w"))));
  CHECK(PrefetchNow(node, ns, prompt, "w").ok());
}

TEST_CASE("A hybrid prefetch of a unit damaged on disk installs nothing and drops it", "[store][hybrid][peek]") {
  const testing::ScopedDir dir;
  REQUIRE(PublishFlushed(dir).ok());
  // Flip the last payload byte of every segment: the unit stored last fails its checksum when read.
  for (const auto& e : std::filesystem::directory_iterator(dir.path)) {
    if (e.path().filename().string().rfind("seg-", 0) != 0) continue;
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    char last = 0;
    f.read(&last, 1);
    f.seekp(-1, std::ios::end);
    last = static_cast<char>(last ^ 0x5a);
    f.write(&last, 1);
  }
  testing::Node node(testing::Tiers(dir), HybridOptions());
  const Namespace ns{.pool = "m"};
  const std::vector<Token> prompt = Concat(Seq(1, 8), Seq(500, 5));
  CHECK(node.store->PeekUnits(ns, prompt) == 8);  // headers are intact: the damage shows when read
  absl::StatusOr<PrefetchInfo> got = PrefetchNow(node, ns, prompt, "w");
  REQUIRE(got.ok());
  CHECK(got->found_blocks < 2);
  CHECK(node.store->Stats().checksum_failures >= 1);
  REQUIRE(node.cache->CheckInvariantsForTesting().ok());
  CHECK(*node.cache->PeekPrefixLen(ns, prompt) == 0);
  CHECK(node.store->PeekUnits(ns, prompt) == 0);  // the damaged unit is gone from the index
  CHECK(Serve(node, "b") == 0);
}

TEST_CASE("Hybrid prefetches racing evictions and a restart leave nothing owned, reserved or pinned",
          "[store][hybrid][peek]") {
  const testing::ScopedDir dir;
  TierOptions tiers = testing::Tiers(dir);
  tiers.host_bytes = 1 << 16;  // the units fit in G2
  const Namespace ns{.pool = "m"};
  const std::vector<Token> prompt = Concat(Seq(1, 8), Seq(500, 5));
  {
    testing::Node node(tiers, HybridOptions());
    PublishUnit(node);
    // Each round: a start that needs 15 of the 16 full blocks evicts the unit to G2; a prefetch
    // brings it back on a reader thread while the next such start races it for the blocks.
    const auto pressure = [&](const std::string& id) {
      const RequestSpec big = Spec(id, Seq(static_cast<Token>(1000 + 100 * id.size()), 59));
      absl::StatusOr<AdmitResult> a = node.cache->Admit(big);
      if (a.ok() && a->decision == AdmitDecision::kAdmitted) (void)node.cache->Acquire(big.id);
      (void)node.cache->Release(big.id, true);
    };
    int64_t found = 0;
    for (int i = 0; i < 40; ++i) {
      pressure("evict" + std::to_string(i));
      CHECK(node.store->PeekUnits(ns, prompt) <= 8);
      absl::Notification done;
      PrefetchInfo got;
      absl::StatusOr<bool> units = node.store->PrefetchUnits(ns, prompt, WorkerId("w"), [&](PrefetchInfo info) {
        got = info;
        done.Notify();
      });
      REQUIRE(units.ok());
      pressure("race" + std::to_string(i));
      done.WaitForNotification();
      found += got.found_blocks;
      REQUIRE(node.store->ReleasePrefetch(got.handle, WorkerId("w")).ok());
    }
    REQUIRE(node.cache->WaitForDemotions(absl::Seconds(10)));
    node.store->Quiesce();
    INFO("units prefetched: " << found);
    REQUIRE(node.cache->CheckInvariantsForTesting().ok());
    const CacheReport r = node.cache->Report();
    CHECK(r.live_requests == 0);
    for (const auto& g : r.pools[0].groups) {
      CHECK(g.owned == 0);
      CHECK(g.reserved == 0);
    }
    const int64_t hit = Serve(node, "after");
    CHECK((hit == 0 || hit == 8));
    REQUIRE(node.store->Flush().ok());
    // A prefetch left running when the node goes down (a restart): finished or dropped, never half.
    (void)node.store->PrefetchUnits(ns, prompt, WorkerId("w"), [](PrefetchInfo) {});
  }
  testing::Node node(tiers, HybridOptions());
  REQUIRE(node.cache->CheckInvariantsForTesting().ok());
  const int64_t peek = std::max(*node.cache->PeekPrefixLen(ns, prompt), node.store->PeekUnits(ns, prompt));
  CHECK(Serve(node, "restarted") == peek);
}

}  // namespace
}  // namespace kvd
