// Test fixtures for the tier store: a temporary directory and a daemon's worth of state (host
// arena, KvCache, TierStore) in one process.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/synchronization/notification.h"
#include "gpu/host_arena.h"
#include "server/store/tier_store.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace testing {

inline constexpr int64_t kBlockBytes = 4 * 2 * 8;  // SmallOptions: 4 tokens x 2 layers x 8 bytes

// A temporary directory, removed when it goes out of scope: declare it before the Node using it,
// so the Node (and its writer thread) is gone first.
struct ScopedDir {
  std::string path;
  ScopedDir() {
    char tmpl[] = "/tmp/kvd-store-XXXXXX";
    REQUIRE(mkdtemp(tmpl) != nullptr);
    path = tmpl;
  }
  ~ScopedDir() { std::filesystem::remove_all(path); }
  operator const std::string&() const { return path; }
};

// A daemon's worth of state in one process: arena, cache and tiers.
struct Node {
  std::unique_ptr<HostArena> arena;
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<TierStore> store;

  explicit Node(TierOptions t, int64_t capacity_blocks = 8, const Clock* clock = SystemClock::Get())
      : Node(std::move(t), testing::SmallOptions(capacity_blocks), clock) {}
  Node(TierOptions t, const CacheOptions& o, const Clock* clock = SystemClock::Get()) {
    arena = *HostArena::Create(o.pools);
    cache = testing::MakeCache(o, clock);
    auto s = TierStore::Open(std::move(t), arena.get(), cache.get());
    REQUIRE(s.ok());
    store = std::move(*s);
    cache->SetEvictionSink(store.get());
    REQUIRE(store->Load().ok());
  }
  ~Node() {
    if (store && cache) CheckStats();
    if (cache) cache->SetEvictionSink(nullptr);
    store.reset();
  }

  // The store's incremental gauges against a scan of every index (once writes settle).
  void CheckStats() {
    store->WaitIdleForTesting();
    const absl::Status s = store->CheckStatsForTesting();
    INFO(s.ToString());
    CHECK(s.ok());
  }

  // Block `b` of a request filled with a pattern derived from the token it starts with:
  // half a run of one byte (compressible), half varied.
  static std::vector<uint8_t> Pattern(Token first) {
    std::vector<uint8_t> v(kBlockBytes);
    for (int64_t i = 0; i < kBlockBytes; ++i) {
      v[i] = i < kBlockBytes / 2 ? static_cast<uint8_t>(first) : static_cast<uint8_t>(first * 31 + i * 7);
    }
    return v;
  }

  // Runs a request over `prompt`, writes the pattern into every block and publishes the full ones.
  void Publish(const std::string& id, const std::vector<Token>& prompt) {
    RequestSpec spec = Spec(id, prompt);
    AcquireResult acq = testing::Start(*cache, spec);
    for (size_t b = 0; b < acq.blocks.size(); ++b) {
      REQUIRE(arena->WriteBlock(0, acq.blocks[b], Pattern(prompt[b * 4]).data()).ok());
    }
    testing::PublishAll(*cache, spec, prompt, acq);
    REQUIRE(cache->Release(spec.id, true).ok());
  }

  // Admits and acquires `prompt`, promotes what the tiers hold, and checks every served block's
  // bytes. Returns the cached tokens after promotion.
  int64_t Serve(const std::string& id, const std::vector<Token>& prompt) {
    RequestSpec spec = Spec(id, prompt);
    AcquireResult acq = testing::Start(*cache, spec);
    int64_t cached = acq.cached_tokens;
    absl::Notification done;
    const bool started = store->Promote(spec.id, spec, acq, [&](absl::StatusOr<int64_t> r) {
      REQUIRE(r.ok());
      cached = *r;
      done.Notify();
    });
    if (started) done.WaitForNotification();
    std::vector<uint8_t> got(kBlockBytes);
    for (int64_t b = 0; b < cached / 4; ++b) {
      REQUIRE(arena->ReadBlock(0, acq.blocks[b], got.data()).ok());
      REQUIRE(got == Pattern(prompt[b * 4]));
    }
    REQUIRE(cache->Release(spec.id, true).ok());
    REQUIRE(cache->CheckInvariantsForTesting().ok());
    CheckStats();
    return cached;
  }
};

inline TierOptions Tiers(const std::string& dir, Codec codec = Codec::kNone, int64_t host_blocks = 4) {
  TierOptions t;
  t.host_bytes = host_blocks * kBlockBytes;
  t.disk_dir = dir;
  t.codec = codec;
  t.segment_bytes = 4 * kBlockBytes;
  return t;
}

}  // namespace testing
}  // namespace kvd
