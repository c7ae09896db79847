#include "server/transfer/transfer_metrics.h"

namespace kvd {

TransferMetrics::TransferMetrics() : registry_(std::make_shared<prometheus::Registry>()) {
  pulls_ = &prometheus::BuildCounter()
                .Name("kvd_peer_pulls_total")
                .Help("Pulls from peer kvds (Start with a peer), by outcome: pulled, nothing, or the cause of failure.")
                .Register(*registry_);
  auto& blocks = prometheus::BuildCounter().Name("kvd_peer_pulled_blocks_total").Help("Blocks pulled from peers and published.").Register(*registry_);
  pulled_blocks_ = &blocks.Add({});
  auto& bytes = prometheus::BuildCounter().Name("kvd_peer_pulled_bytes_total").Help("KV bytes pulled from peers and published.").Register(*registry_);
  pulled_bytes_ = &bytes.Add({});
  auto& seconds = prometheus::BuildHistogram()
                      .Name("kvd_peer_pull_seconds")
                      .Help("Time of each pull that published blocks, from Offer to the last checksum.")
                      .Register(*registry_);
  pull_seconds_ = &seconds.Add({}, prometheus::Histogram::BucketBoundaries{1e-3, 5e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10});
  offers_ = &prometheus::BuildCounter()
                 .Name("kvd_peer_offers_total")
                 .Help("Offers answered to peers, by outcome: offered, nothing, unauthenticated, or the error code.")
                 .Register(*registry_);
  auto& offered = prometheus::BuildCounter().Name("kvd_peer_offered_blocks_total").Help("Blocks pinned for peers by Offer.").Register(*registry_);
  offered_blocks_ = &offered.Add({});
  reads_ = &prometheus::BuildCounter()
                .Name("kvd_peer_reads_total")
                .Help("Reads of leased blocks answered to peers, by outcome: read, or the error code.")
                .Register(*registry_);
  auto& read = prometheus::BuildCounter().Name("kvd_peer_read_blocks_total").Help("Leased blocks copied out to peers by Read.").Register(*registry_);
  read_blocks_ = &read.Add({});
  auto& leases = prometheus::BuildGauge().Name("kvd_peer_leases").Help("Offers whose blocks peers hold pinned now.").Register(*registry_);
  leases_ = &leases.Add({});
}

void TransferMetrics::Pull(absl::string_view outcome) { pulls_->Add({{"outcome", std::string(outcome)}}).Increment(); }

void TransferMetrics::Pulled(int64_t blocks, int64_t bytes, double seconds) {
  pulled_blocks_->Increment(static_cast<double>(blocks));
  pulled_bytes_->Increment(static_cast<double>(bytes));
  pull_seconds_->Observe(seconds);
}

void TransferMetrics::Offer(absl::string_view outcome, int64_t blocks) {
  offers_->Add({{"outcome", std::string(outcome)}}).Increment();
  offered_blocks_->Increment(static_cast<double>(blocks));
}

void TransferMetrics::Read(absl::string_view outcome, int64_t blocks) {
  reads_->Add({{"outcome", std::string(outcome)}}).Increment();
  read_blocks_->Increment(static_cast<double>(blocks));
}

}  // namespace kvd
