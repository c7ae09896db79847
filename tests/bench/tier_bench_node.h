// One node for the tier benchmarks: a host arena, a KvCache over one pool and a TierStore under it
// (loaded), wired as the daemon wires them. Header-only; benchmarks exit on any error.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <utility>

#include "absl/synchronization/notification.h"
#include "gpu/host_arena.h"
#include "server/core/kv_cache.h"
#include "server/store/tier_store.h"

namespace kvd {

inline void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

struct TierBenchNode {
  std::unique_ptr<HostArena> arena;
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<TierStore> store;

  TierBenchNode(const PoolGeometry& g, TierOptions t, CacheOptions o = {}) {
    o.pools = {g};
    arena = *HostArena::Create(o.pools);
    cache = *KvCache::Create(o, SystemClock::Get());
    auto s = TierStore::Open(std::move(t), arena.get(), cache.get());
    Check(s.status(), "open tiers");
    store = std::move(*s);
    cache->SetEvictionSink(store.get());
    Check(store->Load(), "load");
  }
  ~TierBenchNode() {
    cache->SetEvictionSink(nullptr);
    store.reset();
  }
  // Admit + Acquire + promotion; returns the request's table and cached tokens.
  std::pair<AcquireResult, int64_t> Start(const RequestSpec& spec) {
    Check(cache->Admit(spec).status(), "admit");
    absl::StatusOr<AcquireResult> acq = cache->Acquire(spec.id);
    Check(acq.status(), "acquire");
    int64_t cached = acq->cached_tokens;
    absl::Notification done;
    if (store->Promote(spec.id, spec, *acq, [&](absl::StatusOr<int64_t> r) {
          if (r.ok()) cached = *r;
          done.Notify();
        })) {
      done.WaitForNotification();
    }
    return {*acq, cached};
  }
};

}  // namespace kvd
