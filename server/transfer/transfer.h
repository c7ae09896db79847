// Transfer is kvd's peer transfer, whole: the Peer service on its own mutual-TLS listener
// (peer_service.h) and the puller that Start's `peer` hint drives (peer_puller.h). Blocks travel
// over that authenticated channel only: kvd exposes no one-sided memory access to anyone. The daemon creates it when the config has a `transfer:` section; docs/transfer.md
// describes the protocol and docs/operations.md how to run it.
#pragma once

#include <memory>
#include <string>

#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "gpu/device_arena.h"
#include "server/core/peer_port.h"
#include "server/core/tier_port.h"
#include "server/transfer/peer_puller.h"
#include "server/transfer/peer_service.h"
#include "server/transfer/transfer_metrics.h"
#include "server/transfer/transfer_options.h"

namespace kvd {

class Transfer {
 public:
  // Binds options.listen and serves peers. INVALID_ARGUMENT (a TLS file), UNAVAILABLE (the
  // address cannot be bound). Borrowed: cache, units (hybrid pools' units, peer_port.h) and arena
  // outlive this.
  static absl::StatusOr<std::unique_ptr<Transfer>> Start(const TransferOptions& options, TierPort* cache,
                                                         PeerPort* units, const DeviceArena* arena);
  ~Transfer();  // stops serving peers (their leases are released), then finishes running pulls

  PeerPuller* puller() const { return puller_.get(); }
  // HOST:PORT as bound (the port picked when listen asked for 0).
  const std::string& bound() const { return bound_; }
  std::shared_ptr<prometheus::Registry> metrics_registry() const { return metrics_->registry(); }

 private:
  Transfer() = default;
  std::unique_ptr<TransferMetrics> metrics_;
  std::unique_ptr<PeerService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<PeerPuller> puller_;
  std::string bound_;
};

}  // namespace kvd
