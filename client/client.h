// kvd::client: the library an inference worker links to use kvd.
//
//   auto client = kvd::client::Client::Connect({.target = "unix:///run/kvd/kvd.sock"});  // "": the default
//   auto req = (*client)->Start(spec);            // Admit (waits for budget) + Acquire
//   uint8_t* k = (*client)->LayerPointer(pool, (*req)->blocks()[i], layer);  // in place
//   (*req)->Publish(tokens); (*req)->Release(/*completed=*/true);
//
// Connect attaches (a stream held for the client's life, renewed by a heartbeat thread), lists
// the pools and maps every slab once; the mappings live as long as the Client. Every RPC is
// wrapped to return absl::Status(Or). No gRPC type appears in this header.
// Thread-safe: RPC wrappers may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "gpu/slab_layout.h"
#include "proto/vocab/cache_types.h"
#include "proto/vocab/cache_event.h"
#include "proto/vocab/pool_geometry.h"
#include "client/kv_request.h"
#include "client/step.h"

namespace kvd::client {

// What Prefetch started: its handle, and how many of the prompt's blocks lower tiers hold.
struct PrefetchResult {
  uint64_t handle = 0;
  int64_t found_blocks = 0;    // held below the device tier
  int64_t loading_blocks = 0;  // of those, being read up from disk
};

struct ClientOptions {
  std::string target;  // e.g. unix:///run/kvd/kvd.sock; "": $KVD_TARGET, else kvd's default socket
  std::string worker_name;                             // for the daemon's logs
  absl::Duration heartbeat_period = absl::Seconds(1);  // at most a quarter of the daemon's lease is used
  bool map_slabs = true;                               // false: control plane only (admin tools)
  // Tensor-parallel rank: map only this shard of each pool (-1: every shard). On the CUDA backend
  // a rank maps only its own device's slab.
  int32_t shard = -1;
  // CUDA backend: create an interprocess event on this device and register it at Attach, so
  // readers of blocks this worker publishes can order after its writes without a host sync
  // (RecordWrites / WaitForPublishers). -1: none.
  int32_t ipc_event_device = -1;
  absl::Duration connect_timeout = absl::Seconds(5);
  // Block credit (client/step.h) the client asks kvd to keep per pool it uses in steps, so that
  // decode grows without a round trip; it goes back to kvd with the attachment. The client asks for
  // twice the most blocks one step took when that is more (up to kvd's step_credit_blocks). 0: none.
  int64_t step_credit_blocks = 128;
  // kvd restarted with different memory (a plain restart: new slabs): every PoolView's shard_base
  // now points into the new mappings and the engine must rebuild whatever it derived from the old
  // ones (its KV tensors moved). Called on the client's supervisor thread after the new mappings
  // are in place; the old ones are unmapped when it returns. Not called when kvd kept the memory
  // (systemd's fd store, a handoff): then every pointer stays valid.
  std::function<void()> on_remap;
  // The engine's fence for a lost lease (docs/security.md, "Leases and fencing"): stop issuing
  // writes into kvd's memory and return once every write already issued has completed (join the
  // writer threads, synchronize the streams). The client calls it, after the fences added with
  // AddWriteFence, when it can no longer prove its lease (the attach stream ended, or no heartbeat
  // was acknowledged for half a lease) and before it re-attaches: kvd hands this process's blocks
  // to others once it has re-attached or a lease has passed. From that moment MayWrite() is false
  // and WriteLayer refuses. Called on a client thread.
  std::function<void()> on_lease_lost;
  // The engine's word that it never writes kvd's memory asynchronously: every write is a
  // WriteLayer call (which the client waits for when it quiesces) or is complete before
  // the call that follows it returns. With neither this nor on_lease_lost, the client cannot
  // vouch that nothing of a lost attachment is still being written, so kvd keeps that
  // attachment's blocks fenced for a lease TTL after it re-attaches instead of handing them on.
  bool no_async_writes = false;
};

// A pool as this worker sees it: geometry, layout and the base address of each shard's slab in
// this process (nullptr when not mapped). On the CUDA backend the base is a device pointer on
// `shard_device[shard]`, opened once from the slab's IPC handle.
struct PoolView {
  PoolId id = 0;
  PoolGeometry geometry;
  SlabLayout layout{PoolGeometry{}};
  std::vector<uint8_t*> shard_base;
  std::vector<int64_t> slab_bytes;
  std::vector<int32_t> shard_device;  // CUDA ordinal per shard; -1 on the host backend
};

// One KV group of a hybrid pool (geometry.groups) in this process's mapping of one shard. Tables
// carry pool-wide indices; group g's tensors are indexed by the group-local index
// local = index - first_block. Layer j (the j-th of `layers`) of unit `local` is at
//   base + (j * capacity + local) * layer_unit_bytes
// i.e. each layer is the paged tensor [capacity][layer_unit_bytes] (gpu/slab_layout.h).
struct GroupKvView {
  uint8_t* base = nullptr;  // the group's region; a device pointer on the CUDA backend
  int64_t first_block = 0;
  int64_t capacity = 0;          // blocks, or slots for a state group
  int64_t layer_unit_bytes = 0;  // block_tokens * bytes_per_token, or bytes_per_state
  std::vector<int32_t> layers;   // model layers, in memory order
  // The group-local index of pool-wide `index`, or -1 when the index is not the group's.
  int64_t Local(int64_t index) const {
    return index >= first_block && index < first_block + capacity ? index - first_block : -1;
  }
  uint8_t* Unit(int32_t j, int64_t local) const { return base + (j * capacity + local) * layer_unit_bytes; }
};
// NOT_FOUND for a group the pool does not have (a pool without groups has none);
// FAILED_PRECONDITION when `shard` is not mapped in this process.
absl::StatusOr<GroupKvView> GroupKv(const PoolView& pool, absl::string_view group, uint32_t shard = 0);

class EventWatcher;
class StepFuture;
struct PendingStep;

class Client {
 public:
  // Attaches and maps slabs. UNAVAILABLE when the daemon cannot be reached or is draining;
  // PERMISSION_DENIED when the side socket refuses this process.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  // Ends the attachment: the daemon releases, as interrupted, whatever this worker still holds.
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // The worker id of the current attachment (it changes when the client re-attaches).
  WorkerId worker_id() const;
  // Riding through a kvd restart: when the attach stream ends, the client re-attaches under the
  // same worker name, with back-off (50 ms doubling to 2 s), and compares the slabs kvd lists with
  // what it has mapped (same memfd inode / same CUDA allocation: kept; else remapped and
  // on_remap called). Requests live at the restart fail with KvdRestarted; Start waits for the
  // re-attachment within its `wait`. attached() says whether the client is attached now;
  // WaitAttached blocks until it is (UNAVAILABLE with the last reason after `timeout`); epoch()
  // counts attachments, from 1.
  bool attached() const;
  absl::Status WaitAttached(absl::Duration timeout);
  // Whether this process may write into kvd's memory now: it holds a lease that kvd acknowledged
  // less than half a lease ago. False from the moment the lease can no longer be proven until the
  // client has quiesced and re-attached; requests of an earlier attachment never may again
  // (KvRequest::MayWrite). Engines that write through LayerPointer check it before each write.
  bool MayWrite() const;
  // The same for writes of attachment `epoch` (a request's, a StepRequest's): false, for good,
  // once the client has re-attached since, even while the new attachment's lease is held.
  bool MayWrite(int64_t epoch) const;
  int64_t epoch() const;
  const std::string& backend() const;
  const std::vector<PoolView>& pools() const;
  absl::StatusOr<const PoolView*> FindPool(absl::string_view name) const;
  // Layer `layer` of block `block` of `pool` on `shard`, in this process's mapping.
  absl::StatusOr<uint8_t*> LayerPointer(PoolId pool, BlockIndex block, int32_t layer,
                                        uint32_t shard = 0) const;

  // Copies `n` bytes into / out of layer `layer` of `block` at byte `offset` within the layer
  // block: memcpy on the host backend, cudaMemcpy on the CUDA backend. Engines that write with
  // their own kernels use LayerPointer instead. OUT_OF_RANGE past the layer block. WriteLayer
  // checks the lease of the current attachment only: writes for a request go through
  // KvRequest::WriteLayer, which also refuses a request of an earlier attachment.
  absl::Status WriteLayer(PoolId pool, BlockIndex block, int32_t layer, int64_t offset,
                          const void* src, int64_t n, uint32_t shard = 0) const;
  absl::Status ReadLayer(PoolId pool, BlockIndex block, int32_t layer, int64_t offset, void* dst,
                         int64_t n, uint32_t shard = 0) const;

  // Publish is host-synchronized (docs/api.md): kvd may copy a block (to the host tier, disk,
  // Redis) the moment its Publish, Keeps, End or Checkpoint arrives, so the bytes must be in
  // memory by then. This library keeps the rule for writes it is told about: each of those calls
  // first waits for every fence added and, on the CUDA backend, synchronizes the worker's
  // interprocess event if RecordWrites was called since the last publish. If a wait fails, the
  // call returns its error and nothing is published.
  //  - RecordWrites(stream): records the event on the cudaStream_t (as void*) that wrote the KV.
  //    FAILED_PRECONDITION without CUDA or without ClientOptions::ipc_event_device.
  //  - AddWriteFence(wait): any backend; `wait` returns once the engine's writes issued so far are
  //    complete (a writer thread joined, a stream synchronized). Run once, by the next publish.
  // Readers may also order after a publisher's event on their own stream (WaitForPublishers); once
  // publish is host-synchronized that wait has already been satisfied.
  absl::Status RecordWrites(void* stream);
  void AddWriteFence(std::function<absl::Status()> wait);
  absl::Status WaitForPublishers(const KvRequest& request, void* stream);

  // --- RPC wrappers (spec.owner is filled with this worker's id) ---
  absl::StatusOr<AdmitResult> Admit(RequestSpec spec);
  absl::StatusOr<AdmitResult> Fits(RequestSpec spec);
  absl::StatusOr<AcquireResult> Acquire(const RequestId& id);
  absl::StatusOr<std::vector<BlockIndex>> Extend(const RequestId& id, int64_t additional_tokens);
  // `checkpoints`: a hybrid pool's state checkpoints (docs/hybrid.md §2.7); the result has one
  // outcome and fresh spare slot per entry.
  absl::StatusOr<PublishResult> Publish(const RequestId& id, absl::Span<const Token> tokens,
                                        absl::Span<const BlockIndex> blocks,
                                        absl::Span<const StateCheckpoint> checkpoints = {});
  absl::StatusOr<PublishResult> Keeps(const RequestId& id, absl::Span<const Token> tokens,
                                      absl::Span<const BlockIndex> blocks);
  // `state`: on a hybrid pool with a state group, per state group the slot holding the state at
  // exactly tokens.size() (docs/hybrid.md §2.9; required there); `fresh_slots` (may be null) gets
  // the spare that replaced each in the request's state table.
  absl::Status Checkpoint(const RequestId& id, absl::Span<const Token> tokens, const std::string& engine_state,
                          absl::Span<const StateCheckpoint> state = {}, std::vector<int64_t>* fresh_slots = nullptr);
  absl::Status Release(const RequestId& id, bool completed);
  // Publish of the request's first `publish_blocks` blocks (over the tokens the daemon knows,
  // then `more_tokens`) and Release, in one round trip (the End RPC).
  absl::StatusOr<EndResult> End(const RequestId& id, int64_t publish_blocks,
                                absl::Span<const Token> more_tokens, bool completed,
                                absl::Span<const StateCheckpoint> checkpoints = {});
  absl::StatusOr<int64_t> PeekPrefixLen(const Namespace& ns, absl::Span<const Token> tokens);
  // The rest of the contract (client_calls.cc). Prefetch: starts reading a prompt's saved blocks
  // up to host memory before it is admitted (tiers); they stay until ReleasePrefetch or the worker
  // detaches. Objects: an exact cache beside the prefix cache (e.g. encoder outputs), under tiers.
  absl::StatusOr<PrefetchResult> Prefetch(const Namespace& ns, absl::Span<const Token> tokens);
  absl::Status ReleasePrefetch(uint64_t handle);
  absl::Status PutObject(const Namespace& ns, const std::string& key, const std::string& data);
  absl::StatusOr<std::string> GetObject(const Namespace& ns, const std::string& key);
  absl::Status DeleteObject(const Namespace& ns, const std::string& key);
  absl::StatusOr<std::vector<SessionInfo>> ListSessions();
  absl::Status CloseSession(const SessionId& session);
  absl::StatusOr<SessionInfo> GetSession(const SessionId& session);
  absl::StatusOr<GcStats> Gc(absl::Duration max_idle = absl::ZeroDuration());
  absl::StatusOr<int64_t> Boundary();
  absl::StatusOr<CacheReport> Report();
  absl::StatusOr<std::vector<HandleInfo>> ListHandles();
  absl::StatusOr<HandleInfo> GetHandle(const RequestId& id);
  absl::Status Ping();
  // Streams index events with sequence > after_sequence (see EventWatcher).
  absl::StatusOr<std::unique_ptr<EventWatcher>> WatchEvents(uint64_t after_sequence);

  // Admit + Acquire in one round trip (the Start RPC): the daemon waits for room in the budget,
  // first come first served, up to `wait` (DEADLINE_EXCEEDED after). The request releases itself
  // (interrupted) if dropped unreleased. `peer`: a peer kvd (a name in kvd's transfer.peers)
  // whose cached blocks of the prompt kvd pulls first (docs/transfer.md). `wait_in_flight` > 0:
  // when another live request of the namespace is computing the prompt's next blocks, kvd waits
  // up to that long (at most 30 s) for it to publish them, before admission and holding nothing
  // (docs/api.md, "Prefixes in flight"); KvRequest::in_flight_seen() and in_flight_wait() say what.
  absl::StatusOr<std::unique_ptr<KvRequest>> Start(RequestSpec spec,
                                                   absl::Duration wait = absl::Seconds(10),
                                                   const std::string& peer = "",
                                                   absl::Duration wait_in_flight = absl::ZeroDuration());

  // One scheduler step (client/step.h). The status fails the whole step (kvd unreachable after
  // retries with the same sequence number, or a refused step); each item's own outcome is in
  // the answer. One step at a time per client.
  absl::StatusOr<StepAnswer> Step(StepBatch& batch);
  // Step with its round trip left in flight, for an engine that computes meanwhile: growth the
  // credit covers is placed before it returns (req->blocks has its blocks), the rest of the batch
  // goes out on a client thread, and StepFuture::Get applies kvd's answer (starts, growth past the
  // credit, ends) on the caller's thread. Until Get, the engine must not touch the requests of
  // the batch's other items, nor the batch, and the client takes no other step or FlushSteps
  // (FAILED_PRECONDITION). The future must not outlive the client.
  absl::StatusOr<std::unique_ptr<StepFuture>> StepSubmit(StepBatch& batch);
  // Tells kvd now of the credit-covered growth the client holds back, if any.
  absl::Status FlushSteps();
  // Credit blocks held now in `pool`: how many, and which.
  int64_t StepCredit(PoolId pool) const;
  std::vector<BlockIndex> StepCreditBlocks(PoolId pool) const;
  // A hybrid pool's credit of one KV group (credit is per (pool, group)); group 0 elsewhere.
  std::vector<BlockIndex> StepCreditBlocks(PoolId pool, int group) const;

  struct Impl;

 private:
  friend class KvRequest;
  explicit Client(std::unique_ptr<Impl> impl);
  // `status` of a call made for a request of attachment `epoch`: KvdRestarted when kvd went away
  // since (waiting a moment for the supervisor when the error says kvd may be gone), else as is.
  absl::Status LostIfRestarted(const absl::Status& status, int64_t epoch, const RequestId& id);
  // WriteLayer for attachment `epoch` (0: the current one).
  absl::Status WriteLayerIn(int64_t epoch, PoolId pool, BlockIndex block, int32_t layer, int64_t offset,
                            const void* src, int64_t n, uint32_t shard) const;
  std::unique_ptr<Impl> impl_;
};

// A live WatchEvents stream. Next() blocks until a batch arrives or the stream ends.
// A step in flight (Client::StepSubmit). Dropping it untaken takes the answer (and waits for it).
class StepFuture {
 public:
  ~StepFuture();
  StepFuture(const StepFuture&) = delete;
  StepFuture& operator=(const StepFuture&) = delete;
  // Waits for kvd's answer and applies it: what Client::Step would have returned. Once.
  absl::StatusOr<StepAnswer> Get();
  // Whether Get would not wait.
  bool ready() const;

 private:
  friend class Client;
  StepFuture(Client::Impl* im, std::unique_ptr<PendingStep> pending);
  Client::Impl* im_;
  std::unique_ptr<PendingStep> pending_;
  bool ready_ = false;  // nothing went out: the answer is in pending_
  bool taken_ = false;
};

class EventWatcher {
 public:
  struct Batch {
    bool resync = false;
    std::vector<CacheEvent> events;
  };
  virtual ~EventWatcher() = default;
  // The next batch; UNAVAILABLE/CANCELLED when the stream ended.
  virtual absl::StatusOr<Batch> Next() = 0;
};

}  // namespace kvd::client
