// TierStore against a real host arena and KvCache: demotion and promotion on every tier and codec,
// checksums, flush, warm restart, objects, budgets and a full disk.
#include "server/store/tier_store.h"

#include <sys/mount.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <catch2/catch.hpp>

#include "absl/synchronization/notification.h"
#include "gpu/host_arena.h"
#include "server/store/segment_file.h"
#include "tests/unit/core/test_util.h"
#include "tests/unit/store/store_fixture.h"

namespace kvd {
namespace {

using testing::Seq;
using testing::Spec;
using testing::Node;
using testing::ScopedDir;
using testing::Tiers;
using testing::kBlockBytes;

TEST_CASE("Demote then promote returns identical bytes from every tier with every codec",
          "[store]") {
  for (Codec codec : {Codec::kNone, Codec::kLz4, Codec::kZstd}) {
    for (int tier : {1, 2}) {
      INFO("codec " << CodecName(codec) << ", tier " << TierName(tier));
      const ScopedDir dir;
      Node node(Tiers(dir, codec));
      const std::vector<Token> prompt = Seq(100, 13);  // 3 full blocks reusable
      node.Publish("a", prompt);
      REQUIRE(node.cache->Gc().blocks_freed == 3);  // G1 -> G2
      if (tier == 2) {
        auto flushed = node.store->Flush();
        REQUIRE(flushed.ok());
        REQUIRE(flushed->durable);
        REQUIRE(flushed->written_blocks == 3);
        node.store->DropMemory();  // only G3 holds them now
        REQUIRE(node.store->Stats().host_records == 0);
      }
      REQUIRE(*node.cache->PeekPrefixLen(Spec("x", prompt).ns, prompt) == 0);  // device tier only
      REQUIRE(node.Serve("b", prompt) == 12);
      const TierStats s = node.store->Stats();
      REQUIRE(s.promotions[tier] == 3);
      REQUIRE(s.promoted_tokens == 12);
      // Promoted blocks are back in G1: the next lookup hits on the device.
      REQUIRE(*node.cache->PeekPrefixLen(Spec("x", prompt).ns, prompt) == 12);
      if (tier == 2 && codec != Codec::kNone) REQUIRE(s.stored_bytes_written < s.raw_bytes_written);
    }
  }
}

TEST_CASE("Capacity eviction demotes instead of dropping, and G2 spills to G3", "[store]") {
  const ScopedDir dir;
  Node node(Tiers(dir, Codec::kNone, /*host_blocks=*/2), /*capacity_blocks=*/4);
  // Four 1-block prefixes through a 4-block pool: later requests evict earlier blocks.
  for (int i = 0; i < 6; ++i) node.Publish("p" + std::to_string(i), Seq(1000 * (i + 1), 5));
  node.store->WaitIdleForTesting();
  const TierStats s = node.store->Stats();
  REQUIRE(s.demotions[static_cast<int>(EvictReason::kCapacity)][1] >= 2);
  REQUIRE(s.disk_records >= 1);  // G2 (2 slots) overflowed into G3
  for (int i = 0; i < 6; ++i) {
    REQUIRE(node.Serve("s" + std::to_string(i), Seq(1000 * (i + 1), 5)) == 4);
  }
}

TEST_CASE("A block whose bytes changed on disk is never served; the others are", "[store]") {
  const ScopedDir dir;
  Node node(Tiers(dir));
  const std::vector<Token> prompt = Seq(7, 13);
  node.Publish("a", prompt);
  node.cache->Gc();
  REQUIRE(node.store->Flush()->durable);
  node.store->DropMemory();
  // Flip one byte in the second block's payload.
  const std::string seg = dir.path + "/" + SegmentName(1);
  int64_t size = 0;
  auto headers = ReadSegmentHeaders(seg, &size);
  REQUIRE(headers.ok());
  REQUIRE(headers->size() == 3);
  const RecordHeader* second = nullptr;
  for (const RecordHeader& h : *headers) {
    if (h.tokens.front() == prompt[4]) second = &h;
  }
  REQUIRE(second != nullptr);
  {
    std::fstream f(seg, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(second->offset + 5));
    char c = 0;
    f.read(&c, 1);
    c ^= 0x40;
    f.seekp(static_cast<std::streamoff>(second->offset + 5));
    f.write(&c, 1);
  }
  REQUIRE(node.Serve("b", prompt) == 4);  // block 0 promoted; block 1 failed its checksum
  REQUIRE(node.store->Stats().checksum_failures == 1);
  // The corrupt block is gone from the index; the first block keeps serving.
  node.cache->ClearCache();
  REQUIRE(node.Serve("c", prompt) == 4);
}

TEST_CASE("A warm restart serves every flushed prefix and lists them", "[store]") {
  const ScopedDir dir;
  const std::vector<Token> p1 = Seq(1, 13), p2 = testing::Concat(Seq(1, 8), Seq(500, 5));
  {
    Node node(Tiers(dir, Codec::kLz4));
    node.Publish("a", p1);
    node.Publish("b", p2);  // shares two blocks with p1
    auto r = node.store->Flush();  // straight from G1
    REQUIRE(r.ok());
    REQUIRE(r->durable);
    REQUIRE(r->written_blocks == 4);
    REQUIRE(node.store->Stats().pending_snapshot_records == 0);
  }
  Node node(Tiers(dir, Codec::kZstd));  // another codec now: old records still read
  REQUIRE(node.store->Stats().reloaded_records == 4);
  std::vector<SavedPrefix> saved = node.store->SavedPrefixes();
  REQUIRE(saved.size() == 2);
  std::vector<std::vector<Token>> tokens;
  for (const SavedPrefix& p : saved) tokens.push_back(p.tokens);
  std::sort(tokens.begin(), tokens.end());
  REQUIRE(tokens[0] == std::vector<Token>(p1.begin(), p1.begin() + 12));
  REQUIRE(tokens[1] == std::vector<Token>(p2.begin(), p2.begin() + 12));
  // Events: everything cleared, then one stored (disk) per reloaded block.
  auto events = node.cache->events().ReadAfter(0, 100).events;
  REQUIRE(events.size() == 5);
  REQUIRE(events[0].kind == CacheEventKind::kCleared);
  for (size_t i = 1; i < events.size(); ++i) {
    REQUIRE(events[i].kind == CacheEventKind::kStored);
    REQUIRE(events[i].medium == "disk");
  }
  REQUIRE(node.Serve("c", p1) == 12);
  REQUIRE(node.Serve("d", p2) == 12);
}

TEST_CASE("A pool redefined under the same name never gets old bytes", "[store]") {
  const ScopedDir dir;
  {
    Node node(Tiers(dir));
    node.Publish("a", Seq(1, 9));
    REQUIRE(node.store->Flush()->durable);
  }
  CacheOptions o = testing::SmallOptions(8);
  o.pools[0].num_layers = 4;
  o.pools[0].bytes_per_token_per_layer = 4;  // same block bytes, another layout
  auto arena = *HostArena::Create(o.pools);
  auto cache = testing::MakeCache(o, SystemClock::Get());
  auto store = *TierStore::Open(Tiers(dir), arena.get(), cache.get());
  REQUIRE(store->Load().ok());
  REQUIRE(store->Stats().incompatible == 2);
  REQUIRE(store->SavedPrefixes().empty());
}

TEST_CASE("A warm restart under another model fingerprint serves none of the old blocks", "[store]") {
  const ScopedDir dir;
  const std::vector<Token> prompt = Seq(1, 9);
  const auto with_model = [](const std::string& fingerprint) {
    CacheOptions o = testing::SmallOptions(8);
    o.pools[0].model_fingerprint = fingerprint;
    return o;
  };
  {
    Node node(Tiers(dir), with_model("m@v1"));
    node.Publish("a", prompt);
    REQUIRE(node.store->Flush()->durable);
  }
  {
    Node node(Tiers(dir), with_model("m@v2"));  // same name and shape, other weights
    REQUIRE(node.store->Stats().reloaded_records == 0);
    REQUIRE(node.store->Stats().incompatible == 2);
    REQUIRE(node.store->SavedPrefixes().empty());
    REQUIRE(node.Serve("b", prompt) == 0);
  }
  {
    Node node(Tiers(dir), with_model(""));  // a pool without a fingerprint cannot vouch for them either
    REQUIRE(node.store->Stats().incompatible == 2);
    REQUIRE(node.Serve("c", prompt) == 0);
  }
  Node node(Tiers(dir), with_model("m@v1"));  // the weights that wrote them
  REQUIRE(node.store->Stats().reloaded_records == 2);
  REQUIRE(node.Serve("d", prompt) == 8);
}

TEST_CASE("Blocks written without a model fingerprint are served to a pool that declares one only if it still has none",
          "[store]") {
  const ScopedDir dir;
  const std::vector<Token> prompt = Seq(1, 9);
  {
    Node node(Tiers(dir));
    node.Publish("a", prompt);
    REQUIRE(node.store->Flush()->durable);
  }
  CacheOptions o = testing::SmallOptions(8);
  o.pools[0].model_fingerprint = "m@v1";
  {
    Node node(Tiers(dir), o);
    REQUIRE(node.store->Stats().incompatible == 2);
    REQUIRE(node.Serve("b", prompt) == 0);
  }
  Node node(Tiers(dir));  // pools without a fingerprint work as before
  REQUIRE(node.store->Stats().reloaded_records == 2);
  REQUIRE(node.Serve("c", prompt) == 8);
}

TEST_CASE("Objects: put, get, delete, across tiers and a restart", "[store]") {
  const ScopedDir dir;
  Namespace ns;
  ns.pool = "m";
  const std::string big(5 * kBlockBytes + 3, 'x');  // spans several G2 slots
  const auto get = [](TierStore& s, const Namespace& n, const std::string& key) {
    absl::StatusOr<std::string> out;
    absl::Notification done;
    s.GetObject(n, key, [&](absl::StatusOr<std::string> r) {
      out = std::move(r);
      done.Notify();
    });
    done.WaitForNotification();
    return out;
  };
  {
    Node node(Tiers(dir, Codec::kZstd, /*host_blocks=*/8));
    REQUIRE(node.store->PutObject(ns, "img-1", "pixels").ok());
    REQUIRE(node.store->PutObject(ns, "img-2", big).ok());
    REQUIRE(node.store->PutObject(ns, "img-3", "gone soon").ok());
    REQUIRE(node.store->PutObject(ns, "", "x").code() == absl::StatusCode::kInvalidArgument);
    REQUIRE(*get(*node.store, ns, "img-2") == big);
    REQUIRE(node.store->Flush()->durable);
    REQUIRE(node.store->DeleteObject(ns, "img-3").ok());
    REQUIRE(get(*node.store, ns, "img-3").status().code() == absl::StatusCode::kNotFound);
    Namespace other = ns;
    other.cache_salt = "tenant-b";
    REQUIRE(get(*node.store, other, "img-1").status().code() == absl::StatusCode::kNotFound);
    node.store->WaitIdleForTesting();
  }
  Node node(Tiers(dir));
  REQUIRE(node.store->Stats().objects == 2);
  REQUIRE(*get(*node.store, ns, "img-1") == "pixels");
  REQUIRE(*get(*node.store, ns, "img-2") == big);
  REQUIRE(get(*node.store, ns, "img-3").status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("Prefetch handles are bounded per worker", "[store]") {
  const ScopedDir dir;
  TierOptions t = Tiers(dir);
  t.max_prefetch_handles_per_worker = 2;
  Node node(t);
  const std::vector<Token> prompt = Seq(40, 13);
  const Namespace ns = Spec("x", prompt).ns;
  auto a = node.store->Prefetch(ns, prompt, WorkerId("w0"));
  auto b = node.store->Prefetch(ns, prompt, WorkerId("w0"));
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  auto c = node.store->Prefetch(ns, prompt, WorkerId("w0"));
  REQUIRE(c.status().code() == absl::StatusCode::kResourceExhausted);
  REQUIRE(c.status().message().find("max_prefetch_handles_per_worker") != absl::string_view::npos);
  REQUIRE(node.store->Prefetch(ns, prompt, WorkerId("w1")).ok());  // another worker's own
  REQUIRE(node.store->ReleasePrefetch(a->handle, WorkerId("w0")).ok());
  REQUIRE(node.store->Prefetch(ns, prompt, WorkerId("w0")).ok());
  node.store->ReleasePrefetchesOf(WorkerId("w0"));
  REQUIRE(node.store->Stats().prefetch_handles == 1);
  REQUIRE(node.store->Prefetch(ns, prompt, WorkerId("w0")).ok());
}

TEST_CASE("Prefetch brings saved blocks up to host memory and holds them until released",
          "[store]") {
  const ScopedDir dir;
  Node node(Tiers(dir));
  const std::vector<Token> prompt = Seq(40, 13);
  node.Publish("a", prompt);
  node.cache->Gc();
  REQUIRE(node.store->Flush()->durable);
  node.store->DropMemory();
  auto info = node.store->Prefetch(Spec("x", prompt).ns, prompt, WorkerId("w0"));
  REQUIRE(info.ok());
  REQUIRE(info->found_blocks == 3);
  REQUIRE(info->loading_blocks == 3);
  node.store->WaitIdleForTesting();
  REQUIRE(node.store->Stats().host_records == 3);
  REQUIRE(node.store->ReleasePrefetch(info->handle, WorkerId("w1")).code() ==
          absl::StatusCode::kPermissionDenied);

  REQUIRE(node.Serve("b", prompt) == 12);
  REQUIRE(node.store->Stats().promotions[1] == 3);  // served from host memory, not disk
  REQUIRE(node.store->ReleasePrefetch(info->handle, WorkerId("w0")).ok());
  REQUIRE(node.store->ReleasePrefetch(info->handle, WorkerId("w0")).code() ==
          absl::StatusCode::kNotFound);
}

TEST_CASE("The disk budget deletes least-recently-used segments", "[store]") {
  const ScopedDir dir;
  TierOptions t = Tiers(dir, Codec::kNone, 1);
  t.segment_bytes = kBlockBytes;      // one block per segment
  t.disk_bytes = 3 * (kBlockBytes + 200);  // about three segments
  Node node(t, 4);
  for (int i = 0; i < 8; ++i) {
    node.Publish("p" + std::to_string(i), Seq(100 * (i + 1), 5));
    REQUIRE(node.store->Flush()->durable);
  }
  const TierStats s = node.store->Stats();
  REQUIRE(s.disk_used_bytes <= t.disk_bytes);
  REQUIRE(s.disk_segments <= 3);
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path)) {
    files += e.path().extension() == ".kvd" ? 1 : 0;
  }
  REQUIRE(files == s.disk_segments);
}

TEST_CASE("Flush on a full filesystem reports not durable and the cache keeps serving",
          "[store][root]") {
  if (geteuid() != 0) {
    WARN("skipped: mounting a small tmpfs needs root");
    return;
  }
  const ScopedDir dir;
  if (mount("tmpfs", dir.path.c_str(), "tmpfs", 0, "size=16k") != 0) {
    WARN("skipped: cannot mount tmpfs here");
    return;
  }
  {
    TierOptions t = Tiers(dir, Codec::kNone, 64);
    t.segment_bytes = 64 << 10;
    Node node(t, 512);
    // Far more than 16 KiB of blocks.
    for (int i = 0; i < 20; ++i) node.Publish("p" + std::to_string(i), Seq(10000 * (i + 1), 81));
    auto r = node.store->Flush();
    REQUIRE(r.ok());
    REQUIRE_FALSE(r->durable);
    REQUIRE(r->failed_blocks > 0);
    REQUIRE_FALSE(r->error.empty());
    REQUIRE_FALSE(node.store->Stats().last_flush_durable);
    // Nothing in memory was lost: the device tier still serves every prefix.
    for (int i = 0; i < 20; ++i) {
      REQUIRE(node.Serve("s" + std::to_string(i), Seq(10000 * (i + 1), 81)) == 80);
    }
  }
  umount(dir.path.c_str());
}

TEST_CASE("Record headers and manifests reject garbage without crashing", "[store]") {
  RecordHeader h;
  h.ns.pool = "m";
  h.ns.media_keys = {"a", "b"};
  h.tokens = {1, 2, 3, 4};
  h.key = BlockKey{1, 2};
  h.raw_length = 64;
  std::string enc;
  EncodeRecordHeader(h, &enc);
  absl::string_view in(enc);
  auto back = DecodeRecordHeader(&in);
  REQUIRE(back.ok());
  REQUIRE(back->tokens == h.tokens);
  REQUIRE(back->ns == h.ns);
  REQUIRE(in.empty());
  for (size_t cut = 0; cut < enc.size(); ++cut) {
    absl::string_view part(enc.data(), cut);
    REQUIRE(DecodeRecordHeader(&part).status().code() == absl::StatusCode::kDataLoss);
  }
  uint32_t seed = 1;
  for (int i = 0; i < 2000; ++i) {
    std::string junk(static_cast<size_t>(seed % 200), '\0');
    for (char& c : junk) c = static_cast<char>((seed = seed * 1103515245 + 12345) >> 16);
    absl::string_view j(junk);
    (void)DecodeRecordHeader(&j);
  }
  const ScopedDir dir;
  REQUIRE(ReadManifest(dir).status().code() == absl::StatusCode::kNotFound);
  REQUIRE(WriteFileDurably(dir, kManifestName, "KVDMAN1\0garbage").ok());
  REQUIRE(ReadManifest(dir).status().code() == absl::StatusCode::kDataLoss);
}

TEST_CASE("Codecs round-trip and fall back to none when data does not shrink", "[store]") {
  std::vector<uint8_t> raw(4096);
  for (size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<uint8_t>(i / 64);
  for (Codec c : {Codec::kNone, Codec::kLz4, Codec::kZstd}) {
    std::string stored;
    const Codec used = Compress(c, raw, &stored);
    REQUIRE(used == c);
    std::vector<uint8_t> back(raw.size());
    REQUIRE(Decompress(used, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(stored.data()),
                                                 stored.size()),
                       back.data(), static_cast<int64_t>(back.size()))
                .ok());
    REQUIRE(back == raw);
    REQUIRE(Decompress(used, {}, back.data(), 4096).code() == absl::StatusCode::kDataLoss);
  }
  std::vector<uint8_t> noise(256);
  uint32_t x = 7;
  for (uint8_t& b : noise) b = static_cast<uint8_t>((x = x * 1664525 + 1013904223) >> 24);
  std::string stored;
  REQUIRE(Compress(Codec::kZstd, noise, &stored) == Codec::kNone);
  REQUIRE(ParseCodec("brotli").status().code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvd

namespace kvd {
namespace {

TEST_CASE("Idle demotion moves idle host blocks to disk until it is stopped", "[store]") {
  // The store reads the cache's clock: a FakeClock moves time, no test sleeps.
  FakeClock clock;
  const ScopedDir dir;
  TierOptions t = Tiers(dir);
  t.idle_demote_after = absl::Seconds(10);
  Node node(t, 8, &clock);
  node.Publish("a", Seq(1, 9));
  REQUIRE(node.cache->Gc(t.idle_demote_after).blocks_freed == 0);  // just used: not idle yet
  clock.Advance(absl::Seconds(11));
  REQUIRE(node.cache->Gc(t.idle_demote_after).blocks_freed == 2);  // G1 -> G2
  REQUIRE(node.store->Stats().host_records == 2);
  node.store->StopIdleDemotion();
  clock.Advance(absl::Seconds(11));
  node.store->DemoteIdle();
  node.store->WaitIdleForTesting();
  REQUIRE(node.store->Stats().disk_records == 0);  // stopped: nothing moved
  REQUIRE_FALSE(node.store->idle_demotion());
  REQUIRE(node.Serve("b", Seq(1, 9)) == 8);
  // A second store with idle demotion on spills idle host blocks to disk, and only idle ones.
  const ScopedDir dir2;
  TierOptions t2 = Tiers(dir2);
  t2.idle_demote_after = t.idle_demote_after;
  Node other(t2, 8, &clock);
  other.Publish("a", Seq(1, 9));
  clock.Advance(absl::Seconds(11));
  other.cache->Gc(t.idle_demote_after);
  other.store->DemoteIdle();
  other.store->WaitIdleForTesting();
  REQUIRE(other.store->Stats().disk_records == 0);  // demoted to host just now: not idle there
  clock.Advance(absl::Seconds(11));
  other.store->DemoteIdle();
  other.store->WaitIdleForTesting();
  const TierStats s = other.store->Stats();
  REQUIRE(s.disk_records == 2);
  REQUIRE(s.host_records == 0);
  REQUIRE(s.demotions[kNumEvictReasons][2] == 2);
  REQUIRE(other.Serve("b", Seq(1, 9)) == 8);
}

}  // namespace
}  // namespace kvd
