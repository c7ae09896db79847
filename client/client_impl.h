// Client::Impl: the state behind kvd::client::Client, shared by the files that implement it
// (client.cc: attachment, data plane and the per-request RPCs; client_step.cc: steps). Not installed.
#pragma once

#include "client/client.h"

#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>
#include <grpcpp/grpcpp.h>
#include "absl/container/flat_hash_map.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/slab_maps.h"
#include "client/step_state.h"
#if KVD_HAVE_CUDA
#include "gpu/cuda_block_copier.h"
#include "gpu/cuda_device.h"
#include "gpu/cuda_ipc_event.h"
#include "gpu/cuda_slab_import.h"
#endif
#include "kvd/v1/kvd.grpc.pb.h"
#include "proto/convert.h"
#include "proto/grpc_status.h"
#include "proto/vocab/status_macros.h"

namespace kvd::client {

struct Client::Impl {
  ClientOptions options;
  // The channel and stub of the current attachment: a re-attach makes new ones (a channel that
  // saw kvd go away keeps failing fast for its own back-off, seconds, after kvd is back).
  absl::Mutex stub_mu;
  std::shared_ptr<v1::Kvd::Stub> stub_ ABSL_GUARDED_BY(stub_mu);
  std::shared_ptr<v1::Kvd::Stub> stub() {
    absl::MutexLock lock(&stub_mu);
    return stub_;
  }
  // A new channel and stub, used once kvd answers within `timeout` (UNAVAILABLE otherwise).
  absl::Status Dial(absl::Duration timeout);
  v1::AttachRequest hello;  // sent again at every re-attach (previous_worker_id, quiesced updated)
  int64_t hello_sent_ns = 0;  // of the attachment last opened (supervisor or Connect only)
  std::string backend;

  // The attachment. `epoch` counts attachments: a request belongs to the epoch it started in and
  // is lost (KvdRestarted) once the epoch moves on. `maps` is replaced in place at a remap, so the
  // PoolViews pools() returned stay valid; shard_base is read under the lock.
  absl::Mutex mu;
  absl::CondVar attached_cv;
  WorkerId worker ABSL_GUARDED_BY(mu);
  int64_t epoch ABSL_GUARDED_BY(mu) = 1;
  bool attached ABSL_GUARDED_BY(mu) = true;
  std::string detached_reason ABSL_GUARDED_BY(mu);
  std::unique_ptr<SlabMaps> maps ABSL_GUARDED_BY(mu);
#if KVD_HAVE_CUDA
  std::optional<InterprocessEvent> own_event;
  absl::Mutex events_mu;
  // Opened once per handle, at most kMaxPeerEvents at a time (publishers come and go: past that
  // the cache starts over; an event in use elsewhere lives on in its shared_ptr until released).
  static constexpr size_t kMaxPeerEvents = 256;
  absl::flat_hash_map<std::string, std::shared_ptr<InterprocessEvent>> peer_events
      ABSL_GUARDED_BY(events_mu);
#endif

  // The address of bytes [offset, offset + n) of layer `layer` of `block` in this process's
  // mapping; OUT_OF_RANGE past the layer block.
  absl::StatusOr<uint8_t*> LayerAddress(PoolId pool, BlockIndex block, int32_t layer, uint32_t shard,
                                        int64_t offset, int64_t n) ABSL_SHARED_LOCKS_REQUIRED(mu) {
    const std::vector<PoolView>& pools = maps->pools();
    if (pool >= pools.size()) return absl::NotFoundError(absl::StrCat("unknown pool ", pool));
    const PoolView& p = pools[pool];
    if (shard >= p.shard_base.size() || p.shard_base[shard] == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("shard ", shard, " of pool ", pool, " is not mapped"));
    }
    KVD_ASSIGN_OR_RETURN(int64_t at, p.layout.Offset(block, layer));
    if (offset < 0 || n < 0 || offset > p.layout.LayerUnitBytes(block) - n) {
      return absl::OutOfRangeError("access past the layer block");
    }
    return p.shard_base[shard] + at + offset;
  }

  // The CUDA ordinal holding `shard` of `pool` (-1 on the host backend). REQUIRES: LayerAddress
  // accepted them.
  int ShardDevice(PoolId pool, uint32_t shard) ABSL_SHARED_LOCKS_REQUIRED(mu) {
    if (backend != "cuda") return -1;
    const PoolView& p = maps->pools()[pool];
    return shard < p.shard_device.size() && p.shard_device[shard] >= 0 ? p.shard_device[shard] : 0;
  }

  // Host-synchronized publish (docs/api.md): what must have finished before a Publish, Keeps, End
  // or Checkpoint is sent. Taken (and cleared) by AwaitWrites.
  absl::Mutex fences_mu;
  std::vector<std::function<absl::Status()>> fences ABSL_GUARDED_BY(fences_mu);
  bool event_recorded ABSL_GUARDED_BY(fences_mu) = false;
  int awaits_running ABSL_GUARDED_BY(fences_mu) = 0;  // AwaitWrites calls waiting on fences they took

  // Runs every pending fence and, when the worker recorded its interprocess event since the last
  // publish, synchronizes it: the bytes a publish names are in memory before kvd hears of it.
  absl::Status AwaitWrites() {
    std::vector<std::function<absl::Status()>> pending;
    bool sync_event = false;
    {
      absl::MutexLock lock(&fences_mu);
      pending.swap(fences);
      sync_event = std::exchange(event_recorded, false);
      ++awaits_running;
    }
    absl::Status status;
    for (auto& wait : pending) status.Update(wait());
#if KVD_HAVE_CUDA
    if (sync_event && own_event.has_value()) status.Update(own_event->Synchronize());
#endif
    {
      absl::MutexLock lock(&fences_mu);
      --awaits_running;
    }
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat("the engine's writes did not complete, so "
                                                      "nothing was published: ", status.message()));
    }
    return absl::OkStatus();
  }

  // The attach stream. The supervisor thread reads it (kvd sends nothing after Attached, so the
  // read returns only when the stream ends: kvd went away) and re-attaches; the heartbeat thread
  // writes it. stream_mu guards swapping it and every write.
  absl::Mutex stream_mu;
  std::unique_ptr<grpc::ClientContext> attach_ctx ABSL_GUARDED_BY(stream_mu);
  std::unique_ptr<grpc::ClientReaderWriter<v1::AttachRequest, v1::AttachResponse>> attach
      ABSL_GUARDED_BY(stream_mu);
  absl::Notification stop;
  absl::Notification supervisor_done;  // the supervisor returned (~Client waits for a clean close)
  std::thread heartbeat;
  std::thread supervisor;
  // A stream being opened by a re-attach, cancelled by ~Client (a kvd that never answers must
  // not hold up the destructor).
  grpc::ClientContext* opening_ctx ABSL_GUARDED_BY(stream_mu) = nullptr;

  // The lease as this process can prove it (docs/security.md, "Leases and fencing"): writes are
  // allowed until may_write_until_ns (steady clock), half a lease past the sending of the latest
  // heartbeat kvd acknowledged (or of the hello it answered). kvd renewed the lease no earlier
  // than that sending, so this process stops writing at least half a lease before kvd may hand
  // its blocks to anyone else. 0: the lease is lost (until quiesced and re-attached).
  // write_epoch is the attachment that lease is for: stored before may_write_until_ns at each
  // attach, and read after it, so a request of an earlier attachment never sees the new lease.
  std::atomic<int64_t> may_write_until_ns{0};
  std::atomic<int64_t> write_epoch{1};
  absl::Duration lease_ttl = absl::Seconds(10);  // as kvd said at Attach
  absl::Mutex beats_mu;
  uint64_t next_seq ABSL_GUARDED_BY(beats_mu) = 1;
  absl::flat_hash_map<uint64_t, int64_t> beats_sent ABSL_GUARDED_BY(beats_mu);  // seq -> steady ns

  static int64_t SteadyNs() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  bool MayWrite() const {
    const int64_t until = may_write_until_ns.load(std::memory_order_acquire);
    return until != 0 && SteadyNs() < until;
  }
  bool MayWriteFor(int64_t epoch) const { return MayWrite() && write_epoch.load(std::memory_order_acquire) == epoch; }
  // Kvd renewed the lease no earlier than `sent_ns`: writes may go on until half a lease later.
  void LeaseProvenAt(int64_t sent_ns) {
    const int64_t until = sent_ns + absl::ToInt64Nanoseconds(lease_ttl / 2);
    int64_t cur = may_write_until_ns.load(std::memory_order_acquire);
    while (cur != 0 && cur < until && !may_write_until_ns.compare_exchange_weak(cur, until)) {
    }
  }
  void OnAck(uint64_t seq) {
    int64_t sent = 0;
    {
      absl::MutexLock lock(&beats_mu);
      auto it = beats_sent.find(seq);
      if (it == beats_sent.end()) return;
      sent = it->second;
      absl::erase_if(beats_sent, [seq](const auto& beat) { return beat.first <= seq; });  // they prove less
    }
    LeaseProvenAt(sent);
  }
  // Stops every write into kvd's memory and waits for those in flight: WriteLayer calls (they
  // check the lease under mu), the engine's fences, then its on_lease_lost hook. After it, this
  // process writes nothing from the lost attachment if the engine has a hook or declared
  // no_async_writes; only then does the next hello say `quiesced` (Vouches).
  void Quiesce() {
    may_write_until_ns.store(0, std::memory_order_release);
    { absl::MutexLock wait_for_writes(&mu); }
    (void)AwaitWrites();
    // Fences another thread took (a publish waiting on them) are waited for too.
    {
      absl::MutexLock lock(&fences_mu);
      fences_mu.Await(absl::Condition(
          +[](int* running) { return *running == 0; }, &awaits_running));
    }
    if (options.on_lease_lost) options.on_lease_lost();
  }
  bool Vouches() const { return options.on_lease_lost != nullptr || options.no_async_writes; }

  template <typename Resp, typename Fn>
  absl::StatusOr<Resp> Call(Fn&& fn, absl::Duration timeout = absl::Seconds(30)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    Resp resp;
    grpc::Status s = fn(&ctx, &resp);
    if (!s.ok()) return FromGrpcStatus(s);
    return resp;
  }

  WorkerId Worker() {
    absl::MutexLock lock(&mu);
    return worker;
  }
  int64_t Epoch() {
    absl::MutexLock lock(&mu);
    return epoch;
  }

  StepState steps;  // client_step.cc
  void Report();    // the step reporter's loop

  // Opens an attach stream and sends the hello; the Attached reply, or why not.
  absl::StatusOr<v1::Attached> OpenStream(
      std::unique_ptr<grpc::ClientContext>* ctx,
      std::unique_ptr<grpc::ClientReaderWriter<v1::AttachRequest, v1::AttachResponse>>* stream);

  // kvd's pools, mapped (their geometry only when kvd kept the CUDA memory this process maps).
  absl::StatusOr<std::unique_ptr<SlabMaps>> ListAndMap(const v1::Attached& a);

  void Heartbeat() {
    while (!stop.WaitForNotificationWithTimeout(options.heartbeat_period)) {
      // No acknowledgement for half a lease (kvd stopped, wedged or unreachable; this process
      // paused): the lease can no longer be proven. Stop writing now; the supervisor, woken by
      // the cancelled stream, quiesces and re-attaches.
      if (may_write_until_ns.load(std::memory_order_acquire) != 0 && !MayWrite()) {
        may_write_until_ns.store(0, std::memory_order_release);
        absl::MutexLock lock(&stream_mu);
        attach_ctx->TryCancel();
        continue;
      }
      v1::AttachRequest beat;
      {
        absl::MutexLock lock(&beats_mu);
        const uint64_t seq = next_seq++;
        if (beats_sent.size() >= 64) beats_sent.clear();  // kvd answers none: keep it bounded
        beats_sent[seq] = SteadyNs();
        beat.mutable_heartbeat()->set_seq(seq);
      }
      absl::MutexLock lock(&stream_mu);
      (void)attach->Write(beat);  // a broken stream is the supervisor's to notice
    }
  }

  void Supervise();
  absl::Status Reattach();
};

}  // namespace kvd::client
