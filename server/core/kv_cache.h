// KvCache is kvd's cache engine: admission against the KV byte budget, longest-prefix reuse per
// namespace, ownership of writable blocks, publish, release, checkpoints for resume, session
// affinity, eviction, trimming, pressure and index events. It never touches KV bytes: it hands out
// block indices, and the data plane (gpu/, client/) turns them into memory.
//
// A request: Admit (reserve projected bytes) -> Acquire (block table: resumed checkpoint, else
// longest cached prefix, else fresh; plus writable blocks) -> Extend / Publish / Checkpoint ->
// Release (completed: checkpoints removed; interrupted: kept), or End (publish + release).
//
// Ownership: a block is free, *owned* (writable by exactly one request, or pinned by that
// request's orphaned checkpoint), or *cached* (immutable, in the index, shared by reference).
// Who may write an owned block is the BlockLedger's answer (owners_, block_ledger.h): a request's
// writable blocks are Owner{kRequest, its worker, its serial} from hand-out (Acquire, a grow, a
// resume, credit adopted) until they are published, released or handed over (a pull between
// PinBlocks and UnpinBlocks; a fence). Every operation that fails returns a status and changes nothing.
//
// Thread-safe: one mutex (mu_) guards all state. Nothing runs under it but bookkeeping: no block
// bytes, no I/O, no callbacks. Listeners (events, pressure) run after it is released, in order, on
// the thread that caused them; they must not block and must not call back into KvCache. The
// eviction sink's copies (demotions) run after it is released too, on the evicting thread, before
// the evicting call returns: an evicted block is held until its copy is done (eviction_sink.h).
// VisitCached calls its function without the mutex, with the visited blocks held.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/core/block_allocator.h"
#include "server/core/block_ledger.h"
#include "server/core/budget_ledger.h"
#include "server/core/cache_options.h"
#include "server/core/cache_snapshot.h"
#include "proto/vocab/cache_types.h"
#include "server/core/clock.h"
#include "server/core/event_log.h"
#include "server/core/eviction_sink.h"
#include "server/core/eviction_queue.h"
#include "server/core/inflight_index.h"
#include "server/core/kv_cache_state.h"
#include "server/core/peer_port.h"
#include "server/core/prefix_index.h"
#include "proto/vocab/step_types.h"
#include "server/core/pressure_monitor.h"
#include "server/core/tier_port.h"
#include "server/core/worker_table.h"

namespace kvd {

class KvCache final : public TierPort, public PeerPort {
 public:
  using EventListener = TierPort::EventListener;
  using PressureListener = std::function<void(PressureLevel, double available_fraction)>;

  // INVALID_ARGUMENT for bad options. `clock` is borrowed and must outlive the cache.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(CacheOptions options, const Clock* clock);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const std::vector<PoolGeometry>& pools() const override { return pool_geometries_; }
  const CacheOptions& options() const { return options_; }
  int64_t max_engine_state_bytes() const override { return options_.max_engine_state_bytes; }
  const Clock* clock() const override { return clock_; }  // every TTL and recency (the tiers share it)
  absl::StatusOr<PoolId> FindPool(absl::string_view name) const;  // NOT_FOUND: unknown pool name

  // Reserves blocks for prompt + max_new_tokens (no credit for cached prefixes: the reservation
  // must cover the worst case that the prefix is evicted before Acquire). kWait when the budget
  // has no room now. INVALID_ARGUMENT (bad spec), NOT_FOUND (pool), ALREADY_EXISTS (live id),
  // OUT_OF_RANGE (past max_model_len, or larger than the whole budget or pool by itself). Fits:
  // what Admit would answer now; holds nothing.
  absl::StatusOr<AdmitResult> Admit(const RequestSpec& spec) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<AdmitResult> Fits(const RequestSpec& spec) const ABSL_LOCKS_EXCLUDED(mu_);
  // All or nothing. NOT_FOUND (not admitted), FAILED_PRECONDITION (already acquired; resume of a
  // checkpoint in another namespace or one that does not continue the prompt).
  // kDefer (a start that asked to wait for blocks in flight): when the lookup stops at blocks
  // another live request of the namespace computes, nothing is acquired and the result is
  // `deferred`, naming them. Decided under the one lock that also acquires, so of two starts of a
  // new prefix admitted together exactly the first computes it (InFlightAhead alone cannot say
  // that: the acquire comes after it, in another lock section).
  absl::StatusOr<AcquireResult> Acquire(const RequestId& id, OnInFlight on_in_flight = OnInFlight::kCompute)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Grows the request by `additional_tokens` positions; returns the blocks appended to its table.
  // OUT_OF_RANGE past max_model_len; RESOURCE_EXHAUSTED past the reservation and the budget.
  absl::StatusOr<std::vector<BlockIndex>> Extend(const RequestId& id, int64_t additional)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Offers the request's first blocks.size() blocks for reuse. `blocks` must equal the request's
  // table prefix and `tokens` must cover them fully and agree with the request's known tokens.
  // Kept blocks become cached and immutable; the request keeps reading them.
  // On a hybrid pool, each group's blocks the request holds at the kept positions attach to the
  // spine too, and `checkpoints` are accepted or not per docs/hybrid.md §2.7 (outcomes in the
  // result; INVALID_ARGUMENT, changing nothing, for a slot or group that is not the request's).
  absl::StatusOr<PublishResult> Publish(const RequestId& id, absl::Span<const Token> tokens,
                                        absl::Span<const BlockIndex> blocks,
                                        absl::Span<const StateCheckpoint> checkpoints = {}) ABSL_LOCKS_EXCLUDED(mu_);
  // What Publish would answer for the same arguments; changes nothing.
  absl::StatusOr<PublishResult> Keeps(const RequestId& id, absl::Span<const Token> tokens,
                                      absl::Span<const BlockIndex> blocks) const ABSL_LOCKS_EXCLUDED(mu_);
  // A resumable point: the first tokens.size() tokens, their blocks, opaque engine bytes.
  // On a hybrid pool (docs/hybrid.md §2.9) also the window blocks before the position and, per
  // state group, the slot `state` names holding the state at exactly tokens.size() (one entry per
  // state group, required); the request gets a fresh spare in that slot's place, returned in
  // `fresh_slots` (may be null) per entry. INVALID_ARGUMENT naming state_checkpoints, changing
  // nothing, for a missing entry, another group or position, a slot not the request's.
  absl::Status Checkpoint(const RequestId& id, absl::Span<const Token> tokens, std::string engine_state,
                          absl::Span<const StateCheckpoint> state = {},
                          std::vector<int64_t>* fresh_slots = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // Publish of the request's first `publish_blocks` table blocks over its known tokens (prompt,
  // then tokens learned from Publish/Checkpoint) followed by `more_tokens`, then Release — under
  // one lock, all or nothing: on error the request is still live and unchanged.
  // INVALID_ARGUMENT (publish_blocks < 0 or past the table, tokens too short) and Publish's.
  absl::StatusOr<PublishResult> End(const RequestId& id, int64_t publish_blocks,
                                    absl::Span<const Token> more_tokens, bool completed,
                                    absl::Span<const StateCheckpoint> checkpoints = {}) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the request. completed: its checkpoint is removed; interrupted: the checkpoint is kept for
  // resume (within the checkpoint budget). NOT_FOUND when the id is not live (e.g. a double release).
  absl::Status Release(const RequestId& id, bool completed) ABSL_LOCKS_EXCLUDED(mu_);
  // Releases, as interrupted, every request `worker` holds. Returns how many.
  int64_t ReleaseWorker(const WorkerId& worker) ABSL_LOCKS_EXCLUDED(mu_);

  // One scheduler step of `worker` (kv_cache_step.cc; proto/vocab/step_types.h): applies `ops` in
  // order under one acquisition of the lock, each all or nothing with its own status (NOT_FOUND,
  // PERMISSION_DENIED for another worker's request, then the per-request call's errors); then, in
  // each pool of `credit`, takes back the blocks the worker returns by name and tops its credit up
  // towards what it asks, capped by options().step_credit_blocks and an eighth of the pool, by
  // pressure (a quarter at high, none at critical) and by the budget and the worker's limits.
  // Credit above that cap is never taken: it is asked back (CreditHeld::wanted), since the worker
  // may be placing it right now. `held` (may be null) gets the credit the worker holds after.
  std::vector<StepOpResult> Step(const WorkerId& worker, const WorkerId& principal, std::vector<StepOp> ops,
                                 absl::Span<const CreditWant> credit, std::vector<CreditHeld>* held)
      ABSL_LOCKS_EXCLUDED(mu_);
  int64_t CreditBlocks(const WorkerId& worker, PoolId pool) const ABSL_LOCKS_EXCLUDED(mu_);  // held now
  // Gives back every credit block of `worker` (its attachment ended; nothing else holds it).
  // Returns how many.
  int64_t DropCredit(const WorkerId& worker) ABSL_LOCKS_EXCLUDED(mu_);

  // Tokens of `tokens` that Acquire would serve from the device tier now (capped to leave one
  // token to compute). Holds nothing. NOT_FOUND for an unknown pool.
  absl::StatusOr<int64_t> PeekPrefixLen(const Namespace& ns, absl::Span<const Token> tokens) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // --- prefixes in flight (kv_cache_inflight.cc; docs/architecture.md, "Prefixes in flight") ---
  // Where a start of `ns` with `prompt` would find its next blocks, after the cached prefix,
  // computed now by another live request of the namespace; nullopt when they are not. Holds
  // nothing. NOT_FOUND for an unknown pool.
  absl::StatusOr<std::optional<InFlightInfo>> InFlightAhead(const Namespace& ns, absl::Span<const Token> prompt) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Whether the request `info` names still computes any of the blocks it names (false once it
  // published them or ended in any way).
  bool InFlightHeld(const InFlightInfo& info) const ABSL_LOCKS_EXCLUDED(mu_);
  // Called after an operation let in-flight blocks go (published or ended), without the lock, on
  // that operation's thread; must not block nor call back into KvCache. Set before serving.
  void SetInflightWake(std::function<void()> wake) ABSL_LOCKS_EXCLUDED(mu_, deliver_mu_);
  int64_t inflight_blocks() const ABSL_LOCKS_EXCLUDED(mu_);  // entries of the in-flight index

  // Drops the session's affinity and protection; its cached blocks stay. NOT_FOUND if unknown.
  absl::Status CloseSession(const SessionId& session) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<SessionInfo> GetSession(const SessionId& session) const ABSL_LOCKS_EXCLUDED(mu_);
  // Every live session, soonest to expire first.
  std::vector<SessionInfo> ListSessions() const ABSL_LOCKS_EXCLUDED(mu_);

  // Expires sessions and orphaned checkpoints past their TTL, then evicts every unprotected,
  // unreferenced cached block idle for at least `max_idle`.
  GcStats Gc(absl::Duration max_idle = absl::ZeroDuration()) ABSL_LOCKS_EXCLUDED(mu_);
  // Execution boundary: in each pool used above the high watermark, evicts unprotected, unreferenced
  // blocks down to the low watermark (never a referenced one). Returns blocks evicted.
  int64_t Boundary() ABSL_LOCKS_EXCLUDED(mu_);
  // Evicts every unreferenced cached block, protected or not. Returns blocks evicted.
  int64_t ClearCache() ABSL_LOCKS_EXCLUDED(mu_);

  // OK when `id` is live and held by `worker`: NOT_FOUND when not live, PERMISSION_DENIED when another's.
  absl::Status CheckOwner(const RequestId& id, const WorkerId& worker) const ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<HandleInfo> ListHandles() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<HandleInfo> GetHandle(const RequestId& id) const ABSL_LOCKS_EXCLUDED(mu_);
  CacheReport Report() const ABSL_LOCKS_EXCLUDED(mu_);

  // --- lower tiers (kv_cache_tiers.cc) ---
  // Blocks evicted from now on (except by ClearCache) are offered to `sink` first. Borrowed; call
  // before serving, or with nullptr to stop.
  void SetEvictionSink(EvictionSink* sink) ABSL_LOCKS_EXCLUDED(mu_);
  // The data mover's step and its wake-up (contracts in demotion_mover.h).
  int64_t DemoteAhead(int64_t max_blocks) ABSL_LOCKS_EXCLUDED(mu_);
  void SetMoverWake(std::function<void()> wake) ABSL_LOCKS_EXCLUDED(mu_, deliver_mu_);
  absl::StatusOr<RequestSpec> SpecOf(const RequestId& id) const ABSL_LOCKS_EXCLUDED(mu_);  // NOT_FOUND: not live
  // TierPort (tier_port.h states the contracts).
  absl::Status AdoptPromoted(const RequestId& id, int64_t new_cached_tokens) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<PinnedPrefix> PinPrefix(const Namespace& ns, absl::Span<const Token> tokens, int64_t skip_blocks,
                                         int64_t max_blocks) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status PinBlocks(const RequestId& id, absl::Span<const BlockIndex> blocks) override ABSL_LOCKS_EXCLUDED(mu_);
  void UnpinBlocks(PoolId pool, absl::Span<const BlockIndex> blocks) override ABSL_LOCKS_EXCLUDED(mu_);
  // PeerPort (peer_port.h states the contracts; kv_cache_peer.cc): hybrid pools' peer pulls.
  absl::StatusOr<PinnedUnit> PinHybridUnit(const Namespace& ns, absl::Span<const Token> tokens, int64_t skip_blocks,
                                           int64_t max_blocks) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<int64_t> PullHorizon(const RequestId& id) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<UnitTargets> PinUnitTargets(const RequestId& id, int64_t depth) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status FinishUnitPull(const RequestId& id, PoolId pool, int64_t depth, const UnitTargets& targets,
                              bool written) override ABSL_LOCKS_EXCLUDED(mu_);
  // A live request's tables per group, as Acquire answers them (empty for a pool without groups).
  absl::StatusOr<std::vector<GroupTable>> GroupTablesOf(const RequestId& id) const ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<CachedBlockRef> SnapshotCached() const override ABSL_LOCKS_EXCLUDED(mu_);
  bool WaitForDemotions(absl::Duration timeout) override ABSL_LOCKS_EXCLUDED(mu_);
  int64_t VisitCached(absl::Span<const CachedBlockRef> refs,
                      const std::function<void(const CachedBlockView&)>& fn) override ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<CheckpointSnapshot> SnapshotCheckpoints(bool pin) override ABSL_LOCKS_EXCLUDED(mu_);
  // kv_cache_units.cc: hybrid units into and out of the tiers (docs/hybrid.md §2.9).
  absl::StatusOr<int64_t> SpineMatch(const Namespace& ns, absl::Span<const Token> prompt) override
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<UnitInstall> BeginInstall(const Namespace& ns, absl::Span<const Token> prompt, int64_t first_depth,
                                           std::vector<std::vector<UnitComponent>> units) override ABSL_LOCKS_EXCLUDED(mu_);
  int64_t FinishInstall(const Namespace& ns, absl::Span<const Token> prompt, UnitInstall install,
                        int64_t written) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<int64_t> PeekInstalled(const Namespace& ns, absl::Span<const Token> prompt, int64_t first_depth,
                                        absl::Span<const std::vector<UnitComponent>> units) const override
      ABSL_LOCKS_EXCLUDED(mu_);
  void SetCheckpointDurable(const RequestId& id, uint64_t version, bool durable) override ABSL_LOCKS_EXCLUDED(mu_);
  int64_t checkpoints_not_durable() const override ABSL_LOCKS_EXCLUDED(mu_);
  int64_t cached_blocks() const override ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::vector<BlockIndex>> RestoreCheckpoint(const RequestId& id, const Namespace& ns,
                                                            std::vector<Token> tokens, std::string engine_state,
                                                            absl::Span<const int64_t> group_units) override
      ABSL_LOCKS_EXCLUDED(mu_);
  void DropRestoredCheckpoint(const RequestId& id) override ABSL_LOCKS_EXCLUDED(mu_);
  void EmitExternal(const std::vector<CacheEvent>& events) override ABSL_LOCKS_EXCLUDED(mu_);

  // --- hot handoff (kv_cache_handoff.cc; the contracts are in cache_snapshot.h) ---
  CacheSnapshot ExportSnapshot() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<int64_t> ImportSnapshot(const CacheSnapshot& snapshot) ABSL_LOCKS_EXCLUDED(mu_);

  // --- fences (kv_cache_fences.cc; the contracts are in cache_snapshot.h) ---
  int64_t EndAllFenced(absl::Duration ttl, const absl::flat_hash_map<WorkerId, uint32_t>& pids)
      ABSL_LOCKS_EXCLUDED(mu_);
  int64_t FenceWorker(const WorkerId& worker, uint32_t pid, absl::Duration ttl) ABSL_LOCKS_EXCLUDED(mu_);
  int64_t FenceFreeBlocks(absl::Duration ttl) ABSL_LOCKS_EXCLUDED(mu_);
  int64_t LiftFences(const WorkerId& attachment, uint32_t pid) ABSL_LOCKS_EXCLUDED(mu_);
  int64_t LiftFencesOfGone(uint32_t pid) ABSL_LOCKS_EXCLUDED(mu_);
  int64_t ExpireFences() ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<uint32_t> FencedPids() const ABSL_LOCKS_EXCLUDED(mu_);

  const EventLog& events() const { return events_; }  // WatchEvents replays from it
  int AddEventListener(EventListener fn) override ABSL_LOCKS_EXCLUDED(mu_);
  int AddPressureListener(PressureListener fn) ABSL_LOCKS_EXCLUDED(mu_);
  void RemoveListener(int handle) ABSL_LOCKS_EXCLUDED(mu_);
  void RemoveListenerAndWait(int handle) override ABSL_LOCKS_EXCLUDED(mu_, deliver_mu_);  // tier_port.h
  PressureLevel pressure_level() const ABSL_LOCKS_EXCLUDED(mu_);

  // Recomputes every derived count from scratch and compares (refs, free counts, queue membership,
  // budget). INTERNAL naming the first mismatch. O(cache size): tests only.
  absl::Status CheckInvariantsForTesting() const ABSL_LOCKS_EXCLUDED(mu_);
  // The worker's own view of its credit in `pool`: blocks it holds unplaced and blocks it placed
  // into its requests but has not reported yet. INTERNAL naming the first of them the ledger does
  // not record as that worker's credit (kvd took it, or handed it to another owner).
  absl::Status CheckCreditForTesting(const WorkerId& worker, PoolId pool,
                                     absl::Span<const BlockIndex> believed) const ABSL_LOCKS_EXCLUDED(mu_);
  // The block's writer-owner in the ledger, or nullopt when nobody may write it.
  std::optional<Owner> WriterForTesting(PoolId pool, BlockIndex block) const ABSL_LOCKS_EXCLUDED(mu_);
  // What a path around the ledger would do: moves the last writable block of `from`'s table to
  // the end of `to`'s (same pool; `to` reserved room for it), as BlockState and the tables see
  // it, and leaves the ledger naming `from`. CheckInvariantsForTesting must then fail.
  absl::Status HandBlockBypassingLedgerForTesting(const RequestId& from, const RequestId& to)
      ABSL_LOCKS_EXCLUDED(mu_);
  // What a path that ignores a fence would do: appends a block a fence writes to the end of
  // `to`'s table (`to` reserved room for it) as its writable block, through the ledger (a Transfer
  // from the fence to the request). CheckInvariantsForTesting must then fail.
  absl::Status HandFencedBlockForTesting(const RequestId& to) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using BlockState = cache_state::BlockState;
  using Pool = cache_state::Pool;
  using Request = cache_state::Request;
  using CheckpointRecord = cache_state::CheckpointRecord;
  using ProtectedRef = cache_state::ProtectedRef;
  using Session = cache_state::Session;
  using Outbox = cache_state::Outbox;
  using FenceRecord = cache_state::FenceRecord;
  using PullRecord = cache_state::PullRecord;
  using FenceMap = absl::btree_map<std::pair<absl::Time, uint64_t>, FenceRecord>;  // by (until, serial)
  KvCache(CacheOptions options, const Clock* clock, int64_t budget_bytes);
  // kv_cache.cc: requests.
  absl::StatusOr<PoolId> ValidateSpecLocked(const RequestSpec& spec) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<AdmitResult> DecideLocked(const RequestSpec& spec, PoolId pool) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<AcquireResult> ResumeLocked(Request& req, CheckpointRecord& ckpt)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<AcquireResult> AcquirePrefixLocked(Request& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::vector<BlockIndex>> ExtendLocked(const RequestId& id, int64_t additional)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseLocked(Request& req, bool completed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `ending`: a preempt's checkpoint (the request is released next; a hybrid pool's state slot
  // passes to the record with no fresh spare). `fresh_slots` may be null.
  absl::Status CheckpointLocked(const RequestId& id, absl::Span<const Token> tokens, std::string engine_state,
                                absl::Span<const StateCheckpoint> state = {}, bool ending = false,
                                std::vector<int64_t>* fresh_slots = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // kv_cache_group_checkpoints.cc: generation checkpoints on hybrid pools (docs/hybrid.md §2.9).
  // What a checkpoint of `req` at `tokens` tokens takes of each group; checked before anything
  // changes (INVALID_ARGUMENT naming state_checkpoints; FAILED_PRECONDITION when a window's blocks
  // before the position were released; RESOURCE_EXHAUSTED when no fresh spare fits).
  struct GroupCheckpointPlan {
    std::vector<cache_state::CheckpointRecord::Group> groups;  // per group, as the record keeps it
    std::vector<int64_t> grow;  // units the request's reservation grows by (a live one's fresh spare)
  };
  absl::StatusOr<GroupCheckpointPlan> PlanGroupCheckpointLocked(const Request& req, int64_t tokens,
                                                                absl::Span<const StateCheckpoint> state,
                                                                bool ending) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Carries out `plan` into `rec` (the record references the units; each slot passes from the
  // request to it, replaced by a fresh spare unless `ending`). Nothing fails.
  void ApplyGroupCheckpointLocked(Request& req, CheckpointRecord& rec, GroupCheckpointPlan plan, bool ending,
                                  std::vector<int64_t>* fresh_slots) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Acquire of a request resuming a hybrid pool's checkpoint: the record's units become the
  // request's (the state slot as its state group's checkpoint_slot, to copy into the running
  // slot), plus the fresh units of its held ranges. FAILED_PRECONDITION, changing nothing, for a
  // checkpoint of another pool or namespace, one that does not continue the prompt, or one whose
  // tail a fence or a pull may still write (or that was published since): it resumes exactly only.
  absl::StatusOr<AcquireResult> ResumeGroupsLocked(Request& req, CheckpointRecord& ckpt)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A checkpoint restored from G3 (RestoreCheckpoint): the units per group one at `tokens` tokens
  // holds on `pool` (the spine's table, each window's blocks before the position, 1 per state
  // group), and their allocation into `rec` (blocks, groups), owned by `serial` and written by no
  // one; RESOURCE_EXHAUSTED, changing nothing, when a group has too few reclaimable units.
  std::vector<int64_t> CheckpointUnitsLocked(PoolId pool, int64_t tokens) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AllocateCheckpointUnitsLocked(PoolId pool, int64_t tokens, uint64_t serial, CheckpointRecord& rec)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // kv_cache_handoff.cc: a hybrid pool's spine components across a hot handoff (cache_snapshot.h).
  void ExportComponentsLocked(const Pool& pool, const CachedBlock& node, CacheSnapshot::Block* e) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // INVALID_ARGUMENT naming the field for components / checkpoint groups that do not fit this
  // configuration's groups (ranges, counts, a unit used twice). No lock: geometry only.
  absl::Status CheckSnapshotComponents(const CacheSnapshot::Block& b, int64_t i, absl::flat_hash_set<BlockIndex>& taken,
                                       absl::flat_hash_set<BlockIndex>& components) const;
  absl::Status CheckSnapshotCheckpointGroups(const CacheSnapshot::Checkpoint& c, PoolId pool,
                                             absl::flat_hash_set<BlockIndex>& taken,
                                             const absl::flat_hash_set<BlockIndex>& components) const;
  // Attaches the snapshot's components to the imported `nodes` (window blocks, then checkpoints
  // whose window is all there), each cached and referenced once; frees the rest. Returns the
  // attached ones in order, for the caller to let go.
  std::vector<std::pair<PoolId, BlockIndex>> ImportComponentsLocked(const CacheSnapshot& snap,
                                                                    const std::vector<CachedBlock*>& nodes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every unit a checkpoint references: its table, then each group's blocks and slot.
  static std::vector<BlockIndex> AllBlocksOf(const CheckpointRecord& ckpt);
  // What an orphaned checkpoint is charged: its charged units' bytes (or blocks', without groups).
  int64_t ChargedBytesLocked(const CheckpointRecord& ckpt) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Units per group of `blocks` of a hybrid pool (the fence's charge).
  std::vector<int64_t> UnitsOfLocked(PoolId pool, absl::Span<const BlockIndex> blocks) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // kv_cache_step.cc: step ops and credit. GrowLocked is Extend's body, taking `credit` first.
  StepOpResult ApplyStepOpLocked(const WorkerId& worker, StepOp& op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // On a hybrid pool, `groups` (may be null) gets GrowGroupsLocked's tables and the result is the
  // spine group's appended blocks.
  absl::StatusOr<std::vector<BlockIndex>> GrowLocked(const RequestId& id, int64_t additional,
                                                     absl::Span<const BlockIndex> credit,
                                                     int64_t computed_tokens = 0,
                                                     std::vector<GroupTable>* groups = nullptr,
                                                     absl::Span<const int> credit_groups = {})
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes back `want.returned` (blocks the worker does not hold are skipped), then tops up; returns
  // how many blocks above the cap kvd asks back. On a hybrid pool, for `want.group` alone: one
  // ledger owner per (worker, pool) holds every group's credit blocks (a block's index says its
  // group), charged per group's units.
  int64_t SetCreditLocked(const WorkerId& worker, const WorkerId& principal, const CreditWant& want)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The credit's ledger owner in `pool` of `worker`, or null when it holds none there.
  const cache_state::PoolCredit* FindCreditLocked(const WorkerId& worker, PoolId pool) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives back every credit block of `worker`; returns them (by pool) for a fence, when asked.
  void DropCreditLocked(const WorkerId& worker, std::vector<CreditHeld>* taken) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The distinct live publishers of `blocks`.
  std::vector<WorkerId> PublishersLocked(const std::vector<CachedBlock*>& blocks) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Request*> FindRequestLocked(const RequestId& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t MaxHitBlocks(const Pool& pool, int64_t prompt_tokens) const;
  // RESOURCE_EXHAUSTED naming the limit when `worker` may not take `requests` more requests and
  // `bytes` more reserved bytes.
  absl::Status CheckWorkerLimitsLocked(const WorkerId& worker, int64_t requests, int64_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // kv_cache_publish.cc: publish and checkpoints. FAILED_PRECONDITION for a block a pull is
  // writing, unless `by_pull` (AdoptPromoted: the pull publishes what it wrote). `blocks[i]` may
  // name the request's own copy where its table holds the cached duplicate. `*continues` (may be
  // null) says whether the chain continues past the plan's duplicates: not on a hybrid pool without
  // a spine (no full group), nor before End when the budget or the worker's limits have no room
  // for the own copies (`end`: the request is released under the same lock, so they need none).
  absl::StatusOr<PublishResult> PlanPublishLocked(const Request& req, absl::Span<const Token> tokens,
                                                  absl::Span<const BlockIndex> blocks, bool by_pull,
                                                  bool end = false, bool* continues = nullptr) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The chain continues past the duplicate `node` at `position` of `req`'s table: the table takes
  // the cached block (and so does the request's own checkpoint, if it holds the copy there), the
  // request's copy moves to own_copies.
  void ContinuePastDuplicateLocked(Request& req, int64_t position, CachedBlock* node)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<PublishResult> EndLocked(const RequestId& id, int64_t publish_blocks,
                                          absl::Span<const Token> more_tokens, bool completed,
                                          absl::Span<const StateCheckpoint> checkpoints = {})
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `end`: End's publish (a tail checkpoint at the last published block is allowed).
  absl::StatusOr<PublishResult> PublishLocked(const RequestId& id, absl::Span<const Token> tokens,
                                              absl::Span<const BlockIndex> blocks, bool by_pull = false,
                                              absl::Span<const StateCheckpoint> checkpoints = {},
                                              bool end = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckKnownTokensLocked(const Request& req, absl::Span<const Token> tokens) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void LearnTokensLocked(Request& req, absl::Span<const Token> tokens) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OrphanCheckpointLocked(CheckpointRecord& ckpt) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropCheckpointLocked(const RequestId& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds (sign +1) or removes (-1) a checkpoint's state bytes and not-durable count from the totals.
  void ChargeCheckpointStateLocked(const CheckpointRecord& ckpt, int sign) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Room for `bytes` more checkpoint state for `owner` (empty: no worker) when `replacing` (may be
  // null) goes: drops the oldest orphans for the total; RESOURCE_EXHAUSTED when still short.
  absl::Status MakeCheckpointStateRoomLocked(const WorkerId& owner, int64_t bytes,
                                             const CheckpointRecord* replacing) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // kv_cache_blocks.cc: writers (the ledger's request and pull owners). A request writes its
  // blocks as Owner{kRequest, its worker, its serial}.
  static Owner WriterOf(const Request& req) { return Owner{OwnerKind::kRequest, req.spec.owner, req.serial}; }
  // Hands every block `req` writes to `to` (a pull, a fence: an owner not yet in the ledger or
  // already of that pool), one Transfer each; returns them in table order. They stay in the
  // request's table and BlockState::owner; the request's worker is no longer their writer.
  std::vector<BlockIndex> HandOverWritesLocked(const Request& req, const Owner& to) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Nobody writes the blocks `req` wrote any more (it ends: released, ended, preempted, fenced).
  void ReleaseWritesLocked(const Request& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The pull `it` is done: what it still holds goes back to its request, or is let go when the
  // request has ended. The caller then unpins.
  void EndPullLocked(absl::flat_hash_map<uint64_t, PullRecord>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // kv_cache_peer.cc: UnpinBlocks under the lock; the request's units a pull of `req` to `depth`
  // writes (HybridSpine::kNone where a window group's table does not hold the position); the
  // hit's move to `depth` once a pull wrote them.
  void UnpinLocked(PoolId pool, absl::Span<const BlockIndex> blocks) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::vector<BlockIndex>> UnitTargetsLocked(const Request& req, int64_t depth) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AdoptUnitLocked(const RequestId& id, PoolId pool, int64_t depth, const UnitTargets& targets)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // kv_cache_blocks.cc: references, allocation, eviction. Unref: a block left unreferenced is
  // freed (owned) or becomes evictable (cached). `touch`: the reference is a use (recency).
  void RefLocked(PoolId pool, BlockIndex index, bool touch = true) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnrefLocked(PoolId pool, BlockIndex index, bool touch = true) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Unrefs a block table tail first, so the head of a prefix is the most recently used.
  void UnrefTableLocked(PoolId pool, absl::Span<const BlockIndex> table) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `count` owned blocks for `owner` (BlockState::owner), evicting as needed; RESOURCE_EXHAUSTED
  // (no change) if too few. `writer` (owner == writer->epoch) is recorded in the ledger as their
  // writer; null only for blocks nobody writes through the engine (a restored checkpoint's).
  // `group`: of a hybrid pool's groups, the one to allocate from (0 for a pool without groups).
  absl::StatusOr<std::vector<BlockIndex>> AllocateOwnedLocked(PoolId pool, int64_t count, uint64_t owner,
                                                              const Owner* writer, int group = 0)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `count` blocks off `group`'s free list, owned by `owner` (refs 1). REQUIRES: that many free.
  std::vector<BlockIndex> TakeFreeLocked(Pool& pool, int64_t count, int group, uint64_t owner)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EvictOneLocked(Pool& pool, CachedBlock* victim, EvictReason reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `key`, when given, is the block's chained key (computed before the lock).
  CachedBlock* CacheBlockLocked(PoolId pool, NamespaceRoot* root, CachedBlock* parent,
                                BlockIndex index, absl::Span<const Token> tokens, const BlockKey* key = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SetProtectionLocked(PoolId pool, CachedBlock* node, int delta) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t NextTickLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // kv_cache_groups.cc: hybrid pools' per-group admission and tables (docs/hybrid.md §2.4, §2.5).
  // §2.5's units per group for a request of `tokens` tokens.
  static std::vector<int64_t> UnitsFor(const PoolGeometry& geo, int64_t tokens);
  // The block positions [lo, hi) group g holds at n tokens and c computed (state: its 2 slots).
  static std::pair<int64_t, int64_t> HeldRange(const PoolGeometry& geo, int g, int64_t n, int64_t c);
  // OUT_OF_RANGE naming the group a request can never fit (or the budget).
  absl::Status CheckGroupsFitLocked(PoolId pool, const RequestSpec& spec) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The bytes `req`'s reservation charges (its units', or its blocks' on a pool without groups).
  int64_t ReservedBytesLocked(const Request& req) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every block `req` references: its table, then each group's.
  static std::vector<BlockIndex> AllBlocksOf(const Request& req);
  std::vector<GroupTable> GroupTablesLocked(const Request& req) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<AcquireResult> AcquireGroupsLocked(Request& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // GrowLocked on a hybrid pool: `additional_tokens` more positions and the engine's
  // `computed_tokens` (0: unchanged); releases window blocks that fell out (published: cached;
  // else freed) and appends what each group needs, taking `credit` (the worker's credit blocks,
  // credit_groups[i] the group of credit[i]) first in each group. All or nothing. Returns per
  // group the blocks appended and the first block position after.
  absl::StatusOr<std::vector<GroupTable>> GrowGroupsLocked(Request& req, int64_t additional_tokens,
                                                           int64_t computed_tokens,
                                                           absl::Span<const BlockIndex> credit = {},
                                                           absl::Span<const int> credit_groups = {})
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // kv_cache_spine.cc: the spine of a hybrid pool with a full group (docs/hybrid.md §2.6-2.8).
  // INVALID_ARGUMENT, before anything changes, unless each checkpoint names a state group and one
  // of the request's own slots of it, at a position >= 0, no slot twice.
  absl::Status CheckStateCheckpointsLocked(const Request& req, absl::Span<const StateCheckpoint> checkpoints) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After a publish on a hybrid pool: the request's blocks of other attention groups at positions
  // whose spine node is its chain's attach to the nodes that have none of that group (cached, no
  // writer; evictable once the request lets them go; a node that has one leaves the request's
  // block its own), then the checkpoints are accepted per §2.7 into `published`.
  void PublishSideLocked(Request& req, absl::Span<const StateCheckpoint> checkpoints, bool end,
                         PublishResult& published) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // At release on a hybrid pool, after its window blocks were let go: those no hit at the end of
  // its cached chain reads (positions before that hit's window) go first in their group's
  // eviction order (docs/hybrid.md §2.8). O(the request's table), no cache scan.
  void ReorderReleasedWindowsLocked(const Request& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts from non-spine group g's oldest evictable components until one unit of g is free
  // (window blocks a checkpoint reads wait for that checkpoint; a unit at an unreferenced leaf goes
  // whole). False, when nothing more can go.
  bool EvictSideLocked(Pool& pool, int g) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A cached, unreferenced component leaves its group's evictable list and is freed.
  void FreeComponentLocked(Pool& pool, BlockIndex index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Erases pool.plan's nodes in order (EvictNodeLocked) and frees its components, then clears it.
  // With a sink (and not for kClear, nor while side_pressure_), each node goes down as one unit:
  // its components in the plan are held with it for the sink's copy (HeldBlock::parts).
  void CarryOutPlanLocked(Pool& pool, EvictReason reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A block of a hybrid pool with a spine lost its last reference: an unservable spine leaf goes
  // (U2), a window block no checkpoint reads is tombstoned and freed (U4).
  void AfterLastUnrefLocked(Pool& pool, BlockIndex index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Spine Match + §2.6's Lookup for `prompt` (keys of its full blocks): the hit in `hit`, the
  // chain in `chain`.
  void LookupHybridLocked(const Pool& pool, const Namespace& ns, absl::Span<const Token> prompt,
                          absl::Span<const BlockKey> keys, std::vector<CachedBlock*>* chain, HybridHit* hit) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The old single-node eviction: `victim` leaves the index and its block is freed (or held).
  // The components of spine node `node` of a hybrid pool, in group order (empty otherwise).
  std::vector<UnitComponent> UnitPartsLocked(const Pool& pool, const CachedBlock& node) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Up to `max` blocks of `group` that this thread's pending demotions hold for nobody (a unit's
  // parts, a cascaded node), handed to `owner` (refs + 1) as AllocateOwnedLocked hands a victim.
  std::vector<BlockIndex> TakeHeldLocked(PoolId pool, int group, int64_t max, uint64_t owner)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `parts`: a hybrid unit's components, already detached from the spine, demoted with it (held
  // like the block) when the block is; null: none.
  void EvictNodeLocked(Pool& pool, CachedBlock* victim, EvictReason reason,
                       const std::vector<UnitComponent>* parts = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // CheckInvariantsForTesting's per-group part (docs/hybrid.md §2.8, U6): per group of every
  // hybrid pool, free + owned + cached = capacity counted from the blocks and equal to the
  // allocator's and side lists' counts; every block of a request's group table lies in that
  // group's range, at most its reserved units; per-group reservations sum to the ledger's; the
  // budget's charge is the sum of the groups'.
  absl::Status CheckGroupsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // kv_cache_fences.cc. A fence writes as Owner{kFence, its attachment, its serial} (FenceWriter).
  static Owner FenceWriter(const FenceRecord& f) { return Owner{OwnerKind::kFence, f.attachment, f.serial}; }
  // Fences `blocks` of `pool` for the attachment `owner` (cached ones skipped: published bytes are
  // never rewritten) until `until` on clock_, as fence `serial` (from next_serial_). It references
  // each, claims the free ones, and becomes the writer of each that has none; one the caller handed
  // over to FenceWriter already (HandOverWritesLocked, a credit Transfer) stays its, and one another
  // fence writes stays that fence's (a block fenced twice has one writer: the first fence). It
  // charges nothing yet: ChargeFenceLocked, once the blocks' previous holders have let go.
  void AddFenceLocked(const cache_state::FenceOwner& owner, PoolId pool, absl::Span<const BlockIndex> blocks,
                      absl::Time until, uint64_t serial) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Charges fence (until, serial), if it exists, with the blocks it alone references (as a
  // request's would be, so that admission never promises them), when the budget has the room.
  void ChargeFenceLocked(absl::Time until, uint64_t serial) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `from` no longer writes `block`: it passes to a fence that still holds it (the first by
  // deadline; not fence `except_serial`), or nobody writes it.
  void ReturnWriteLocked(PoolId pool, BlockIndex block, const Owner& from, uint64_t except_serial = 0)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends `req` as interrupted and fences the blocks it owned for `owner`. The caller erases it.
  void EndFencedLocked(Request& req, const cache_state::FenceOwner& owner, absl::Time until)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fences `worker`'s credit for `owner` (each block Transferred from the credit to the fence) and
  // drops the credit entry.
  void FenceCreditLocked(const WorkerId& worker, const cache_state::FenceOwner& owner, absl::Time until)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Lifts every fence `match` selects; returns the blocks.
  int64_t LiftMatchingLocked(const std::function<bool(const FenceRecord&)>& match) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void LiftFenceLocked(FenceMap::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool FencedLocked(PoolId pool, BlockIndex index) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // kv_cache_inflight.cc: the in-flight index (inflight_index.h).
  std::optional<InFlightInfo> InFlightInfoLocked(const Namespace& ns, absl::Span<const BlockKey> keys,
                                                 int64_t from) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Blocks of `prompt` the namespace's index matches (a hybrid pool's spine match).
  int64_t MatchedBlocksLocked(const Pool& pool, const Namespace& ns, absl::Span<const Token> prompt,
                              absl::Span<const BlockKey> keys) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What a start of `prompt` (chain keys `keys`) would find in flight past its match now; nullopt
  // on a hybrid pool without a full group (it enters nothing). InFlightAhead's and Acquire's.
  std::optional<InFlightInfo> InFlightAheadLocked(const Pool& pool, const Namespace& ns, absl::Span<const Token> prompt,
                                                  absl::Span<const BlockKey> keys) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After `req`'s Acquire (not a resume): `out.in_flight` is what it found in flight past its
  // match, then it holds its own prompt blocks from there (those nobody else holds).
  void NoteAcquiredLocked(Request& req, AcquireResult& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void InflightPublishedLocked(const Request& req, int64_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void InflightEndedLocked(const Request& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckInflightLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Deliver's part: calls inflight_wake_ when entries went since the last call.
  void WakeInflightWaiters() ABSL_LOCKS_EXCLUDED(mu_, deliver_mu_);

  // kv_cache_maintenance.cc: sessions, expiry, pressure, reports.
  // Reads the clock (op_now_ns_), drops sessions and orphans past their TTL. Every mutation's first.
  void ExpireLocked(GcStats* stats) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateSessionLocked(const Request& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropSessionLocked(const SessionId& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdatePressureLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records `scratch_event_` (filled by the caller) in the event log and queues it for listeners.
  void EmitLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  HandleInfo HandleOfLocked(const Request& req) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  SessionInfo SessionInfoLocked(const SessionId& id, const Session& s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RunDemotions (OnEvict, without mu_, for each block this thread's operation evicted with a
  // sink set; then lets them go), then queued notifications in order. Every operation that can
  // evict calls it after releasing mu_ and before returning.
  void Deliver() ABSL_LOCKS_EXCLUDED(mu_, deliver_mu_);
  void RunDemotions() ABSL_LOCKS_EXCLUDED(mu_);
  // A pinned reference that leaves recency alone (VisitCached, demotions); Unhold drops it.
  void HoldLocked(PoolId pool, BlockIndex index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnholdLocked(PoolId pool, BlockIndex index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const CacheOptions options_;
  const Clock* const clock_;
  const std::vector<PoolGeometry> pool_geometries_;
  EventLog events_;
  // Serializes delivery so listeners see notifications in the order they were produced.
  absl::Mutex deliver_mu_ ABSL_ACQUIRED_BEFORE(mu_);

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Pool>> pools_ ABSL_GUARDED_BY(mu_);
  PrefixIndex index_ ABSL_GUARDED_BY(mu_);
  InflightIndex inflight_ ABSL_GUARDED_BY(mu_);  // prompt blocks live requests compute now
  std::function<void()> inflight_wake_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> inflight_changed_{false};  // set under mu_ when in-flight entries went
  BudgetLedger ledger_ ABSL_GUARDED_BY(mu_);
  PressureMonitor pressure_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<RequestId, std::unique_ptr<Request>> requests_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<RequestId, std::unique_ptr<CheckpointRecord>> checkpoints_ ABSL_GUARDED_BY(mu_);
  // Orphaned checkpoints, oldest first: (orphaned at, serial) -> id.
  absl::btree_map<std::pair<absl::Time, uint64_t>, RequestId> orphans_ ABSL_GUARDED_BY(mu_);
  int64_t orphan_blocks_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t checkpoint_state_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // CheckpointRecord::state_bytes, all
  int64_t checkpoints_not_durable_ ABSL_GUARDED_BY(mu_) = 0;  // records with !durable
  absl::flat_hash_map<WorkerId, int64_t> checkpoint_state_by_worker_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<SessionId, Session> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<WorkerId, cache_state::WorkerCredit> credit_ ABSL_GUARDED_BY(mu_);
  BlockLedger owners_ ABSL_GUARDED_BY(mu_);  // who may write each block (block_ledger.h)
  // Pulls in progress, by ledger epoch. Few (bounded by the promotion readers and the peer
  // puller's queue): UnpinBlocks scans them.
  absl::flat_hash_map<uint64_t, PullRecord> pulls_ ABSL_GUARDED_BY(mu_);
  FenceMap fences_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, int32_t> fenced_ ABSL_GUARDED_BY(mu_);  // fences per block, by cache_state::FencedBlockKey
  absl::btree_map<std::pair<absl::Time, SessionId>, bool> session_expiry_ ABSL_GUARDED_BY(mu_);
  uint64_t next_serial_ ABSL_GUARDED_BY(mu_) = 1;
  WorkerTable workers_ ABSL_GUARDED_BY(mu_);
  uint64_t last_tick_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t op_now_ns_ ABSL_GUARDED_BY(mu_) = 0;  // clock reading of the current operation
  CacheReport counters_ ABSL_GUARDED_BY(mu_);  // the monotonic counters of Report()
  Outbox outbox_ ABSL_GUARDED_BY(mu_);
  CacheEvent scratch_event_ ABSL_GUARDED_BY(mu_);  // reused so that emitting allocates nothing
  std::atomic<bool> outbox_pending_{false};  // set under mu_ when outbox_ gains something
  int next_listener_ ABSL_GUARDED_BY(mu_) = 1;
  std::vector<std::pair<int, EventListener>> event_listeners_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<int, PressureListener>> pressure_listeners_ ABSL_GUARDED_BY(mu_);
  EvictionSink* sink_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::function<void()> mover_wake_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> demote_wanted_{false};  // set under mu_ when a pool falls below its reserve
  // A window or state group's allocation is evicting (EvictSideLocked): its units are dropped,
  // not demoted, so that the units it frees are free at once (a held part would be neither).
  bool side_pressure_ ABSL_GUARDED_BY(mu_) = false;
  int demotions_in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // RunDemotions calls using sink_ now
  // Blocks evicted towards the sink whose OnEvict has not returned yet (held, being copied down).
  int64_t demotions_pending_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvd
