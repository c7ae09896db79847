// PeerService answers kvd.peer.v1.Peer for peer daemons (proto/kvd/peer/v1/peer.proto): Offer
// pins this kvd's longest cached prefix of a prompt under a lease; Read copies the lease's blocks
// out, this node reading its own memory on the peer's behalf; Release, or the lease's expiry,
// unpins them. It serves on its own mutual-TLS listener (Transfer), and only callers whose
// verified certificate names an allowed peer (PeerNames: DNS subjectAltNames, the CN only where a
// certificate has no subjectAltName, URI subjectAltNames only when allowed as `uri:`).
//
// What a peer can touch: the bytes of the blocks it was offered, while its lease holds, read by
// this process. Nothing else of this node's memory is reachable, and nothing is ever written
// (docs/security.md, "Peers").
//
// A block's checksum is computed once per time it is cached (keyed by its insertion serial) and
// kept, so that a prefix many decode nodes pull is hashed once.
//
// Thread-safe. mu_ guards the lease table, sums_mu_ the checksums kept; pinning, unpinning (the
// engine's lock), hashing and copying block bytes run under neither. A reaper thread expires
// leases; lease times are on the monotonic clock.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "gpu/device_arena.h"
#include "kvd/peer/v1/peer.grpc.pb.h"
#include "server/core/peer_port.h"
#include "server/core/tier_port.h"
#include "server/transfer/transfer_metrics.h"
#include "server/transfer/transfer_options.h"

namespace kvd {

// The names a peer certificate (PEM) is known by for the allow-list: its DNS subjectAltNames,
// and its URI subjectAltNames each as "uri:VALUE" (allowed only where transfer.allowed_peers
// names them so); its subject CN only where it has no subjectAltName at all. E-mail and IP
// subjectAltNames name nobody. INVALID_ARGUMENT for a PEM that does not parse.
absl::StatusOr<std::vector<std::string>> PeerNames(const std::string& pem);

class PeerService final : public peer::v1::Peer::CallbackService {
 public:
  // The most bytes one Read answers (or one block, where a block is larger).
  static constexpr int64_t kMaxReadBytes = int64_t{8} << 20;

  // Borrowed: all must outlive this.
  // `units` answers for hybrid pools (peer_port.h): an Offer leases the unit of every group's
  // components a hit needs, in UnitLayout order, and `depth_blocks` says how deep it is.
  PeerService(TierPort* cache, PeerPort* units, const DeviceArena* arena, const TransferOptions& options,
              TransferMetrics* metrics);
  ~PeerService() override;  // unpins every lease

  grpc::ServerUnaryReactor* Offer(grpc::CallbackServerContext* ctx, const peer::v1::OfferRequest* req,
                                  peer::v1::OfferResponse* resp) override;
  grpc::ServerUnaryReactor* Read(grpc::CallbackServerContext* ctx, const peer::v1::ReadRequest* req,
                                 peer::v1::ReadResponse* resp) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* ctx, const peer::v1::ReleaseRequest* req,
                                    peer::v1::ReleaseResponse* resp) override;

  int64_t leases() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Clock = std::chrono::steady_clock;
  struct Lease {
    PoolId pool = 0;
    std::vector<BlockIndex> blocks;
    Clock::time_point expires;
    std::string peer;  // the certificate name that took it
  };
  // The allowed name the caller's certificate carries; PERMISSION_DENIED otherwise.
  absl::StatusOr<std::string> Authenticate(const grpc::CallbackServerContext* ctx) const;
  absl::Status DoOffer(const std::string& peer, const peer::v1::OfferRequest& req, peer::v1::OfferResponse* resp);
  absl::Status DoRead(const std::string& peer, const peer::v1::ReadRequest& req, peer::v1::ReadResponse* resp);
  // Removes leases past their expiry (all when `all`) and unpins their blocks, outside mu_.
  void Expire(bool all) ABSL_LOCKS_EXCLUDED(mu_);
  void ReapLoop() ABSL_LOCKS_EXCLUDED(mu_);

  TierPort* const cache_;
  PeerPort* const units_;
  const DeviceArena* const arena_;
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
