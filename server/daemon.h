// Daemon assembles kvd from its Options: the cache engine, the memory arena, the attachment
// registry and lease reaper, the slab side socket, the gRPC server and the metrics endpoint.
// It owns all of them; destruction stops them in reverse order.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "gpu/device_arena.h"
#include "server/core/demotion_mover.h"
#include "server/core/kv_cache.h"
#include "server/events/router_event_publisher.h"
#include "server/obs/metrics.h"
#include "server/handoff.h"
#include "server/options.h"
#include "server/rpc/attachments.h"
#include "server/rpc/kvd_service.h"
#include "server/rpc/access_policy.h"
#include "server/rpc/peer_listener.h"
#include "server/rpc/slab_side_channel.h"
#include "server/store/tier_store.h"
#include "server/transfer/transfer.h"

namespace kvd {

class Daemon {
 public:
  // Validates `options` (after ApplyDefaults), allocates memory, binds every socket and starts
  // serving. Any failure is returned with what failed named, before anything is left running.
  //
  // Hot handoff (server/handoff.h). With `takeover`, first asks the kvd listening on
  // options.server.handoff_socket to hand over, and starts from its sockets, slabs and index
  // (FAILED_PRECONDITION carrying its refusal: it keeps serving); when no kvd listens there,
  // starts afresh. With `on_handoff`, this kvd listens on the handoff socket itself; once a
  // successor has taken over (OK) — or an attempt failed after this kvd stopped serving (the
  // error) — `on_handoff` runs on the handoff thread; the daemon then serves nothing and only
  // waits to be destroyed, which leaves the sockets to the successor.
  using HandoffHook = std::function<void(absl::Status, HandoffNext)>;
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(Options options, bool takeover = false,
                                                       HandoffHook on_handoff = nullptr);
  // After a handoff that ended in kResumeWithIndex or kResumeEmpty: a daemon serving again on
  // `stopped`'s sockets and memory (with its index, or an empty one), `stopped` destroyed once it
  // serves. The error (nothing serves) when that fails.
  static absl::StatusOr<std::unique_ptr<Daemon>> Resume(std::unique_ptr<Daemon> stopped, bool keep_index,
                                                        HandoffHook on_handoff);
  ~Daemon();

  // Stops admitting: new Admit/Fits/Attach get UNAVAILABLE, health turns NOT_SERVING. Idempotent.
  void StartDrain();
  // StartDrain (final: no Drain RPC undoes it), then waits up to `timeout` for live requests to finish, or until `interrupted`
  // (polled) returns true; then, with a disk tier and tiers.flush_on_drain, flushes (unless
  // interrupted). Returns how many requests were still live.
  int64_t Drain(absl::Duration timeout, const std::function<bool()>& interrupted = nullptr);

  const Options& options() const { return options_; }
  // Whether kvd still works, for the systemd watchdog: the engine answers (this blocks while its
  // lock is wedged, which is the point: no answer, no watchdog ping) and, on a Unix socket, a
  // Ping through the real listener succeeds within `timeout`. UNAVAILABLE naming what failed.
  absl::Status Probe(absl::Duration timeout) const;
  const std::string& grpc_address() const { return options_.server.listen; }
  const std::string& side_socket() const { return options_.server.side_socket; }
  int metrics_port() const { return metrics_->port(); }
  // The peer transfer listener as bound (HOST:PORT); empty without a transfer section.
  std::string transfer_address() const { return transfer_ != nullptr ? transfer_->bound() : std::string(); }
  KvCache* cache() const { return cache_.get(); }
  TierStore* tiers() const { return tiers_.get(); }

 private:
  explicit Daemon(Options options) : options_(std::move(options)) {}
  // Start's body; `received` (may be null) is what a predecessor handed over.
  static absl::StatusOr<std::unique_ptr<Daemon>> Assemble(Options options, HandoffReceived* received,
                                                          HandoffHook on_handoff);
  void ReapLapsedLeases();
  // Lifts the fences of gone processes and those past their time; pokes admission when blocks came
  // free; restores the disk tier's checkpoints once a whole-memory fence is gone.
  void LiftDueFences();
  // A successor's metrics endpoint, once the predecessor let the address go (retried for 5 s).
  void ListenForMetrics();
  // The handoff listener's `stop` hook: stops serving, ends live requests, closes the tiers, the
  // metrics endpoint and the router events (their ports go to the successor) and exports the index.
  absl::StatusOr<HandoffOffer> StopForHandoff() ABSL_LOCKS_EXCLUDED(lifecycle_mu_);

  Options options_;
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<DeviceArena> arena_;
  std::unique_ptr<TierStore> tiers_;  // null unless tiers are configured
  std::unique_ptr<DemotionMover> mover_;  // with tiers and a demote_reserve; before tiers_ goes
  std::unique_ptr<RouterEventPublisher> router_events_;  // null unless configured
  std::unique_ptr<Transfer> transfer_;  // null unless transfer is configured; before service_ goes
  std::unique_ptr<AttachmentRegistry> workers_;
  std::unique_ptr<Metrics> metrics_;
  AccessPolicy access_;
  std::unique_ptr<SlabSideChannel> side_;
  std::unique_ptr<PeerListener> peers_;  // set when an allow-list guards the Unix socket
  std::unique_ptr<KvdService> service_;
  std::unique_ptr<grpc::Server> server_;
  absl::Notification stop_reaper_;
  std::thread reaper_;
  // Serializes Drain with a handoff's stop (both close the tiers' work).
  absl::Mutex lifecycle_mu_;
  bool handed_over_ ABSL_GUARDED_BY(lifecycle_mu_) = false;  // the sockets belong to a successor
  UniqueFd handed_listen_;  // the listening sockets given away, open until this process exits
  UniqueFd handed_side_;
  CacheSnapshot handed_snapshot_;  // what was offered, for Resume
  // The sockets came from a predecessor: their files were bound by another process, and may be
  // in use by yet another when this one goes; never removed by this daemon.
  bool adopted_sockets_ = false;
  bool bound_listen_ = false;  // this daemon made the Unix socket file (removed when it stops)
  // The reaper thread's: checkpoints wait for a whole-memory fence; blocks fenced at its last look.
  bool restore_checkpoints_pending_ = false;
  int64_t fenced_blocks_ = 0;
  std::unique_ptr<HandoffListener> handoff_;  // declared last: destroyed first
};

}  // namespace kvd
