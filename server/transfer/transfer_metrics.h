// The peer-transfer families of /metrics, in their own registry (Metrics::AddCollectable exposes
// it): kvd_peer_pulls_total{outcome}, kvd_peer_pulled_blocks_total, kvd_peer_pulled_bytes_total,
// kvd_peer_pull_seconds (a histogram of whole pulls that moved blocks), kvd_peer_offers_total
// {outcome}, kvd_peer_offered_blocks_total, kvd_peer_reads_total{outcome},
// kvd_peer_read_blocks_total, kvd_peer_leases (held now). Thread-safe.
#pragma once

#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace kvd {

class TransferMetrics {
 public:
  TransferMetrics();
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // A pull's outcome: "pulled", "nothing" (the peer held no more), or the failure's cause
  // ("offer", "geometry", "bounds", "transfer", "timeout", "checksum", "request_gone",
  // "shed": the peer's queue of pulls was full).
  void Pull(absl::string_view outcome);
  void Pulled(int64_t blocks, int64_t bytes, double seconds);
  // An Offer's outcome: "offered", "nothing", "unauthenticated", or the error's code name.
  void Offer(absl::string_view outcome, int64_t blocks = 0);
  // A Read's outcome: "read", or the error's code name ("NOT_FOUND" for a stale or foreign lease).
  void Read(absl::string_view outcome, int64_t blocks = 0);
  void SetLeases(int64_t leases) { leases_->Set(static_cast<double>(leases)); }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* pulls_;
  prometheus::Counter* pulled_blocks_;
  prometheus::Counter* pulled_bytes_;
  prometheus::Histogram* pull_seconds_;
  prometheus::Family<prometheus::Counter>* offers_;
  prometheus::Counter* offered_blocks_;
  prometheus::Family<prometheus::Counter>* reads_;
  prometheus::Counter* read_blocks_;
  prometheus::Gauge* leases_;
};

}  // namespace kvd
