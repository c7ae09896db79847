// PeerService answers kvd.peer.v1.Peer for peer daemons (proto/kvd/peer/v1/peer.proto): Offer
// pins this kvd's longest cached prefix of a prompt under a lease and says where its blocks lie;
// Release, or the lease's expiry, unpins them. It serves on its own mutual-TLS listener
// (Transfer), and only callers whose verified certificate names an allowed peer.
//
// A block's checksum is computed once per time it is cached (keyed by its insertion serial) and
// kept, so that a prefix many decode nodes pull is hashed once.
//
// Thread-safe. mu_ guards the lease table, sums_mu_ the checksums kept; pinning, unpinning (the
// engine's lock) and hashing (block bytes) run under neither. A reaper thread expires leases.
#pragma once

#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "gpu/device_arena.h"
#include "kvd/peer/v1/peer.grpc.pb.h"
#include "server/core/tier_port.h"
#include "server/transfer/transfer_metrics.h"
#include "server/transfer/transfer_options.h"
#include "server/transfer/ucx_node.h"

namespace kvd {

class PeerService final : public peer::v1::Peer::CallbackService {
 public:
  // Borrowed: all must outlive this.
  PeerService(TierPort* cache, const DeviceArena* arena, const UcxNode* node, const TransferOptions& options,
              TransferMetrics* metrics);
  ~PeerService() override;  // unpins every lease

  grpc::ServerUnaryReactor* Offer(grpc::CallbackServerContext* ctx, const peer::v1::OfferRequest* req,
                                  peer::v1::OfferResponse* resp) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* ctx, const peer::v1::ReleaseRequest* req,
                                    peer::v1::ReleaseResponse* resp) override;

  int64_t leases() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Lease {
    PoolId pool = 0;
    std::vector<BlockIndex> blocks;
    absl::Time expires;
    std::string peer;  // the certificate name that took it
  };
  // The allowed name the caller's certificate carries; PERMISSION_DENIED otherwise.
  absl::StatusOr<std::string> Authenticate(const grpc::CallbackServerContext* ctx) const;
  absl::Status DoOffer(const std::string& peer, const peer::v1::OfferRequest& req, peer::v1::OfferResponse* resp);
  // Removes leases past their expiry (all when `all`) and unpins their blocks, outside mu_.
  void Expire(bool all) ABSL_LOCKS_EXCLUDED(mu_);
  void ReapLoop() ABSL_LOCKS_EXCLUDED(mu_);

  TierPort* const cache_;
  const DeviceArena* const arena_;
  const UcxNode* const node_;
  const TransferOptions options_;
  const absl::flat_hash_set<std::string> allowed_;
  TransferMetrics* const metrics_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Lease> leases_ ABSL_GUARDED_BY(mu_);
  int64_t reserved_ ABSL_GUARDED_BY(mu_) = 0;  // Offers between their count check and their lease
  uint64_t next_lease_ ABSL_GUARDED_BY(mu_) = 1;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  mutable absl::Mutex sums_mu_;
  // (pool << 32 | block) -> (serial, checksum): one entry per block index at most.
  absl::flat_hash_map<uint64_t, std::pair<uint64_t, uint64_t>> sums_ ABSL_GUARDED_BY(sums_mu_);
  std::thread reaper_;
};

}  // namespace kvd
