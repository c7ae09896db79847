// Options and values of the lower tiers (G2 host RAM, G3 local disk): configuration, flush
// results, statistics, prefetch handles and saved prefixes. Plain structs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "server/core/block_key.h"
#include "server/core/cache_types.h"
#include "server/store/codec.h"

namespace kvd {

struct TierOptions {
  // G2: bytes of host RAM for demoted blocks and objects. 0 disables G2.
  int64_t host_bytes = 0;
  // G3: directory of segment files and the manifest. Empty disables G3 (and Flush).
  std::string disk_dir;
  // G3 byte budget: least-recently-used segments are deleted past it. Default 16 GiB.
  int64_t disk_bytes = int64_t{16} << 30;
  // Codec for new G3 records; old records keep theirs.
  Codec codec = Codec::kNone;
  // Target size of one segment file. Default 64 MiB.
  int64_t segment_bytes = int64_t{64} << 20;
  // Blocks unused this long move down a tier (G1 -> G2 -> G3). Zero disables idle demotion.
  absl::Duration idle_demote_after = absl::ZeroDuration();
  // Reader threads (promotion, prefetch, object gets from disk).
  int read_threads = 2;
  // SIGTERM drain flushes to G3 before exit (when G3 is configured).
  bool flush_on_drain = true;

  bool enabled() const { return host_bytes > 0 || !disk_dir.empty(); }
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
  uint64_t dropped = 0;                  // records dropped for lack of room in every tier
  uint64_t checksum_failures = 0;        // G3 records that failed verification (never served)
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
