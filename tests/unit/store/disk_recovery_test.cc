// The disk tier under damage and concurrency: a flush racing evictions, a lost or damaged
// manifest, unreadable, truncated and corrupt segments, corrupt records found by prefetch. Each
// case restarts a real TierStore on the damaged directory and checks what is served, what is kept
// on disk, and what is quarantined. A hybrid pool's generation checkpoint comes back whole after a
// flush and a restart, never under another grouping, never damaged.
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include <catch2/catch.hpp>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "proto/vocab/step_types.h"
#include "server/store/segment_file.h"
#include "tests/unit/store/hybrid_store_fixture.h"
#include "tests/unit/store/store_fixture.h"

namespace kvd {
namespace {

using testing::Bytes;
using testing::HybridOptions;
using testing::kRec;
using testing::Node;
using testing::Read;
using testing::ScopedDir;
using testing::Seq;
using testing::Spec;
using testing::Tiers;
namespace fs = std::filesystem;

// Three prompts of three full blocks each, flushed to one directory.
const std::vector<std::vector<Token>> kPrompts = {Seq(100, 13), Seq(200, 13), Seq(300, 13)};

// Tiers whose flush writes one segment for everything these tests publish.
TierOptions OneSegment(const std::string& dir) {
  TierOptions t = Tiers(dir);
  t.segment_bytes = 64 * testing::kBlockBytes;
  return t;
}

void PublishAll(Node& node) {
  for (size_t i = 0; i < kPrompts.size(); ++i) node.Publish("p" + std::to_string(i), kPrompts[i]);
}

std::vector<std::string> SegmentFiles(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (ParseSegmentName(e.path().filename().string())) out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

void FlipByte(const std::string& path, int64_t at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  c ^= 0x10;
  f.seekp(at);
  f.write(&c, 1);
}

TEST_CASE("Flush: blocks evicted from the device while it runs are written, not skipped",
          "[store][flush]") {
  const ScopedDir dir;
  {
    Node node(Tiers(dir, Codec::kNone, /*host_blocks=*/16), /*capacity_blocks=*/16);
    PublishAll(node);
    // Between the host-tier pass and the device pass every device block is demoted (what a
    // `kvdctl gc` or ordinary load does): they land in the host tier after its pass.
    node.store->SetFlushHookForTesting([&] { REQUIRE(node.cache->Gc().blocks_freed == 9); });
    auto r = node.store->Flush();
    REQUIRE(r.ok());
    REQUIRE(r->durable);
    REQUIRE(r->written_blocks == 9);
    node.store->SetFlushHookForTesting(nullptr);
  }
  Node node(Tiers(dir));  // a restart: only what is on disk
  REQUIRE(node.store->Stats().reloaded_records == 9);
  for (size_t i = 0; i < kPrompts.size(); ++i) REQUIRE(node.Serve("r" + std::to_string(i), kPrompts[i]) == 12);
}

TEST_CASE("Flush: a block dropped from every tier while it runs makes the answer not durable",
          "[store][flush]") {
  const ScopedDir dir;
  TierOptions t = Tiers(dir, Codec::kNone, /*host_blocks=*/0);
  t.segment_bytes = 1;  // the spill cap (4 segments) holds no block: an evicted block is dropped
  Node node(t, /*capacity_blocks=*/16);
  PublishAll(node);
  node.store->SetFlushHookForTesting([&] { node.cache->Gc(); });
  auto r = node.store->Flush();
  REQUIRE(r.ok());
  REQUIRE_FALSE(r->durable);
  REQUIRE(r->failed_blocks == 9);
  REQUIRE(r->error.find("dropped from every tier") != std::string::npos);
  node.store->SetFlushHookForTesting(nullptr);
}

TEST_CASE("Flush racing a gc waits for blocks still being copied down: durable, never a false loss",
          "[store][flush]") {
  // The gc evicts under the cache lock and copies each block down after it, on its own thread
  // (here slowly); the flush meets them out of G1 and not yet in host memory, and must wait for
  // them instead of calling them dropped.
  const ScopedDir dir;
  Node node(Tiers(dir, Codec::kNone, /*host_blocks=*/16), /*capacity_blocks=*/16);
  PublishAll(node);
  absl::Notification copying;
  node.store->SetDemotionHookForTesting([&] {
    if (!copying.HasBeenNotified()) copying.Notify();
    absl::SleepFor(absl::Milliseconds(30));
  });
  std::thread gc;
  node.store->SetFlushHookForTesting([&] {
    gc = std::thread([&] { node.cache->Gc(); });
    copying.WaitForNotification();  // every block has left G1; the copies have just begun
  });
  auto r = node.store->Flush();
  gc.join();
  node.store->SetFlushHookForTesting(nullptr);
  node.store->SetDemotionHookForTesting(nullptr);
  REQUIRE(r.ok());
  INFO(r->error);
  REQUIRE(r->durable);
  REQUIRE(r->written_blocks == 9);
}

TEST_CASE("A lost manifest is rebuilt from the segments; no segment is deleted", "[store][recovery]") {
  const ScopedDir dir;
  {
    Node node(Tiers(dir));
    PublishAll(node);
    REQUIRE(node.store->Flush()->durable);
  }
  const std::vector<std::string> before = SegmentFiles(dir);
  REQUIRE(!before.empty());
  SECTION("missing") { REQUIRE(fs::remove(dir.path + "/" + kManifestName)); }
  SECTION("damaged") {
    FlipByte(dir.path + "/" + kManifestName, 12);
  }
  {
    Node node(Tiers(dir));
    REQUIRE(node.store->Stats().reloaded_records == 9);
    REQUIRE(SegmentFiles(dir) == before);
    for (size_t i = 0; i < kPrompts.size(); ++i) REQUIRE(node.Serve("r" + std::to_string(i), kPrompts[i]) == 12);
  }
  REQUIRE(ReadManifest(dir).ok());  // written anew
  REQUIRE(ReadManifest(dir)->segments.size() == before.size());
}

TEST_CASE("A segment that cannot be read is kept and served once it can be", "[store][recovery]") {
  const ScopedDir dir;
  {
    Node node(OneSegment(dir), /*capacity_blocks=*/16);
    PublishAll(node);
    REQUIRE(node.store->Flush()->durable);
  }
  const std::vector<std::string> segs = SegmentFiles(dir);
  REQUIRE(segs.size() == 1);
  const std::string aside = dir.path + "/aside";
  // An I/O error on open or read, as root can see it: the name is a directory (EISDIR). (Mode
  // 000 would not stop root.)
  fs::rename(segs[0], aside);
  fs::create_directory(segs[0]);
  {
    Node node(OneSegment(dir));
    const TierStats s = node.store->Stats();
    REQUIRE(s.reloaded_records == 0);
    REQUIRE(s.read_errors == 1);
    REQUIRE(s.checksum_failures == 0);
    REQUIRE(s.quarantined_segments == 0);
    REQUIRE(s.disk_segments == 1);  // still listed
    REQUIRE(node.Serve("r", kPrompts[0]) == 0);
  }
  auto m = ReadManifest(dir);
  REQUIRE(m.ok());
  REQUIRE(m->segments.size() == 1);  // not dropped from the manifest
  fs::remove(segs[0]);
  fs::rename(aside, segs[0]);
  Node node(OneSegment(dir));
  REQUIRE(node.store->Stats().reloaded_records == 9);
  REQUIRE(node.Serve("r", kPrompts[1]) == 12);
}

TEST_CASE("A truncated segment serves its intact records", "[store][recovery]") {
  const ScopedDir dir;
  {
    Node node(OneSegment(dir));
    node.Publish("a", kPrompts[0]);
    REQUIRE(node.store->Flush()->durable);
  }
  const std::vector<std::string> segs = SegmentFiles(dir);
  REQUIRE(segs.size() == 1);
  int64_t size = 0;
  auto headers = ReadSegmentHeaders(segs[0], &size);
  REQUIRE(headers.ok());
  uint64_t last = 0;
  for (const RecordHeader& h : *headers) last = std::max(last, h.offset);
  fs::resize_file(segs[0], last + 1);  // the last record's bytes are cut
  int64_t truncated = 0;
  REQUIRE(ReadSegmentHeaders(segs[0], &size, &truncated)->size() == 2);
  REQUIRE(truncated == 1);
  Node node(OneSegment(dir));
  REQUIRE(node.store->Stats().reloaded_records == 2);
  REQUIRE(node.store->Stats().quarantined_segments == 0);
}

TEST_CASE("A flipped bit in a segment's preamble quarantines it; start-up goes on", "[store][recovery]") {
  for (int64_t at : {8, 9, 11, 12, 16, 23, 24}) {  // count, reserved word, header bytes, checksum
    INFO("byte " << at);
    const ScopedDir dir;
    {
      Node node(OneSegment(dir));
      node.Publish("a", kPrompts[0]);
      node.Publish("b", kPrompts[1]);
      REQUIRE(node.store->Flush()->durable);
    }
    std::vector<std::string> segs = SegmentFiles(dir);
    REQUIRE(segs.size() == 1);
    FlipByte(segs[0], at);
    int64_t size = 0;
    REQUIRE(ReadSegmentHeaders(segs[0], &size).status().code() == absl::StatusCode::kDataLoss);
    {
      Node node(OneSegment(dir));
      REQUIRE(node.store->Stats().quarantined_segments == 1);
      REQUIRE(node.store->Stats().reloaded_records == 0);
      REQUIRE(node.Serve("r", kPrompts[0]) == 0);
    }
    REQUIRE(SegmentFiles(dir).empty());
    REQUIRE(fs::exists(dir.path + "/quarantine/" + fs::path(segs[0]).filename().string()));
  }
}

TEST_CASE("A record count far larger than the file is refused before any allocation", "[store][recovery]") {
  const ScopedDir dir;
  std::string seg("KVDSEG1\0", 8);
  const uint32_t count = 0xFFFFFFFF, zero = 0;
  const uint64_t hbytes = 0, hsum = 0;
  seg.append(reinterpret_cast<const char*>(&count), 4);
  seg.append(reinterpret_cast<const char*>(&zero), 4);
  seg.append(reinterpret_cast<const char*>(&hbytes), 8);
  seg.append(reinterpret_cast<const char*>(&hsum), 8);
  std::ofstream(dir.path + "/seg", std::ios::binary) << seg;
  int64_t size = 0;
  auto r = ReadSegmentHeaders(dir.path + "/seg", &size);
  REQUIRE(r.status().code() == absl::StatusCode::kDataLoss);
  REQUIRE(r.status().message().find("record count") != absl::string_view::npos);
}

TEST_CASE("The smallest record header is kMinRecordHeaderBytes long", "[store]") {
  std::string enc;
  EncodeRecordHeader(RecordHeader{}, &enc);
  REQUIRE(enc.size() == kMinRecordHeaderBytes);
}

TEST_CASE("A corrupt record found by prefetch is tombstoned: a restart does not bring it back",
          "[store][recovery]") {
  const ScopedDir dir;
  {
    Node node(Tiers(dir));
    node.Publish("a", kPrompts[0]);
    node.cache->Gc();
    REQUIRE(node.store->Flush()->durable);
    node.store->DropMemory();
    const std::vector<std::string> segs = SegmentFiles(dir);
    int64_t size = 0;
    auto headers = ReadSegmentHeaders(segs[0], &size);
    REQUIRE(headers.ok());
    FlipByte(segs[0], static_cast<int64_t>((*headers)[0].offset + 3));
    auto info = node.store->Prefetch(Spec("x", kPrompts[0]).ns, kPrompts[0], WorkerId("w0"));
    REQUIRE(info.ok());
    REQUIRE(info->loading_blocks == 3);
    node.store->WaitIdleForTesting();
    REQUIRE(node.store->Stats().checksum_failures == 1);
    REQUIRE(node.store->ReleasePrefetch(info->handle, WorkerId("w0")).ok());
    node.store->WaitIdleForTesting();
  }
  Node node(Tiers(dir));
  REQUIRE(node.store->Stats().reloaded_records == 2);
}


// A generation of [1, 10] computed to 10 on the hybrid pool, every unit a checkpoint at 10 keeps
// filled with a pattern of its group and position (full 0..2, swa 1..2, the state at 10), then
// checkpointed with the state and ended interrupted (or, with `preempt`, preempted by a step).
void CheckpointGeneration(Node& node, bool preempt) {
  const PoolGeometry& g = node.cache->pools()[0];
  RequestSpec a = Spec("gen", Seq(1, 10), 8);
  a.owner = WorkerId("w0");
  const AcquireResult ra = testing::Start(*node.cache, a);
  const StepOpResult grown = testing::Grow(*node.cache, "gen", 0, 8);
  REQUIRE(grown.status.ok());
  testing::GroupView view{ra.group_tables[1].first_block_position, ra.group_tables[1].blocks};
  view.Apply(grown.group_tables[1]);
  const std::vector<BlockIndex>& swa = view.blocks;
  REQUIRE(view.first == 0);
  REQUIRE(swa.size() == 3);
  for (int i = 0; i < 3; ++i) {
    REQUIRE(node.arena->WriteBlock(0, ra.blocks[i], Bytes(g, ra.blocks[i], 40 + i).data()).ok());
    REQUIRE(node.arena->WriteBlock(0, swa[i], Bytes(g, swa[i], 50 + i).data()).ok());
  }
  const BlockIndex running = ra.group_tables[kRec].blocks[0];
  REQUIRE(node.arena->WriteBlock(0, running, Bytes(g, running, 60).data()).ok());
  if (preempt) {
    StepOp op;
    op.kind = StepOpKind::kPreempt;
    op.id = a.id;
    op.token_ids = Seq(1, 10);
    op.engine_state = "engine";
    op.state_checkpoints = {{kRec, 10, running}};
    std::vector<StepOp> ops;
    ops.push_back(std::move(op));
    REQUIRE(node.cache->Step(WorkerId("w0"), WorkerId("w0"), std::move(ops), {}, nullptr)[0].status.ok());
  } else {
    REQUIRE(node.cache->Checkpoint(a.id, Seq(1, 10), "engine", std::vector<StateCheckpoint>{{kRec, 10, running}}).ok());
    REQUIRE(node.cache->Release(a.id, /*completed=*/false).ok());
  }
  REQUIRE(node.cache->CheckInvariantsForTesting().ok());
}

// Resumes "gen" as `id`: whether it resumed, and then every unit checked against its pattern.
bool ResumesExactly(Node& node, const std::string& id) {
  const PoolGeometry& g = node.cache->pools()[0];
  RequestSpec b = Spec(id, Seq(1, 10), 8);
  b.owner = WorkerId("w1");
  b.resume_from = RequestId("gen");
  const AcquireResult rb = testing::Start(*node.cache, b);
  if (rb.resumed) {
    CHECK(rb.cached_tokens == 10);
    CHECK(rb.engine_state == "engine");
    for (int i = 0; i < 3; ++i) CHECK(Read(node, rb.blocks[i]) == Bytes(g, rb.blocks[i], 40 + i));
    // A computation at 10 reads positions 5..9: window blocks 1 and 2.
    CHECK(rb.group_tables[1].first_block_position == 1);
    for (int i = 0; i < 2; ++i) {
      const BlockIndex w = rb.group_tables[1].blocks[i];
      CHECK(Read(node, w) == Bytes(g, w, 51 + i));
    }
    REQUIRE(rb.group_tables[kRec].checkpoint_slot >= 0);
    const BlockIndex slot = static_cast<BlockIndex>(rb.group_tables[kRec].checkpoint_slot);
    CHECK(Read(node, slot) == Bytes(g, slot, 60));
  }
  REQUIRE(node.cache->Release(b.id, true).ok());
  REQUIRE(node.cache->CheckInvariantsForTesting().ok());
  const CacheReport r = node.cache->Report();
  for (const PoolReport::Group& grp : r.pools[0].groups) CHECK(grp.owned == 0);
  CHECK(r.pools[0].reserved_blocks == 0);
  return rb.resumed;
}

TEST_CASE("A hybrid generation checkpoint is flushed whole and resumed exactly after a restart",
          "[store][hybrid][hybrid_checkpoint]") {
  const bool preempt = GENERATE(false, true);
  INFO((preempt ? "preempted" : "checkpointed, then interrupted"));
  const ScopedDir dir;
  {
    Node node(Tiers(dir), HybridOptions());
    CheckpointGeneration(node, preempt);
    CHECK(node.cache->checkpoints_not_durable() == 1);
    auto f = node.store->Flush();
    REQUIRE(f.ok());
    REQUIRE(f->durable);
    CHECK(node.cache->checkpoints_not_durable() == 0);
    CHECK(node.store->Stats().pending_checkpoints == 0);
    auto again = node.store->Flush();  // nothing changed: nothing written again
    REQUIRE(again.ok());
    CHECK(again->written_blocks == 0);
  }
  {
    Node node(Tiers(dir), HybridOptions(5));  // another window: another grouping
    CHECK(node.store->Stats().incompatible >= 1);
    CHECK(node.store->Stats().restored_checkpoints == 0);
    CHECK(node.cache->Report().orphaned_checkpoints == 0);
    CHECK_FALSE(ResumesExactly(node, "other-grouping"));
  }
  {
    Node node(Tiers(dir), HybridOptions());  // the record stayed for its own grouping
    CHECK(node.store->Stats().restored_checkpoints == 1);
    CHECK(node.cache->checkpoints_not_durable() == 0);
    CHECK(ResumesExactly(node, "b"));
  }
}

TEST_CASE("A hybrid checkpoint record with a flipped byte or cut short is never restored",
          "[store][hybrid][hybrid_checkpoint]") {
  const bool cut = GENERATE(false, true);
  const ScopedDir dir;
  {
    Node node(Tiers(dir), HybridOptions());
    CheckpointGeneration(node, /*preempt=*/false);
    REQUIRE(node.store->Flush()->durable);
  }
  // The checkpoint is the only record: every segment's payload is its bytes.
  int damaged = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path)) {
    if (e.path().filename().string().rfind("seg-", 0) != 0) continue;
    if (cut) {
      std::filesystem::resize_file(e.path(), std::filesystem::file_size(e.path()) - 1);
    } else {
      // A byte of the last unit (the state slot), past the checksummed header section.
      const std::streamoff at = static_cast<std::streamoff>(std::filesystem::file_size(e.path())) - 10;
      std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(at);
      char c = 0;
      f.read(&c, 1);
      c = static_cast<char>(c ^ 0x5a);
      f.seekp(at);
      f.write(&c, 1);
    }
    ++damaged;
  }
  REQUIRE(damaged == 1);
  Node node(Tiers(dir), HybridOptions());
  CHECK(node.store->Stats().restored_checkpoints == 0);
  CHECK(node.cache->Report().orphaned_checkpoints == 0);
  CHECK_FALSE(ResumesExactly(node, "b"));
}

}  // namespace
}  // namespace kvd
