// PeerPuller pulls a request's prompt blocks from a peer kvd (docs/transfer.md, "Pull"): after
// the local lookup (and promotion from lower tiers), it asks the peer for its cached blocks past
// the request's cached prefix (Offer), reads their bytes over the same mutual-TLS channel (Read),
// verifies each block's checksum before writing it into the request's own block, and publishes
// them (TierPort::AdoptPromoted), so that they hit like any other cached block and the event
// stream announces them; the peer's lease is released after the request is answered.
//
// Nothing partial is ever cached: an offer refused or malformed (geometry, format, counts), a
// read that fails, passes the deadline or answers the wrong size, or one checksum that differs
// leaves the request as Acquire served it, and its worker computes those blocks. Every byte is
// written by this process's own pull thread, so nothing lands in a block after the pull returns.
//
// Bounded: a pull's deadline (transfer.pull_timeout) runs on the monotonic clock from Pull, so
// time queued counts; each peer has its own `pull_threads` threads and a queue of at most
// kQueuedPerPeer pulls (more are shed, counted "shed"), so a slow or dead peer delays only pulls
// from itself. A pull whose deadline passed in the queue answers without calling the peer.
//
// Thread-safe. Pulls run on threads of their own, never a gRPC thread; no lock of this class is
// held across a call.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/security/credentials.h>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu/device_arena.h"
#include "kvd/peer/v1/peer.grpc.pb.h"
#include "proto/vocab/cache_types.h"
#include "server/core/peer_port.h"
#include "server/core/tier_port.h"
#include "server/store/executor.h"
#include "server/transfer/transfer_metrics.h"
#include "server/transfer/transfer_options.h"

namespace kvd {

class PeerPuller {
 public:
  // Channels to every configured peer, presenting this node's certificate (`ssl`: this node's key
  // and certificate, and the peers' CA). Borrowed: all outlive this.
  // `units` pulls hybrid pools' units (peer_port.h): the offered depth, checked against the
  // request's tables, says which components come; each is size- and checksum-checked before it is
  // written into the request's own unit, and the unit is published whole (with its checkpoints)
  // or not at all.
  static std::unique_ptr<PeerPuller> Create(const TransferOptions& options, TierPort* cache, PeerPort* units,
                                            const DeviceArena* arena, TransferMetrics* metrics,
                                            const grpc::SslCredentialsOptions& ssl);
  // Pulls queued (not running) per peer; past it a pull is shed.
  static constexpr int64_t kQueuedPerPeer = 64;
  ~PeerPuller();  // finishes the pulls running; those queued answer at once, pulling nothing

  // OK when `peer` is a configured peer; INVALID_ARGUMENT naming those that are.
  absl::Status CheckPeer(const std::string& peer) const;

  // Pulls from `peer` the blocks of `spec`'s prompt past `cached_tokens` into `table` (the
  // request's block table in pool `pool`), then calls done(new cached tokens) on a pull thread;
  // done(cached_tokens) when the peer had nothing more, done(error) when the pull failed or was
  // shed (the request unchanged), at most transfer.pull_timeout after this call. Returns false,
  // without calling done, when no block is left to pull.
  using PullDone = std::function<void(absl::StatusOr<int64_t> cached_tokens)>;
  bool Pull(const std::string& peer, const RequestId& id, const RequestSpec& spec, PoolId pool,
            int64_t cached_tokens, std::vector<BlockIndex> table, PullDone done);

 private:
  using Clock = std::chrono::steady_clock;
  struct Channel {
    std::unique_ptr<peer::v1::Peer::Stub> stub;
    std::unique_ptr<Executor> pulls;  // this peer's own threads
  };
  PeerPuller(const TransferOptions& options, TierPort* cache, PeerPort* units, const DeviceArena* arena,
             TransferMetrics* metrics);
  // The pull itself; `cause` gets the metric's outcome, `lease` the peer's lease to release.
  absl::StatusOr<int64_t> RunPull(peer::v1::Peer::Stub* stub, const RequestId& id, const RequestSpec& spec,
                                  PoolId pool, int64_t cached_tokens, const std::vector<BlockIndex>& table,
                                  Clock::time_point deadline, std::string* cause, uint64_t* lease);
  // RunPull's rest for a hybrid pool: the offered unit, past the request's hit of `skip` blocks.
  absl::StatusOr<int64_t> PullUnit(peer::v1::Peer::Stub* stub, const RequestId& id, PoolId pool, int64_t skip,
                                   int64_t want, const peer::v1::OfferResponse& offer, Clock::time_point deadline,
                                   std::string* cause);
  // Releases `lease` without waiting for the answer (an unreleased lease expires on the peer).
  static void ReleaseLater(peer::v1::Peer::Stub* stub, uint64_t lease);

  const TransferOptions options_;
  TierPort* const cache_;
  PeerPort* const units_;
  const DeviceArena* const arena_;
  TransferMetrics* const metrics_;
  absl::flat_hash_map<std::string, Channel> peers_;  // fixed after Create
  std::atomic<bool> stopping_{false};
};

// OK when the offered geometry and format equal `local`'s; else FAILED_PRECONDITION naming the
// first field that differs and both values.
// A hybrid pool's groups too, one by one (naming the group and the field).
absl::Status CheckOfferedGeometry(const PoolGeometry& local, const peer::v1::Geometry& offered);

// The largest block or unit of any group of `g` across all shards: a Read's answer holds one.
int64_t LargestUnitBytes(const PoolGeometry& g);

}  // namespace kvd
