// PeerPuller pulls a request's prompt blocks from a peer kvd (docs/transfer.md, "Pull"): after
// the local lookup (and promotion from lower tiers), it asks the peer for its cached blocks past
// the request's cached prefix (Offer), reads them with UCX into the request's own writable blocks,
// verifies every checksum, and publishes them (TierPort::AdoptPromoted), so that they hit like
// any other cached block and the event stream announces them; then releases the peer's lease.
//
// Nothing partial is ever cached: an offer refused or malformed (geometry, format, counts,
// indices, remote keys), a read that fails or passes the deadline, or one checksum that differs
// leaves the request as Acquire served it, and its worker computes those blocks. The request's
// blocks are pinned while reads may land in them, so a request released meanwhile cannot hand
// them to anyone.
//
// Thread-safe. Pulls run on `pull_threads` threads of their own, never a gRPC thread; no lock of
// this class is held across a call.
#pragma once

#include <atomic>
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
#include "server/core/tier_port.h"
#include "server/store/executor.h"
#include "server/transfer/transfer_metrics.h"
#include "server/transfer/transfer_options.h"
#include "server/transfer/ucx_node.h"

namespace kvd {

class PeerPuller {
 public:
  // Channels to every configured peer, presenting this node's certificate (`ssl`: this node's key
  // and certificate, and the peers' CA). Borrowed: all outlive this.
  static std::unique_ptr<PeerPuller> Create(const TransferOptions& options, TierPort* cache, const DeviceArena* arena,
                                            UcxNode* node, TransferMetrics* metrics,
                                            const grpc::SslCredentialsOptions& ssl);
  ~PeerPuller();  // finishes the pulls running; those queued answer at once, pulling nothing

  // OK when `peer` is a configured peer; INVALID_ARGUMENT naming those that are.
  absl::Status CheckPeer(const std::string& peer) const;

  // Pulls from `peer` the blocks of `spec`'s prompt past `cached_tokens` into `table` (the
  // request's block table in pool `pool`), then calls done(new cached tokens) on a pull thread;
  // done(cached_tokens) when the peer had nothing more, done(error) when the pull failed (the
  // request unchanged). Returns false, without calling done, when no block is left to pull.
  using PullDone = std::function<void(absl::StatusOr<int64_t> cached_tokens)>;
  bool Pull(const std::string& peer, const RequestId& id, const RequestSpec& spec, PoolId pool,
            int64_t cached_tokens, std::vector<BlockIndex> table, PullDone done);

 private:
  struct Channel {
    std::unique_ptr<peer::v1::Peer::Stub> stub;
  };
  PeerPuller(const TransferOptions& options, TierPort* cache, const DeviceArena* arena, UcxNode* node,
             TransferMetrics* metrics);
  // The pull itself; `cause` gets the metric's outcome.
  absl::StatusOr<int64_t> RunPull(const std::string& peer, const RequestId& id, const RequestSpec& spec, PoolId pool,
                                  int64_t cached_tokens, const std::vector<BlockIndex>& table, std::string* cause);

  const TransferOptions options_;
  TierPort* const cache_;
  const DeviceArena* const arena_;
  UcxNode* const node_;
  TransferMetrics* const metrics_;
  absl::flat_hash_map<std::string, Channel> peers_;  // fixed after Create
  std::atomic<bool> stopping_{false};
  std::unique_ptr<Executor> pulls_;
};

// OK when the offered geometry and format equal `local`'s; else FAILED_PRECONDITION naming the
// first field that differs and both values.
absl::Status CheckOfferedGeometry(const PoolGeometry& local, const peer::v1::Geometry& offered);

}  // namespace kvd
