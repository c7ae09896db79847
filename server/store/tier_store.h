// TierStore holds the lower tiers under the device pool (G1): G2, host RAM in fixed slots
// (page-locked on the CUDA backend), and G3, segment files in a local directory. Together with
// KvCache (which keeps G1) it forms one cache: blocks evicted from G1 are demoted here instead of
// dropped, a lookup that runs past G1's match promotes them back, Flush makes everything durable
// on G3, and a restarted daemon reloads G3's headers and serves from them at once.
//
// Index: one entry per stored record (prefix block or object), keyed like the prefix index (the
// chained block key) and verified the same way (tokens and parent key compared), so a collision
// is a miss. An entry's bytes live in any of: G2 slots; a spill buffer (demoted while G2 was full,
// on its way to G3); a G3 segment. Tiers are not exclusive: a block written to G3 keeps its G2
// copy until G2 needs the room, and a promoted block keeps its copies below.
//
// G4 (optional, remote_tier.h): blocks published to G1 are uploaded to Redis by one uploader
// thread (write-through); a promotion that runs past what G1-G3 hold asks G4 for the rest of the
// prompt's chain on the reader thread. A hybrid pool's units go up whole as they leave G1 (one
// value each, copied in OnEvict) and come back through InstallUnits like G2/G3's.
//
// The engine is reached through TierPort (server/core/tier_port.h) only.
//
// Threads: OnEvict runs on the evicting call's thread after KvCache has released its mutex (the
// block held until it returns); it copies without this store's mutex too (claim a slot, copy,
// install). Lock order where both are held: KvCache's, then this one's. Disk writes (spills, flushes, manifest) run on one writer thread, disk reads (promotion,
// prefetch, object gets) on reader threads; no gRPC thread ever waits on the disk.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gpu/device_arena.h"
#include "server/core/tier_port.h"
#include "server/store/executor.h"
#include "server/store/file_system.h"
#include "server/store/host_tier.h"
#include "server/store/record_header.h"
#include "server/store/remote_tier.h"
#include "server/store/segment_file.h"
#include "server/store/tier_types.h"

namespace kvd {

class TierStore final : public EvictionSink {
 public:
  // Creates G2 and the G3 directory (nothing is read yet: call Load). INVALID_ARGUMENT for bad
  // options; the failing call named otherwise. `arena` and `cache` are borrowed.
  static absl::StatusOr<std::unique_ptr<TierStore>> Open(TierOptions options,
                                                        const DeviceArena* arena, TierPort* cache);
  ~TierStore() override;

  // Reads G3's manifest and every live segment's headers (not the bytes) and indexes what it
  // found. Records the events a restart owes routers in the cache's event log: "all cleared",
  // then one "stored" (medium disk) per reloaded block. Nothing is deleted for lack of metadata:
  // - a lost or damaged manifest is rebuilt from the segments (their blocks only; the damaged
  //   file is kept as MANIFEST.damaged);
  // - a segment written after the manifest's last commit is adopted (its blocks only);
  // - a damaged segment (bad checksum, magic or count) is moved to quarantine/ and logged;
  // - a segment that cannot be read (permissions, I/O) stays listed, is logged, and is neither
  //   served nor evicted this run; a truncated one serves its intact records.
  // Deleted, each with a log line: .tmp files (unfinished writes) and unlisted segments numbered
  // below the manifest's next_segment (evicted or replaced by a committed manifest).
  // FAILED_PRECONDITION when the manifest exists but cannot be read. Then RestoreCheckpoints,
  // unless not `restore_checkpoints` (a daemon on adopted memory calls it once it may: server/daemon.cc).
  absl::Status Load(bool restore_checkpoints = true);
  // Recreates each stored checkpoint not already in the cache, in free blocks, and fills them.
  void RestoreCheckpoints() ABSL_LOCKS_EXCLUDED(mu_);

  // EvictionSink: demotes a block leaving G1 to G2 (or, without room there, towards G3).
  void OnEvict(const CachedBlockView& block, EvictReason reason) override;

  // Promotion for a request that Acquire just served with `acquired.cached_tokens` tokens from
  // G1: when lower tiers hold the following blocks of its prompt, copies them into the request's
  // writable blocks on a reader thread, publishes them (KvCache::AdoptPromoted) and calls
  // done(new cached_tokens) there. Returns false, without calling `done`, when there is nothing
  // to promote.
  using PromoteDone = std::function<void(absl::StatusOr<int64_t> cached_tokens)>;
  bool Promote(const RequestId& id, const RequestSpec& spec, const AcquireResult& acquired,
               PromoteDone done) ABSL_LOCKS_EXCLUDED(mu_);

  // Hybrid pools (docs/hybrid.md §2.9; tier_store_units.cc): before a lookup, brings the units
  // G2/G3 hold past G1's spine match of the request's prompt back into G1 as cached units
  // (TierPort::BeginInstall / FinishInstall) on a reader thread, then calls done() there; the
  // lookup that follows applies §2.6 to them. A run of records stops at the first missing, damaged
  // or foreign one, and (pools with a state group) at the deepest unit holding a checkpoint of
  // every state group; G4 continues the run G2/G3 hold. False, without calling `done`, for a pool
  // without groups or when no tier holds the next unit (with G4 up, Redis is asked first).
  bool InstallUnits(const RequestSpec& spec, std::function<void()> done) ABSL_LOCKS_EXCLUDED(mu_);
  // The tokens a start of `tokens` would hit once InstallUnits brought back the units G2/G3 hold
  // (tier_store_peek.cc; TierPort::PeekInstalled over the records' headers, read in memory: no
  // I/O, nothing pinned or touched); 0 for a pool without groups, an unknown pool, or when no tier
  // holds the next unit (the device tier's answer is KvCache::PeekPrefixLen's). A record that fails
  // its checksum when a start reads it serves nothing then, so that start hits less than this
  // said; G4 is not asked (a peek does no I/O).
  int64_t PeekUnits(const Namespace& ns, absl::Span<const Token> tokens) ABSL_LOCKS_EXCLUDED(mu_);
  // Prefetch on a hybrid pool: brings the units InstallUnits would bring back for a start of
  // `tokens` into G1 now, as cached, unreferenced units (evictable like any: nothing is held for
  // the start), then calls done() on a reader thread, or inline when no tier holds the next unit
  // (tier_store_peek.cc). Its PrefetchInfo: found_blocks how far G1's spine match of the prompt
  // grew (the units installed and kept, unless G1 changed meanwhile), loading_blocks 0, and a
  // handle that holds nothing but counts against max_prefetch_handles_per_worker until released
  // (or its owner detaches). A unit that fails its checksum is dropped, never installed. False,
  // without calling `done`, for a pool without groups (Prefetch serves it); RESOURCE_EXHAUSTED past
  // the handle limit, NOT_FOUND for an unknown pool.
  absl::StatusOr<bool> PrefetchUnits(const Namespace& ns, absl::Span<const Token> tokens, const WorkerId& owner,
                                     std::function<void(PrefetchInfo)> done) ABSL_LOCKS_EXCLUDED(mu_);
  bool hybrid(PoolId pool) const { return pools_[pool].hybrid(); }

  // Starts bringing the saved blocks of `tokens` up to G2 and keeps them there until the handle
  // is released (or its owner detaches). NOT_FOUND for an unknown pool.
  absl::StatusOr<PrefetchInfo> Prefetch(const Namespace& ns, absl::Span<const Token> tokens,
                                        const WorkerId& owner) ABSL_LOCKS_EXCLUDED(mu_);
  // NOT_FOUND for an unknown handle; PERMISSION_DENIED for another worker's.
  absl::Status ReleasePrefetch(uint64_t handle, const WorkerId& owner) ABSL_LOCKS_EXCLUDED(mu_);
  void ReleasePrefetchesOf(const WorkerId& owner) ABSL_LOCKS_EXCLUDED(mu_);
  // RESOURCE_EXHAUSTED from Prefetch past options().max_prefetch_handles_per_worker.

  // Makes every cached prefix (G1 and G2) durable on G3. Runs on the writer thread; `done` is
  // called there. FAILED_PRECONDITION without a disk tier.
  absl::Status FlushAsync(std::function<void(FlushResult)> done) ABSL_LOCKS_EXCLUDED(mu_);
  // FlushAsync and wait (drain and Close use it).
  absl::StatusOr<FlushResult> Flush() ABSL_LOCKS_EXCLUDED(mu_);
  // Drops everything held in memory (G2 and pending spills); G3 stays. Close's last step.
  void DropMemory() ABSL_LOCKS_EXCLUDED(mu_);

  // Objects: exact (namespace, key) -> bytes, in G2 and G3 like blocks. Put: INVALID_ARGUMENT
  // (empty key), RESOURCE_EXHAUSTED when no tier can hold it. Get: NOT_FOUND, DATA_LOSS (the
  // stored copy failed its checksum and was dropped); runs `done` inline or on a reader thread.
  absl::Status PutObject(const Namespace& ns, const std::string& key, absl::string_view bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
  void GetObject(const Namespace& ns, const std::string& key,
                 std::function<void(absl::StatusOr<std::string>)> done) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status DeleteObject(const Namespace& ns, const std::string& key) ABSL_LOCKS_EXCLUDED(mu_);

  // Every complete token prefix G3 holds (chains from a namespace root to a leaf), from headers.
  std::vector<SavedPrefix> SavedPrefixes() const ABSL_LOCKS_EXCLUDED(mu_);

  // Idle demotion: G2 entries unused for idle_demote_after go to G3. The daemon calls it
  // periodically (with KvCache::Gc for G1) unless stopped.
  void DemoteIdle() ABSL_LOCKS_EXCLUDED(mu_);
  void StopIdleDemotion() { idle_demotion_.store(false); }
  bool idle_demotion() const { return idle_demotion_.load() && options_.idle_demote_after > absl::ZeroDuration(); }

  // Counters and gauges; reads counts kept incrementally (never a scan of any index).
  TierStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);
  // Recomputes Stats()'s gauges by scanning every index (this store's and the engine's) and
  // compares: INTERNAL naming the first that drifted. Call while nothing else changes the engine
  // (the store's own threads may run). Tests.
  absl::Status CheckStatsForTesting() const ABSL_LOCKS_EXCLUDED(mu_);
  const TierOptions& options() const { return options_; }
  // Waits until no promotion, prefetch, object read or disk write is queued or running (their
  // callbacks have returned). The daemon calls it on shutdown before destroying the RPC server.
  void Quiesce() ABSL_LOCKS_EXCLUDED(mu_) { WaitIdleForTesting(); }
  // Tests: `hook` runs on the writer thread in every flush after the host tier is written and
  // before the device blocks are copied (where an eviction hurts most), or at the start of every
  // OnEvict (a slow copy down). Set while nothing flushes or evicts.
  void SetFlushHookForTesting(std::function<void()> hook) { flush_hook_for_testing_ = std::move(hook); }
  void SetDemotionHookForTesting(std::function<void()> hook) { demotion_hook_for_testing_ = std::move(hook); }
  // Waits until no spill write is pending (tests).
  void WaitIdleForTesting() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    RecordHeader header;                       // identity; codec/lengths/offset once on G3
    std::vector<uint32_t> slots;               // G2 copy (raw bytes), if any
    std::shared_ptr<const std::string> spill;  // raw bytes on their way to G3, if any
    uint64_t segment = 0;                      // G3 segment number; 0: not on G3
    uint64_t lru_tick = 0;                     // key of g2_lru_ while in G2
    absl::Time last_use;
    int32_t pins = 0;                          // readers copying from it, prefetch handles, a demotion filling it
    uint8_t counted = 0;                       // the Tally bits it adds now (RecountLocked)
    int64_t counted_spill_bytes = 0;           // its spill's size while counted as a pending spill
  };
  // Stats()'s gauges over entries_, kept as entries change so that a scrape never scans the index
  // (nor the engine's): RecountLocked(e) after any change of an entry's header, slots, spill or
  // segment; UncountLocked(e) before it is erased. Keyed by e.header.key (equal to its map key).
  // With a disk tier, g1_keys_ mirrors the device index from its events (OnCacheEvent), so
  // pending_snapshot_records counts G1 blocks without a copy on G3 without a scan (the mirror costs
  // a hash-set update per stored or removed block, after the engine's lock); without one, every G1
  // block is pending and the engine's count (TierPort::cached_blocks) is used, with no listener.
  struct Tally {
    int64_t disk_records = 0, objects = 0, spill_records = 0, spill_bytes = 0, snapshot_records = 0;
    int64_t g1_on_disk = 0;  // keys in g1_keys_ whose entry is counted as on G3
  };
  enum TallyBit : uint8_t { kOnDisk = 1, kObject = 2, kSpill = 4, kSnapshot = 8 };
  // Bytes to read somewhere below G1 (an entry a demotion is still filling has none yet).
  static bool HasBytes(const Entry& e) { return !e.slots.empty() || e.spill != nullptr || e.segment != 0; }
  struct Segment {
    int64_t file_bytes = 0;
    int64_t records = 0;      // live records
    uint64_t last_use = 0;    // most recent use of any of its records (tick)
    bool unreadable = false;  // could not be read at Load: kept, never served or evicted
  };
  struct Prefetched {
    WorkerId owner;
    std::vector<BlockKey> keys;
  };
  // What a promotion or prefetch reads: a pinned entry's bytes, wherever they are.
  struct ReadSource {
    BlockKey key;
    RecordHeader header;
    const uint8_t* slot_bytes = nullptr;  // contiguous G2 copy (blocks take one slot)
    std::shared_ptr<const std::string> spill;
    uint64_t segment = 0;  // the G3 segment read from, when neither of the above
    std::string segment_path;
  };

  TierStore(TierOptions options, const DeviceArena* arena, TierPort* cache);

  // tier_store.cc: index and memory.
  Entry* FindBlockLocked(const BlockKey& key, const BlockKey& parent, bool has_parent,
                         absl::Span<const Token> tokens) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Room for `n` G2 slots, demoting unpinned least-recently-used entries (to a spill when they
  // are not on G3). nullopt when not even that frees enough.
  std::optional<std::vector<uint32_t>> AllocateSlotsLocked(int64_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropSlotsLocked(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TouchLocked(const BlockKey& key, Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues raw bytes for G3. False (and the bytes are dropped) without a disk or past the cap.
  bool SpillLocked(const BlockKey& key, Entry& e, std::shared_ptr<const std::string> raw)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseIfEmptyLocked(const BlockKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void RecountLocked(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);  // tier_store_tally.cc: Tally
  void UncountLocked(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);  // both: CountAsLocked(TallyBits)
  void CountAsLocked(Entry& e, uint8_t now, int64_t spill_bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The engine's index events (its listener): maintains g1_keys_.
  void OnCacheEvent(const CacheEvent& e) ABSL_LOCKS_EXCLUDED(mu_);
  // Tells the engine about checkpoint copies G3 lost (lost_checkpoints_), outside mu_.
  void ReportLostCheckpoints() ABSL_LOCKS_EXCLUDED(mu_);
  void ForgetPrefetchLocked(const WorkerId& owner) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ReadSource PinForReadLocked(const BlockKey& key, Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnpinLocked(const BlockKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The raw bytes of a pinned source into `out` (raw_length bytes). DATA_LOSS: the G3 copy failed
  // its checksum (the caller drops it).
  absl::Status ReadRaw(const ReadSource& src, uint8_t* out) ABSL_LOCKS_EXCLUDED(mu_);
  // After a failed read of `src`: DATA_LOSS drops and tombstones the copy that was read (counted
  // as a checksum failure); any other error only counts a read error (the record is kept).
  void OnReadFailure(const ReadSource& src, const absl::Status& s) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<PoolId> PoolOf(const std::string& name) const;
  // The G3 header of a device block (identity, raw length, layout tag; no location yet); a hybrid
  // pool's is a kUnit naming the view's parts.
  RecordHeader BlockHeader(const CachedBlockView& v) const;
  // tier_store_units.cc. A kUnit's bytes: its spine block's, then each part's (all shards each);
  // -1 for a part no unit of the pool may have (the spine's group, a group twice, a tail on an
  // attention group, a group out of range).
  int64_t UnitRawLength(PoolId pool, absl::Span<const UnitRecordPart> parts) const;
  // A device block's record bytes (a hybrid unit: the spine block, then its parts), raw_length long.
  absl::Status ReadFromDevice(const CachedBlockView& v, uint8_t* out) const;
  // A unit's record bytes into its installed blocks: `spine`, then each of `parts` in order.
  absl::Status WriteUnitToDevice(PoolId pool, BlockIndex spine, absl::Span<const UnitComponent> parts,
                                 const uint8_t* raw) const;
  // The run of unit records past G1's first `first` spine nodes of `prompt`'s chain (`keys`, up
  // to max_blocks) that InstallUnits and PeekUnits read: it stops at the first missing, damaged or
  // foreign record. Pins nothing. A run to install then ends at its deepest unit for which
  // EndsAtEveryState holds (a checkpoint of every state group, or a pool without one).
  std::vector<std::pair<BlockKey, Entry*>> UnitRunLocked(PoolId pool, absl::Span<const Token> prompt,
                                                         absl::Span<const BlockKey> keys, int64_t first,
                                                         int64_t max_blocks) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool EndsAtEveryState(PoolId pool, const RecordHeader& h) const;

  // tier_store_remote.cc: G4.
  // Queues a block the cache just stored in G1 for upload (the cache's event listener).
  void QueueUpload(const CacheEvent& e) ABSL_LOCKS_EXCLUDED(upload_mu_);
  void UploadQueued() ABSL_LOCKS_EXCLUDED(upload_mu_);  // uploader thread
  // Copies the run of blocks keys[from..from+targets.size()) that G4 holds into `targets`,
  // verifying each record against the prompt; returns how many were written. Reader thread.
  int64_t FetchRemote(PoolId pool, const Namespace& ns, absl::Span<const Token> prompt,
                      absl::Span<const BlockKey> keys, int64_t from, absl::Span<const BlockIndex> targets);
  // A hybrid unit leaving G1 (OnEvict): its record bytes are copied now and queued for upload.
  void QueueUnitUpload(const CachedBlockView& v, const RecordHeader& header) ABSL_LOCKS_EXCLUDED(upload_mu_);
  // What identifies cached block `v`'s value in G4 (a block's; a unit's caller adds kind and parts).
  RemoteBlockIdentity RemoteIdentityOf(const CachedBlockView& v, int64_t raw_length) const;
  // The headers of the run of units G4 holds for keys[from..to) (one round trip reading each
  // value's head), ending at the first absent or foreign one. Reader thread.
  std::vector<RecordHeader> PeekRemoteUnits(PoolId pool, const Namespace& ns, absl::Span<const BlockKey> keys,
                                            int64_t from, int64_t to);
  // Fetches, verifies and writes units heads[i] (keys[from + i]) into install's unit at + i, in
  // order, stopping at the first that fails; returns how many were written. Reader thread.
  int64_t FetchRemoteUnits(PoolId pool, const Namespace& ns, absl::Span<const Token> prompt,
                           absl::Span<const BlockKey> keys, int64_t from, absl::Span<const RecordHeader> heads,
                           const TierPort::UnitInstall& install, size_t at);

  // tier_store_disk.cc: G3.
  void ScheduleSpillWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WriteSpills() ABSL_LOCKS_EXCLUDED(mu_);  // writer thread
  // Encodes and writes one segment of `records` (header + raw bytes each); on success marks each
  // entry as on G3 in that segment and rewrites the manifest. Writer thread only.
  absl::Status WriteSegmentOf(std::vector<RecordHeader> headers,
                              std::vector<std::shared_ptr<const std::string>> raws,
                              int64_t* stored_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  FlushResult FlushNow() ABSL_LOCKS_EXCLUDED(mu_);  // writer thread
  // Flush's last step: every checkpoint not yet on G3 as it is now; stored ones that ended are
  // deleted. Adds to `result`.
  void FlushCheckpoints(FlushResult* result) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets a record's G3 copy: tombstoned in the manifest (written with the next one) so a restart
  // does not bring it back. Used for deletes, corrupt records and rewritten checkpoints.
  void TombstoneLocked(const BlockKey& key, Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes room on G3 for `bytes` by dropping least-recently-used segments (in memory; files are
  // unlinked after the next manifest write). Returns the numbers dropped.
  std::vector<uint64_t> EvictSegmentsLocked(int64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WriteManifestNow(const std::vector<uint64_t>& unlink_after) ABSL_LOCKS_EXCLUDED(mu_);
  // Moves a damaged file of the disk directory into its quarantine/ folder.
  absl::Status Quarantine(const std::string& name) const;
  // Whether a reloaded record may be indexed: its pool and layout match, and every length that
  // will size an allocation is within what its kind allows.
  absl::Status CheckLoadedLocked(const RecordHeader& h) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const TierOptions options_;
  FileSystem* const fs_;  // options_.file_system or the real one
  const DeviceArena* const arena_;
  TierPort* const cache_;  // the engine, as a tier sees it
  const std::vector<PoolGeometry> pools_;
  std::vector<uint64_t> layout_tags_;   // per pool
  std::vector<int> spine_groups_;       // per pool: its first full group (a hybrid pool's spine), or -1
  std::atomic<bool> idle_demotion_{true};
  std::function<void()> flush_hook_for_testing_;
  std::function<void()> demotion_hook_for_testing_;

  mutable absl::Mutex mu_;
  std::unique_ptr<HostTier> host_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<BlockKey, Entry> entries_ ABSL_GUARDED_BY(mu_);
  absl::btree_map<uint64_t, BlockKey> g2_lru_ ABSL_GUARDED_BY(mu_);  // tick -> entry in G2
  uint64_t tick_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<BlockKey> spill_queue_ ABSL_GUARDED_BY(mu_);
  int64_t spill_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool spill_write_scheduled_ ABSL_GUARDED_BY(mu_) = false;
  absl::btree_map<uint64_t, Segment> segments_ ABSL_GUARDED_BY(mu_);
  int64_t disk_used_ ABSL_GUARDED_BY(mu_) = 0;
  Manifest manifest_ ABSL_GUARDED_BY(mu_);  // next_segment and tombstones; segments from segments_
  bool manifest_dirty_ ABSL_GUARDED_BY(mu_) = false;  // tombstones not yet in the file
  absl::flat_hash_map<uint64_t, Prefetched> prefetches_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<WorkerId, int64_t> prefetches_of_ ABSL_GUARDED_BY(mu_);  // handles per owner
  uint64_t next_prefetch_ ABSL_GUARDED_BY(mu_) = 1;
  TierStats stats_ ABSL_GUARDED_BY(mu_);  // counters; gauges are filled by Stats()
  Tally tally_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<BlockKey> g1_keys_ ABSL_GUARDED_BY(mu_);
  std::vector<RequestId> lost_checkpoints_ ABSL_GUARDED_BY(mu_);  // G3 copies dropped, to report
  int cache_listener_ = -1;  // OnCacheEvent's handle

  std::unique_ptr<RemoteTier> remote_;  // G4, or null
  int upload_listener_ = -1;
  absl::Mutex upload_mu_ ABSL_ACQUIRED_AFTER(mu_);
  struct Upload {
    CachedBlockRef ref;
    std::string name;  // its Redis key
    // A hybrid unit: its record bytes, copied as it left G1, and what identifies it.
    std::shared_ptr<const std::string> unit_raw;
    RemoteBlockIdentity unit;
  };
  std::vector<Upload> upload_queue_ ABSL_GUARDED_BY(upload_mu_);
  int64_t upload_unit_bytes_ ABSL_GUARDED_BY(upload_mu_) = 0;  // of the units queued
  void UploadUnits(std::vector<Upload> batch);  // uploader thread (tier_store_remote.cc)
  bool upload_scheduled_ ABSL_GUARDED_BY(upload_mu_) = false;

  // Declared last: destroyed first, finishing queued work while everything above still lives.
  std::unique_ptr<Executor> readers_;
  std::unique_ptr<Executor> writer_;
  std::unique_ptr<Executor> uploader_;  // G4 uploads
};

}  // namespace kvd
