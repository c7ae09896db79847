#include "server/obs/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "proto/vocab/status_macros.h"
#include "server/core/kv_cache.h"
#include "server/events/router_event_publisher.h"
#include "server/obs/process_stats.h"
#include "server/store/tier_store.h"

namespace kvd {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

// Builds metric families from KvCache::Report() at scrape time.
class CacheCollector final : public prometheus::Collectable {
 public:
  CacheCollector(const KvCache* cache, std::function<int64_t()> workers, std::string backend,
                 const TierStore* tiers, const RouterEventPublisher* router_events)
      : cache_(cache), workers_(std::move(workers)), backend_(std::move(backend)), tiers_(tiers),
        router_events_(router_events) {}

  // From now on Collect reads none of the borrowed sources (they may go); returns once no Collect
  // is reading them.
  void Detach() {
    absl::MutexLock lock(&mu_);
    detached_ = true;
  }

  std::vector<MetricFamily> Collect() const override {
    absl::ReaderMutexLock lock(&mu_);
    if (detached_) return {};
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
      // The states partition the pool (a block is free, owned or cached): they add up to total.
      add_bytes("total", p.capacity_blocks);
      add_bytes("free", p.free_blocks);
      add_bytes("owned", p.owned_blocks);
      add_bytes("cached_referenced", p.cached_blocks - p.evictable_blocks);
      add_bytes("cached_evictable", p.evictable_blocks);
    }
    MetricFamily& capacity = family("kvd_pool_capacity_blocks", "Blocks per pool.", MetricType::Gauge);
    for (const PoolReport& p : r.pools) add(capacity, p.capacity_blocks, {{"pool", p.name}});
    CollectGroups(r, family, add);
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
    add(family("kvd_attached_workers", "Workers attached.", MetricType::Gauge), workers_());
    if (tiers_ != nullptr) CollectTiers(family, add);
    if (router_events_ != nullptr) {
      const RouterEventStats e = router_events_->Stats();
      add(family("kvd_router_event_batches_total", "Router event batches published on ZMQ.", MetricType::Counter), e.batches);
      add(family("kvd_router_events_total", "Router events (BlockStored/BlockRemoved/AllBlocksCleared) published.", MetricType::Counter), e.events);
      add(family("kvd_router_replayed_batches_total", "Batches resent to replay requests.", MetricType::Counter), e.replayed_batches);
      MetricFamily& lost = family("kvd_router_events_lost_total", "Cache events not announced to routers, by reason.", MetricType::Counter);
      add(lost, e.dropped, {{"reason", "queue_full"}});
      add(lost, e.unhashable, {{"reason", "parent_unknown"}});
    }
    add(family("kvd_checkpoint_bytes", "KV bytes pinned by checkpoints awaiting resume.", MetricType::Gauge),
        r.checkpoint_bytes);
    add(family("kvd_checkpoint_state_bytes", "Daemon memory held by checkpoints (engine state and tokens).", MetricType::Gauge),
        r.checkpoint_state_bytes);
    const ProcessStats proc = ReadProcessStats();
    add(family("process_resident_memory_bytes", "Resident memory of the kvd process.", MetricType::Gauge), proc.resident_bytes);
    add(family("process_virtual_memory_bytes", "Virtual memory of the kvd process.", MetricType::Gauge), proc.virtual_bytes);
    add(family("process_open_fds", "Open file descriptors.", MetricType::Gauge), proc.open_fds);
    add(family("process_max_fds", "Limit on open file descriptors.", MetricType::Gauge), proc.max_fds);
    add(family("process_cpu_seconds_total", "User and system CPU time.", MetricType::Counter), proc.cpu_seconds);
    add(family("process_start_time_seconds", "Start time of the kvd process since the Unix epoch.", MetricType::Gauge),
        proc.start_time_seconds);
    add(family("kvd_published_blocks_total", "Blocks kept by Publish.", MetricType::Counter), r.published_blocks);
    add(family("kvd_duplicate_blocks_total",
               "Published positions identical to a cached block (the cached one is kept; counted once).",
               MetricType::Counter),
        r.duplicate_blocks);
    add(family("kvd_no_parent_blocks_total",
               "Published positions not cached because their chain broke before them (counted once).",
               MetricType::Counter),
        r.no_parent_blocks);
    add(family("kvd_events_total", "Index events emitted (last sequence number).", MetricType::Counter),
        r.last_event_sequence);
    add(family("kvd_build_info", "Build information (value 1).", MetricType::Gauge), 1,
        {{"backend", backend_}, {"version", KVD_VERSION}});
    return out;
  }

 private:
  // Hybrid pools: the states of kvd_blocks / kvd_bytes per KV group (docs/hybrid.md §2.9), in
  // families of their own so that sums over the pool-wide ones still count each unit once. Absent
  // when no pool has groups. The group label is bounded: a pool has at most kMaxKvGroups groups.
  template <typename Family, typename Add>
  void CollectGroups(const CacheReport& r, Family& family, Add& add) const {
    const std::vector<PoolGeometry>& geometries = cache_->pools();
    const bool any = std::any_of(r.pools.begin(), r.pools.end(), [](const PoolReport& p) { return !p.groups.empty(); });
    if (!any) return;
    const auto kind_of = [&](size_t pool, size_t g) {
      return pool < geometries.size() && g < geometries[pool].groups.size() ? KvGroupKindName(geometries[pool].groups[g].kind)
                                                                              : std::string();
    };
    // `each(f)` calls f(pool report, group report, kind) for every group of every hybrid pool. A
    // family is filled before the next is made (`family` may move the earlier ones).
    const auto each = [&](auto&& f) {
      for (size_t i = 0; i < r.pools.size(); ++i) {
        for (size_t g = 0; g < r.pools[i].groups.size(); ++g) f(r.pools[i], r.pools[i].groups[g], kind_of(i, g));
      }
    };
    {
      MetricFamily& units = family("kvd_group_units",
                                   "Units of a hybrid pool's KV group (blocks; state slots for a state group) by state.",
                                   MetricType::Gauge);
      each([&](const PoolReport& p, const PoolReport::Group& g, const std::string& kind) {
        const auto put = [&](const char* s, int64_t n) {
          add(units, static_cast<double>(n), {{"pool", p.name}, {"group", g.name}, {"kind", kind}, {"state", s}});
        };
        put("free", g.free);
        put("owned", g.owned);
        put("cached_referenced", g.cached - g.evictable);
        put("cached_evictable", g.evictable);
      });
    }
    {
      MetricFamily& bytes = family("kvd_group_bytes",
                                   "KV bytes of a hybrid pool's KV group by state (free + owned + cached = total; "
                                   "reserved: charged to the budget).",
                                   MetricType::Gauge);
      each([&](const PoolReport& p, const PoolReport::Group& g, const std::string&) {
        const auto put = [&](const char* s, int64_t n) {
          add(bytes, static_cast<double>(n * g.unit_bytes), {{"pool", p.name}, {"group", g.name}, {"state", s}});
        };
        put("total", g.capacity);
        put("free", g.free);
        put("owned", g.owned);
        put("cached_referenced", g.cached - g.evictable);
        put("cached_evictable", g.evictable);
        put("reserved", g.reserved);
      });
    }
    {
      MetricFamily& capacity = family("kvd_group_capacity_units", "Units of a hybrid pool's KV group.", MetricType::Gauge);
      each([&](const PoolReport& p, const PoolReport::Group& g, const std::string& kind) {
        add(capacity, static_cast<double>(g.capacity), {{"pool", p.name}, {"group", g.name}, {"kind", kind}});
      });
    }
    {
      MetricFamily& hits = family("kvd_hybrid_limited_hits_total",
                                  "Lookups on a hybrid pool whose hit this KV group shortened (limited_by).",
                                  MetricType::Counter);
      each([&](const PoolReport& p, const PoolReport::Group& g, const std::string&) {
        add(hits, static_cast<double>(g.limited_hits), {{"pool", p.name}, {"group", g.name}});
      });
    }
    {
      MetricFamily& tokens = family("kvd_hybrid_limited_tokens_total",
                                    "Prompt tokens lookups on a hybrid pool lost to this KV group: the full group's hit "
                                    "minus the hit served.",
                                    MetricType::Counter);
      each([&](const PoolReport& p, const PoolReport::Group& g, const std::string&) {
        add(tokens, static_cast<double>(g.limited_tokens), {{"pool", p.name}, {"group", g.name}});
      });
    }
    MetricFamily& checkpoints = family("kvd_state_checkpoints",
                                       "State checkpoints cached in a hybrid pool's state group, by whether a request "
                                       "reads one now.",
                                       MetricType::Gauge);
    each([&](const PoolReport& p, const PoolReport::Group& g, const std::string& kind) {
      if (kind != KvGroupKindName(KvGroupKind::kState)) return;
      add(checkpoints, static_cast<double>(g.cached - g.evictable), {{"pool", p.name}, {"group", g.name}, {"state", "referenced"}});
      add(checkpoints, static_cast<double>(g.evictable), {{"pool", p.name}, {"group", g.name}, {"state", "evictable"}});
    });
  }

  // The G2/G3 families, from TierStore::Stats().
  template <typename Family, typename Add>
  void CollectTiers(Family& family, Add& add) const {
    const TierStats t = tiers_->Stats();
    MetricFamily& bytes = family("kvd_tier_bytes", "Bytes of the lower tiers by tier and state.", MetricType::Gauge);
    add(bytes, t.host_capacity_bytes, {{"tier", "host"}, {"state", "total"}});
    add(bytes, t.host_used_bytes, {{"tier", "host"}, {"state", "used"}});
    add(bytes, t.disk_capacity_bytes, {{"tier", "disk"}, {"state", "total"}});
    add(bytes, t.disk_used_bytes, {{"tier", "disk"}, {"state", "used"}});
    MetricFamily& records = family("kvd_tier_records", "Blocks and objects held by each lower tier.", MetricType::Gauge);
    add(records, t.host_records, {{"tier", "host"}});
    add(records, t.disk_records, {{"tier", "disk"}});
    add(family("kvd_objects", "Objects in the object cache.", MetricType::Gauge), t.objects);
    MetricFamily& dem = family("kvd_demotions_total", "Blocks moved down a tier, by reason and destination.", MetricType::Counter);
    for (int r = 0; r <= kNumEvictReasons; ++r) {
      const std::string reason = r == kNumEvictReasons ? "idle_or_spill" : EvictReasonName(static_cast<EvictReason>(r));
      for (int to = 1; to < kNumTiers; ++to) add(dem, t.demotions[r][to], {{"reason", reason}, {"to", TierName(to)}});
    }
    MetricFamily& pro = family("kvd_promotions_total", "Blocks promoted into the device pool, by source tier.", MetricType::Counter);
    for (int from = 1; from < kNumTiers; ++from) add(pro, t.promotions[from], {{"from", TierName(from)}});
    if (t.remote_enabled) add(pro, t.remote_promotions, {{"from", "remote"}});
    add(family("kvd_promoted_tokens_total", "Prompt tokens served by promotion from a lower tier.", MetricType::Counter), t.promoted_tokens);
    add(family("kvd_tier_dropped_total", "Records dropped for lack of room in every tier.", MetricType::Counter), t.dropped);
    add(family("kvd_tier_checksum_failures_total", "Stored records that failed verification (never served).", MetricType::Counter), t.checksum_failures);
    add(family("kvd_tier_read_errors_total", "Disk-tier reads that failed without proof of damage (records kept).", MetricType::Counter), t.read_errors);
    add(family("kvd_tier_quarantined_segments_total", "Damaged segments moved to quarantine/ at start-up.", MetricType::Counter), t.quarantined_segments);
    add(family("kvd_tier_write_failures_total", "Disk-tier writes (segments, manifest) that failed.", MetricType::Counter), t.write_failures);
    MetricFamily& flushes = family("kvd_flushes_total", "Flushes by result.", MetricType::Counter);
    add(flushes, t.flushes - t.flush_failures, {{"result", "durable"}});
    add(flushes, t.flush_failures, {{"result", "not_durable"}});
    add(family("kvd_flush_duration_seconds", "Duration of the last flush.", MetricType::Gauge), t.last_flush_seconds);
    add(family("kvd_last_flush_durable", "1 when the last flush made everything durable.", MetricType::Gauge), t.last_flush_durable ? 1 : 0);
    MetricFamily& pending = family("kvd_pending_persistence_records", "Records not yet on the disk tier.", MetricType::Gauge);
    add(pending, t.pending_spill_records, {{"kind", "spill"}});
    add(pending, t.pending_snapshot_records, {{"kind", "snapshot"}});
    add(pending, t.pending_checkpoints, {{"kind", "checkpoint"}});
    add(family("kvd_pending_persistence_bytes", "Demoted bytes waiting for the disk writer.", MetricType::Gauge), t.pending_spill_bytes);
    add(family("kvd_tier_compression_ratio", "Raw over stored bytes written to the disk tier.", MetricType::Gauge),
        t.stored_bytes_written == 0 ? 1.0 : static_cast<double>(t.raw_bytes_written) / t.stored_bytes_written);
    add(family("kvd_tier_reloaded_records", "Records the last warm restart reloaded.", MetricType::Gauge), t.reloaded_records);
    if (t.remote_enabled) CollectRemote(t, family, add);
  }

  // G4 (Redis) families.
  template <typename Family, typename Add>
  void CollectRemote(const TierStats& t, Family& family, Add& add) const {
    const RemoteStats& r = t.remote;
    add(family("kvd_remote_available", "1 when the Redis tier is in use, 0 while skipped after a failure.", MetricType::Gauge),
        r.available ? 1 : 0);
    add(family("kvd_remote_lookups_total", "Prefix lookups sent to the Redis tier (one round trip each).", MetricType::Counter), r.lookups);
    add(family("kvd_remote_hit_blocks_total", "Blocks Redis lookups found.", MetricType::Counter), r.hit_blocks);
    MetricFamily& blocks = family("kvd_remote_blocks_total", "Blocks moved to or from the Redis tier, by direction.", MetricType::Counter);
    add(blocks, r.fetched_blocks, {{"direction", "fetched"}});
    add(blocks, r.uploaded_blocks, {{"direction", "uploaded"}});
    add(blocks, r.refreshed_blocks, {{"direction", "refreshed"}});
    add(blocks, r.upload_dropped, {{"direction", "upload_dropped"}});
    MetricFamily& bytes = family("kvd_remote_bytes_total", "Bytes moved to or from the Redis tier (as stored).", MetricType::Counter);
    add(bytes, r.fetched_bytes, {{"direction", "fetched"}});
    add(bytes, r.uploaded_bytes, {{"direction", "uploaded"}});
    add(family("kvd_remote_calls_total", "Uses of the Redis tier attempted (each may fail or be skipped).", MetricType::Counter), r.calls);
    add(family("kvd_remote_errors_total", "Failed Redis calls (connect, timeout, protocol).", MetricType::Counter), r.errors);
    add(family("kvd_remote_skipped_total", "Redis calls skipped during a failure back-off.", MetricType::Counter), r.skipped);
    add(family("kvd_remote_oom_refusals_total", "Values Redis refused for want of memory (full under noeviction): skipped.", MetricType::Counter), r.oom_refusals);
    add(family("kvd_remote_corrupt_total", "Redis values that failed verification (never served).", MetricType::Counter), r.corrupt);
    if (r.cluster) {
      MetricFamily& redirects = family("kvd_remote_cluster_redirects_total",
                                       "Redis Cluster redirections followed: moved (the slot has a new master), "
                                       "ask (the slot is migrating).", MetricType::Counter);
      add(redirects, r.moved, {{"kind", "moved"}});
      add(redirects, r.asked, {{"kind", "ask"}});
      add(family("kvd_remote_cluster_slot_refreshes_total", "Redis Cluster slot maps read (CLUSTER SLOTS).",
                 MetricType::Counter), r.slot_refreshes);
      add(family("kvd_remote_cluster_masters", "Masters in the Redis Cluster slot map last read.", MetricType::Gauge),
          r.cluster_masters);
    }
  }

  mutable absl::Mutex mu_;
  bool detached_ ABSL_GUARDED_BY(mu_) = false;
  const KvCache* cache_;
  const std::function<int64_t()> workers_;
  const std::string backend_;
  const TierStore* tiers_;
  const RouterEventPublisher* router_events_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Start(const std::string& listen,
                                                        const KvCache* cache,
                                                        std::function<int64_t()> workers,
                                                        const std::string& backend,
                                                        const TierStore* tiers,
                                                        const RouterEventPublisher* router_events) {
  std::unique_ptr<Metrics> m(new Metrics());
  m->registry_ = std::make_shared<prometheus::Registry>();
  m->rpc_latency_ = &prometheus::BuildHistogram()
                         .Name("kvd_rpc_latency_seconds")
                         .Help("Latency of control-plane RPCs, by method and status code.")
                         .Register(*m->registry_);
  m->admission_wait_ = &prometheus::BuildHistogram()
                            .Name("kvd_admission_wait_seconds")
                            .Help("Time each Start waited for room in the KV budget (0: admitted at once), by pool and outcome.")
                            .Register(*m->registry_);
  // The exposer holds weak pointers: the collector lives here.
  m->collector_ = std::make_shared<CacheCollector>(cache, std::move(workers), backend, tiers, router_events);
  KVD_RETURN_IF_ERROR(m->Listen(listen));
  return m;
}

absl::Status Metrics::Listen(const std::string& listen) {
  if (listen.empty() || exposer_ != nullptr) return absl::OkStatus();
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(listen);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot serve /metrics on ", listen, ": ", e.what()));
  }
  exposer_->RegisterCollectable(registry_);
  exposer_->RegisterCollectable(collector_);
  for (const auto& c : extra_) exposer_->RegisterCollectable(c);
  auto ports = exposer_->GetListeningPorts();
  port_ = ports.empty() ? 0 : ports[0];
  return absl::OkStatus();
}

void Metrics::AddCollectable(std::shared_ptr<prometheus::Collectable> collectable) {
  extra_.push_back(collectable);
  if (exposer_ != nullptr) exposer_->RegisterCollectable(collectable);
}

void Metrics::DetachSources() { static_cast<CacheCollector*>(collector_.get())->Detach(); }

Metrics::~Metrics() = default;

void Metrics::ObserveAdmissionWait(absl::string_view pool, absl::string_view outcome, double seconds) {
  // The first bucket is "did not wait": a Start admitted at once observes 0.
  static const prometheus::Histogram::BucketBoundaries kBuckets = {0, 1e-3, 10e-3, 0.1, 0.5, 1, 2.5, 5, 10, 30};
  admission_wait_->Add({{"pool", std::string(pool)}, {"outcome", std::string(outcome)}}, kBuckets).Observe(seconds);
}

void Metrics::ObserveRpc(absl::string_view method, absl::StatusCode code, double seconds) {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3, 0.25, 1};
  rpc_latency_
      ->Add({{"method", std::string(method)}, {"code", absl::StatusCodeToString(code)}}, kBuckets)
      .Observe(seconds);
}

}  // namespace kvd
