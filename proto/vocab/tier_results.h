// What the lower tiers report, in the vocabulary every layer reads (the service converts them, the
// client and kvdctl show them): flush results, statistics, prefetch handles, saved prefixes.
// Plain structs; the tiers themselves are server/store.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "proto/vocab/cache_types.h"

namespace kvd {

struct RemoteStats {
  bool available = false;          // not in a failure back-off
  bool failing = false;            // the last call that reached for Redis failed (still true
                                   // between back-offs, while `available` reads true)
  uint64_t calls = 0;              // uses of the tier attempted (lookups, fetches, uploads, ...)
  uint64_t lookups = 0;            // prefix lookups sent (one round trip each)
  uint64_t hit_blocks = 0;         // blocks found by lookups
  uint64_t fetched_blocks = 0, fetched_bytes = 0;    // values read (bytes as stored)
  uint64_t uploaded_blocks = 0, uploaded_bytes = 0;  // values written
  uint64_t refreshed_blocks = 0;   // already present: TTL refreshed, nothing sent
  uint64_t upload_dropped = 0;     // not uploaded: queue full, tier down, or block gone
  uint64_t skipped = 0;            // calls skipped during a back-off
  uint64_t errors = 0;             // failed calls (connect, timeout, protocol)
  uint64_t corrupt = 0;            // values that failed verification (not served)
  uint64_t oom_refusals = 0;       // values Redis refused with OOM (full, noeviction): skipped
  std::string eviction_policy;     // Redis's maxmemory-policy, when CONFIG GET answered
  int64_t maxmemory = -1;          // Redis's maxmemory in bytes (0: unbounded; -1: unknown)
  bool cluster = false;            // a Redis Cluster (redis-cluster:// URL)
  int64_t cluster_masters = 0;     // masters in the slot map last read
  uint64_t moved = 0, asked = 0;   // MOVED and ASK redirections followed
  uint64_t slot_refreshes = 0;     // slot maps read (CLUSTER SLOTS)
  std::string last_error;
};

struct FlushResult {
  bool durable = false;          // every cached prefix is on G3 now
  int64_t written_blocks = 0;    // records written by this flush
  int64_t written_bytes = 0;     // bytes stored (after the codec)
  int64_t already_durable = 0;   // records that were on G3 before
  int64_t failed_blocks = 0;     // records that could not be written
  std::string error;             // the first failure, when !durable
  double seconds = 0;
};

inline constexpr int kNumTiers = 3;  // index: 0 G1 device, 1 G2 host, 2 G3 disk
inline std::string TierName(int tier) {
  return tier == 0 ? "device" : tier == 1 ? "host" : tier == 2 ? "disk" : "unknown";
}

struct TierStats {
  // Gauges.
  int64_t host_capacity_bytes = 0, host_used_bytes = 0, host_records = 0;
  int64_t disk_capacity_bytes = 0, disk_used_bytes = 0, disk_records = 0, disk_segments = 0;
  int64_t objects = 0;
  int64_t pending_spill_records = 0, pending_spill_bytes = 0;  // demoted, not yet on G3
  int64_t pending_snapshot_records = 0;  // cached in G1 or G2 but not on G3 (what Flush would write)
  int64_t prefetch_handles = 0;
  bool idle_demotion = false;
  // Counters.
  uint64_t demotions[kNumEvictReasons + 1][kNumTiers] = {};  // [reason, idle = last][to tier]
  uint64_t promotions[kNumTiers] = {};   // blocks promoted to G1, by the tier they came from
  uint64_t promoted_tokens = 0;
  uint64_t remote_promotions = 0;        // blocks promoted to G1 from G4 (Redis)
  uint64_t dropped = 0;                  // records dropped for lack of room in every tier
  uint64_t checksum_failures = 0;        // G3 records that failed verification (never served)
  uint64_t read_errors = 0;              // G3 reads that failed without proof of damage (kept)
  uint64_t quarantined_segments = 0;     // G3 segments moved to quarantine/ by the last Load
  uint64_t incompatible = 0;             // G3 records whose pool layout no longer matches
  uint64_t write_failures = 0;           // G3 segment writes that failed
  uint64_t raw_bytes_written = 0, stored_bytes_written = 0;  // compression ratio = raw / stored
  uint64_t flushes = 0, flush_failures = 0;
  double last_flush_seconds = 0;
  bool last_flush_durable = true;
  int64_t pending_checkpoints = 0;       // checkpoints not on G3 as they are now
  int64_t restored_checkpoints = 0;      // by the last Load
  int64_t reloaded_records = 0;          // by the last Load (warm restart)
  double load_seconds = 0;
  bool remote_enabled = false;
  std::string remote_url;                // G4's URL without any password
  RemoteStats remote;                    // G4, when enabled
};

struct PrefetchInfo {
  uint64_t handle = 0;
  int64_t found_blocks = 0;    // blocks of the prompt held below G1
  int64_t loading_blocks = 0;  // of those, being read up from G3
};

struct SavedPrefix {
  Namespace ns;
  std::vector<Token> tokens;
};

}  // namespace kvd
