// Options of the lower tiers (G2 host RAM, G3 local disk, G4 Redis). Plain structs. What the tiers
// report (flush results, statistics, prefetch handles, saved prefixes) is vocabulary every layer
// reads: proto/vocab/tier_results.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "server/core/clock.h"
#include "proto/vocab/tier_results.h"
#include "proto/vocab/block_key.h"
#include "proto/vocab/cache_types.h"
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
  // A file whose first line is the cluster's secret (the same on every node): values carry an
  // HMAC-SHA256 under it of what identifies the block (namespace root key — pool, adapter, media,
  // method, salt — key, parent key, tokens) instead of those in clear. Empty: the digest is
  // unkeyed SHA-256, which still shows nothing in clear but lets a reader of Redis confirm a
  // guessed prompt. Never logged.
  std::string secret_file;
  // Key file for AES-256-GCM encryption of the stored bytes (value_cipher.h: "<id> <64 hex>" per
  // line; the first seals, all open). Empty: values are stored unencrypted.
  std::string encryption_key_file;
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

}  // namespace kvd
