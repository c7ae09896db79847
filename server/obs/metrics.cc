#include "server/obs/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/core/kv_cache.h"
#include "server/rpc/attachments.h"

namespace kvd {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

// Builds metric families from KvCache::Report() at scrape time.
class CacheCollector final : public prometheus::Collectable {
 public:
  CacheCollector(const KvCache* cache, const AttachmentRegistry* workers, std::string backend)
      : cache_(cache), workers_(workers), backend_(std::move(backend)) {}

  std::vector<MetricFamily> Collect() const override {
    const CacheReport r = cache_->Report();
    std::vector<MetricFamily> out;
    auto family = [&out](const char* name, const char* help, MetricType type) -> MetricFamily& {
      out.push_back(MetricFamily{name, help, type, {}});
      return out.back();
    };
    auto add = [](MetricFamily& f, double v, std::vector<ClientMetric::Label> labels = {}) {
      ClientMetric m;
      m.label = std::move(labels);
      if (f.type == MetricType::Counter) m.counter.value = v;
      else m.gauge.value = v;
      f.metric.push_back(std::move(m));
    };
    MetricFamily& blocks = family("kvd_blocks", "Blocks by pool and state.", MetricType::Gauge);
    for (const PoolReport& p : r.pools) {
      add(blocks, p.free_blocks, {{"pool", p.name}, {"state", "free"}});
      add(blocks, p.owned_blocks, {{"pool", p.name}, {"state", "owned"}});
      add(blocks, p.cached_blocks - p.evictable_blocks, {{"pool", p.name}, {"state", "cached_referenced"}});
      add(blocks, p.evictable_blocks, {{"pool", p.name}, {"state", "cached_evictable"}});
    }
    MetricFamily& bytes = family("kvd_bytes", "KV bytes by pool, tier and state.", MetricType::Gauge);
    for (const PoolReport& p : r.pools) {
      auto add_bytes = [&](const char* state, int64_t blocks) {
        add(bytes, static_cast<double>(blocks * p.block_bytes),
            {{"pool", p.name}, {"tier", "device"}, {"state", state}});
      };
      add_bytes("total", p.capacity_blocks);
      add_bytes("free", p.free_blocks);
      add_bytes("held", p.owned_blocks + p.cached_blocks - p.evictable_blocks);
      add_bytes("cached", p.cached_blocks);
    }
    MetricFamily& capacity = family("kvd_pool_capacity_blocks", "Blocks per pool.", MetricType::Gauge);
    for (const PoolReport& p : r.pools) add(capacity, p.capacity_blocks, {{"pool", p.name}});
    add(family("kvd_hit_tokens_total", "Prompt tokens served from cache.", MetricType::Counter), r.hit_tokens);
    add(family("kvd_miss_tokens_total", "Prompt tokens that had to be computed.", MetricType::Counter), r.miss_tokens);
    add(family("kvd_lookups_total", "Prefix lookups (Acquire without resume).", MetricType::Counter), r.lookups);
    MetricFamily& ev = family("kvd_evictions_total", "Blocks evicted, by reason.", MetricType::Counter);
    for (int i = 0; i < kNumEvictReasons; ++i) {
      add(ev, r.evictions[i], {{"reason", EvictReasonName(static_cast<EvictReason>(i))}});
    }
    MetricFamily& adm = family("kvd_admissions_total", "Admission decisions.", MetricType::Counter);
    add(adm, r.admitted, {{"result", "admitted"}});
    add(adm, r.waited, {{"result", "wait"}});
    add(adm, r.rejected, {{"result", "rejected"}});
    add(family("kvd_budget_bytes", "KV byte budget.", MetricType::Gauge), r.budget_bytes);
    add(family("kvd_reserved_bytes", "KV bytes reserved by requests and checkpoints.", MetricType::Gauge), r.reserved_bytes);
    add(family("kvd_live_requests", "Admitted, unreleased requests.", MetricType::Gauge), r.live_requests);
    add(family("kvd_sessions", "Sessions with affinity.", MetricType::Gauge), r.sessions);
    add(family("kvd_orphaned_checkpoints", "Checkpoints awaiting resume.", MetricType::Gauge), r.orphaned_checkpoints);
    add(family("kvd_pressure_level", "0 normal, 1 high, 2 critical.", MetricType::Gauge), static_cast<int>(r.pressure));
    add(family("kvd_attached_workers", "Workers attached.", MetricType::Gauge), workers_->size());
    add(family("kvd_checkpoint_bytes", "KV bytes pinned by checkpoints awaiting resume.", MetricType::Gauge),
        r.checkpoint_bytes);
    add(family("kvd_published_blocks_total", "Blocks kept by Publish.", MetricType::Counter), r.published_blocks);
    add(family("kvd_duplicate_blocks_total", "Published blocks dropped as duplicates.", MetricType::Counter),
        r.duplicate_blocks);
    add(family("kvd_events_total", "Index events emitted (last sequence number).", MetricType::Counter),
        r.last_event_sequence);
    add(family("kvd_build_info", "Build information (value 1).", MetricType::Gauge), 1,
        {{"backend", backend_}, {"version", KVD_VERSION}});
    return out;
  }

 private:
  const KvCache* cache_;
  const AttachmentRegistry* workers_;
  const std::string backend_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Start(const std::string& listen,
                                                        const KvCache* cache,
                                                        const AttachmentRegistry* workers,
                                                        const std::string& backend) {
  std::unique_ptr<Metrics> m(new Metrics());
  m->registry_ = std::make_shared<prometheus::Registry>();
  m->rpc_latency_ = &prometheus::BuildHistogram()
                         .Name("kvd_rpc_latency_seconds")
                         .Help("Latency of control-plane RPCs, by method and status code.")
                         .Register(*m->registry_);
  auto collector = std::make_shared<CacheCollector>(cache, workers, backend);
  if (!listen.empty()) {
    try {
      m->exposer_ = std::make_unique<prometheus::Exposer>(listen);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("cannot serve /metrics on ", listen, ": ", e.what()));
    }
    m->exposer_->RegisterCollectable(m->registry_);
    m->exposer_->RegisterCollectable(collector);
    auto ports = m->exposer_->GetListeningPorts();
    m->port_ = ports.empty() ? 0 : ports[0];
  }
  // The exposer holds weak pointers: keep the collector alive here.
  m->collector_ = std::move(collector);
  return m;
}

Metrics::~Metrics() = default;

void Metrics::ObserveRpc(absl::string_view method, absl::StatusCode code, double seconds) {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3, 0.25, 1};
  rpc_latency_
      ->Add({{"method", std::string(method)}, {"code", absl::StatusCodeToString(code)}}, kBuckets)
      .Observe(seconds);
}

}  // namespace kvd
