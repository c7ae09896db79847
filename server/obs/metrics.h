// Metrics: kvd's Prometheus endpoint. RPC latency by method and status code is recorded as it
// happens; cache state (blocks by state, hit and miss tokens, evictions, budget, pressure,
// attached workers) is read from KvCache::Report() at scrape time, so nothing is double-counted.
// Thread-safe.
#pragma once

#include <functional>
#include <memory>
#include <vector>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace prometheus {
class Collectable;
class Exposer;
class Registry;
template <typename T>
class Family;
class Histogram;
}  // namespace prometheus

namespace kvd {

class KvCache;
class TierStore;
class RouterEventPublisher;

class Metrics {
 public:
  // Serves /metrics on `listen` (HOST:PORT, port 0 picks a free one); empty serves nothing but
  // still records. `cache` is borrowed and must outlive this; `attached_workers` counts the live
  // attachments (the rpc layer's registry, read through this function so that obs does not
  // depend on rpc). UNAVAILABLE when the address cannot be bound.
  // `backend` labels kvd_build_info. `tiers` and `router_events` (borrowed, may be null) add
  // their families.
  static absl::StatusOr<std::unique_ptr<Metrics>> Start(const std::string& listen,
                                                        const KvCache* cache,
                                                        std::function<int64_t()> attached_workers,
                                                        const std::string& backend,
                                                        const TierStore* tiers = nullptr,
                                                        const RouterEventPublisher* router_events = nullptr);
  ~Metrics();

  void ObserveRpc(absl::string_view method, absl::StatusCode code, double seconds);
  // One Start's wait for admission (zero when admitted at once), by pool and outcome
  // (admitted, or the status code that ended it): kvd_admission_wait_seconds.
  void ObserveAdmissionWait(absl::string_view pool, absl::string_view outcome, double seconds);
  // The bound port, or 0 when not serving.
  int port() const { return port_; }
  // Starts serving on `listen` when not serving yet (a successor at a hot handoff binds only once
  // its predecessor has let the port go). UNAVAILABLE when the address cannot be bound.
  absl::Status Listen(const std::string& listen);
  // Scrapes stop reading the cache, tiers and router events (which may then go); the endpoint
  // still answers, with RPC histograms only. Returns once no scrape reads them.
  void DetachSources();
  // Exposes `collectable` too (another component's registry), now and on a later Listen.
  void AddCollectable(std::shared_ptr<prometheus::Collectable> collectable);

 private:
  Metrics() = default;

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> collector_;  // cache state, read at scrape time
  std::vector<std::shared_ptr<prometheus::Collectable>> extra_;  // AddCollectable's
  prometheus::Family<prometheus::Histogram>* rpc_latency_ = nullptr;
  prometheus::Family<prometheus::Histogram>* admission_wait_ = nullptr;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
};

}  // namespace kvd
