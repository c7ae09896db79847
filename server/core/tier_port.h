// TierPort: the engine as the lower tiers (server/store) see it — the few things a tier may ask of
// KvCache, and nothing else. KvCache implements it; the store holds a TierPort*, never the
// engine's header, so the store cannot reach into the engine's state, and the engine reaches the
// store only through EvictionSink (eviction_sink.h). Contracts are KvCache's (kv_cache.h).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/vocab/cache_event.h"
#include "proto/vocab/cache_types.h"
#include "proto/vocab/pool_geometry.h"
#include "server/core/clock.h"
#include "server/core/eviction_sink.h"

namespace kvd {

class TierPort {
 public:
  using EventListener = std::function<void(const CacheEvent&)>;
  virtual ~TierPort() = default;

  virtual const Clock* clock() const = 0;
  virtual const std::vector<PoolGeometry>& pools() const = 0;
  virtual int64_t max_engine_state_bytes() const = 0;

  // Promotion into a request's writable blocks: hold them, then publish what was written.
  virtual absl::Status PinBlocks(const RequestId& id, absl::Span<const BlockIndex> blocks) = 0;
  virtual void UnpinBlocks(PoolId pool, absl::Span<const BlockIndex> blocks) = 0;
  virtual absl::Status AdoptPromoted(const RequestId& id, int64_t new_cached_tokens) = 0;

  // Flush and upload: what is cached, and copies of it made without the engine's lock.
  virtual std::vector<CachedBlockRef> SnapshotCached() const = 0;
  virtual int64_t VisitCached(absl::Span<const CachedBlockRef> refs,
                              const std::function<void(const CachedBlockView&)>& fn) = 0;
  virtual std::vector<CheckpointSnapshot> SnapshotCheckpoints(bool pin) = 0;

  // Warm restart: checkpoints and events from what the disk holds.
  virtual absl::StatusOr<std::vector<BlockIndex>> RestoreCheckpoint(const RequestId& id, const Namespace& ns,
                                                                    std::vector<Token> tokens,
                                                                    std::string engine_state) = 0;
  virtual void EmitExternal(const std::vector<CacheEvent>& events) = 0;

  // The index's events (write-through uploads).
  virtual int AddEventListener(EventListener fn) = 0;
  virtual void RemoveListenerAndWait(int handle) = 0;
};

}  // namespace kvd
