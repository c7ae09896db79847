// Options and values of the lower tiers (G2 host RAM, G3 local disk): configuration, flush
// results, statistics, prefetch handles and saved prefixes. Plain structs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "server/core/clock.h"
#include "server/core/block_key.h"
#include "server/core/cache_types.h"
#include "server/store/codec.h"

namespace kvd {

class FileSystem;

// G4: a Redis or Valkey server shared by daemons (remote_tier.h).
struct RemoteTierOptions {
  // redis://[[user]:password@]host:port[/db] or unix:///path/to/redis.sock. Empty disables G4.
  // A password in the URL is visible in /proc/<pid>/cmdline when passed as --redis-url: prefer
  // password_file or $KVD_REDIS_PASSWORD (which override it). Every URL kvd prints or logs has
  // its password masked (RedactUrl).
  std::string url;
  // A file holding the password (its first line). Read at start-up.
  std::string password_file;
  std::string key_prefix = "kvd";
  // Lifetime of a stored block, refreshed whenever a daemon stores or reuses it. Default 1 day.
  absl::Duration ttl = absl::Hours(24);
  absl::Duration connect_timeout = absl::Milliseconds(200);
  // Bound on each read or write on a connection.
  absl::Duration io_timeout = absl::Milliseconds(500);
  // After a failure, how long the tier is skipped.
  absl::Duration retry_after = absl::Seconds(1);
  // Upload every block published to the device pool (else G4 only serves what others uploaded).
  bool write_through = true;
  // Most blocks waiting for upload; more are dropped (counted).
  int64_t max_pending_uploads = 4096;
  // Time for the back-off (borrowed; null: SystemClock). Tests step a FakeClock.
  const Clock* clock = nullptr;

  bool enabled() const { return !url.empty(); }
};

struct RemoteStats {
  bool available = false;          // not in a failure back-off
  uint64_t lookups = 0;            // prefix lookups sent (one round trip each)
  uint64_t hit_blocks = 0;         // blocks found by lookups
  uint64_t fetched_blocks = 0, fetched_bytes = 0;    // values read (bytes as stored)
  uint64_t uploaded_blocks = 0, uploaded_bytes = 0;  // values written
  uint64_t refreshed_blocks = 0;   // already present: TTL refreshed, nothing sent
  uint64_t upload_dropped = 0;     // not uploaded: queue full, tier down, or block gone
  uint64_t skipped = 0;            // calls skipped during a back-off
  uint64_t errors = 0;             // failed calls (connect, timeout, protocol)
  uint64_t corrupt = 0;            // values that failed verification (not served)
  std::string last_error;
};

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
  // Prefetch handles one worker may hold at once (each pins blocks in G2). Default 1024.
  int64_t max_prefetch_handles_per_worker = 1024;
  // SIGTERM drain flushes to G3 before exit (when G3 is configured).
  bool flush_on_drain = true;

  // G4 (off unless remote.url is set).
  RemoteTierOptions remote;
  // The disk tier's system calls (borrowed; null: FileSystem::Default()). Tests inject failures.
  FileSystem* file_system = nullptr;

  bool enabled() const { return host_bytes > 0 || !disk_dir.empty() || remote.enabled(); }
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
