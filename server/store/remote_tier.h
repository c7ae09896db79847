// RemoteTier is G4: prefix blocks kept in Redis (or Valkey, same protocol) through hiredis, shared
// by every daemon pointed at the same server, so that one node reuses what another published and a
// node with an empty disk starts warm.
//
// Keys: "<key_prefix>:<pool>:<salt tag>:<chained block key, 32 hex>", the salt tag being "-" or 16
// hex digits of XXH3 of the tenant's cache_salt (the salt itself never leaves the node), so an
// operator can list or drop one model's or one tenant's blocks by pattern; a hybrid pool's units
// name its layout tag after the pool (KeyName). Values (remote_value.h):
// a G3 record header (pool, key, parent key, codec, lengths, checksum, layout tag, and instead of
// the adapter, media, method, salt and tokens a ValueDigest of them, keyed by the cluster's secret)
// followed by the stored bytes, the header authenticated with the payload (an HMAC under the
// secret, or the AEAD of the encryption key); a reader verifies all of it against its own request,
// so a collision, a corrupt or forged value or one sealed under another secret is a miss, never
// served. With an encryption key file the stored bytes are AES-256-GCM ciphertext (value_cipher.h)
// and unencrypted values are refused. Every value carries a TTL; storing a block that is already
// there only refreshes its TTL (no bytes sent).
//
// Never stalls a request: every call has connect and I/O timeouts; after a failure the tier is
// skipped (calls return UNAVAILABLE at once, counted) for `retry_after`, then tried again.
// Thread-safe: each call takes connections from small per-node pools.
//
// Redis Cluster (redis-cluster://[user:password@]host:port,host:port,...: seed nodes): every key
// goes to the master serving its hash slot (redis_cluster.h; the slot map is read with CLUSTER
// SLOTS from any node that answers, and again after a MOVED or a failed node). A call's commands
// are pipelined per node — one round trip to each master involved, all in flight together — and
// each key's replies are handled in key order. A MOVED reply is followed at once to the node it
// names (and the map refreshed); an ASK (a slot being migrated) is followed with ASKING, for that
// key only. A master that dies fails the call (the back-off, as for a single server) until its
// replica is promoted and the map names it.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "server/store/redis_cluster.h"
#include "server/store/remote_value.h"
#include "server/store/value_cipher.h"
#include "proto/vocab/block_key.h"
#include "server/store/tier_types.h"

struct redisContext;
struct redisReply;

namespace kvd {

// `url` with the password of a redis://user:password@host URL replaced by "***" (any other URL
// as it is): the only form of a Redis URL kvd prints or logs.
std::string RedactUrl(absl::string_view url);

class RemoteTier {
 public:
  // Parses the URL (INVALID_ARGUMENT naming what is wrong); connects lazily, so a server that is
  // down at start-up only makes the tier unavailable until it is back. URLs:
  // redis://[[user]:password@]host:port[/db], unix:///path, redis-cluster://[[user]:password@]host:port[,host:port...].
  // The password comes from options.password_file, else $KVD_REDIS_PASSWORD, else the URL; no
  // error message names it.
  static absl::StatusOr<std::unique_ptr<RemoteTier>> Open(RemoteTierOptions options);
  ~RemoteTier();

  // The Redis key of a block: "{prefix}:{pool}:{salt}:{key}", salt "-" or 16 hex digits of the
  // cache salt's hash. A pool with a model fingerprint has "{pool}@{16 hex digits of its hash}"
  // (pool names hold no '@'), so that nodes serving other weights never meet on a key, not even to
  // renew each other's TTLs.
  // A hybrid pool's unit (docs/hybrid.md §2.9) passes its pool's LayoutTag as `unit_layout`:
  // "{pool}[@{model}]@u{16 hex digits of the tag}", so that pools grouped otherwise (another
  // window, other layers, another model) never share a key; 0 for a block.
  std::string KeyName(const Namespace& ns, absl::string_view model_fingerprint, const BlockKey& key,
                      uint64_t unit_layout = 0) const;
  // What a value carries instead of the namespace and tokens in clear: 64 hex digits of
  // HMAC-SHA256(secret, root key | key | parent key or 16 zero bytes | tokens, little-endian u32).
  std::string ValueDigest(const BlockKey& root_key, const BlockKey& key, const BlockKey* parent,
                          absl::Span<const Token> tokens) const;
  // The cipher of options.encryption_key_file, or nullptr when values are stored unencrypted.
  const ValueCipher* cipher() const { return cipher_.get(); }
  // What seals and opens values (remote_value.h): the secret and the cipher.
  RemoteValueKeys value_keys() const { return RemoteValueKeys{.secret = secret_, .cipher = cipher_.get()}; }

  // How many of `keys`, from the first, exist: one pipelined round trip of EXISTS.
  absl::StatusOr<int64_t> RunLength(const std::vector<std::string>& keys) ABSL_LOCKS_EXCLUDED(mu_);
  // Pipelined GETs of `keys` (each with a PEXPIRE that renews the TTL of what is reused), handing
  // each value to consume(i, bytes) as it arrives — bytes is nullptr for a key that vanished
  // meanwhile — and freeing it right after: no copy, and one value's memory at a time (holding
  // several fresh 2 MiB buffers costs a page fault per 4 KiB). consume returns false to stop.
  absl::Status Fetch(const std::vector<std::string>& keys,
                     const std::function<bool(size_t i, const absl::string_view* bytes)>& consume)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The first `head_bytes` bytes of each key's value, "" for a key absent: one pipelined round
  // trip of GETRANGE, each with a PEXPIRE renewing the TTL of what is there. Units (whose parts a
  // reader must know before it allocates) are looked up this way, and an upload reads what is
  // stored before it replaces it. A `lookup` counts as one, the present run from the first as its
  // hit blocks (an upload counts what it leaves in place: CountRefreshed).
  absl::StatusOr<std::vector<std::string>> Heads(const std::vector<std::string>& keys, int64_t head_bytes,
                                                 bool lookup) ABSL_LOCKS_EXCLUDED(mu_);
  // Renews the TTL of each key present (one round trip of PEXPIRE); true for those present, which
  // need no upload.
  absl::StatusOr<std::vector<bool>> Refresh(const std::vector<std::string>& keys) ABSL_LOCKS_EXCLUDED(mu_);
  // Stores each (key, value) with the TTL (pipelined SET PX). Values Redis refuses for want of
  // memory (an OOM reply: maxmemory reached under `noeviction`) are counted apart and skipped —
  // RESOURCE_EXHAUSTED, without the back-off, so lookups and fetches go on; any other failure
  // starts the back-off (UNAVAILABLE).
  absl::Status Store(const std::vector<std::pair<std::string, std::string>>& items) ABSL_LOCKS_EXCLUDED(mu_);

  // False during a failure back-off (callers skip the tier without a round trip).
  bool available() const;
  void CountCorrupt() ABSL_LOCKS_EXCLUDED(mu_);
  void CountUploadDropped(uint64_t n) ABSL_LOCKS_EXCLUDED(mu_);
  void CountRefreshed(uint64_t n) ABSL_LOCKS_EXCLUDED(mu_);
  RemoteStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);
  const RemoteTierOptions& options() const { return options_; }
  // The URL with any password masked, for logs and reports.
  std::string display_url() const;

 private:
  class Connection;  // RAII hiredis context
  struct ReplyDeleter {
    void operator()(redisReply* r) const;
  };
  using Reply = std::unique_ptr<redisReply, ReplyDeleter>;
  // Appends command `command` (0-based, of the call's per-key commands) of key `key` to `c`.
  using AppendFn = std::function<void(Connection& c, size_t key, int command)>;
  // Handles key `key`'s replies (in key order); a non-OK status fails the call.
  using DoneFn = std::function<absl::Status(size_t key, std::vector<Reply>& replies)>;

  explicit RemoteTier(RemoteTierOptions options);

  // Counts a call; UNAVAILABLE (counted as skipped) during a back-off.
  absl::Status Begin() ABSL_LOCKS_EXCLUDED(mu_);
  // A new connected, authenticated connection to `node` (nullptr: the single server of a
  // redis:// or unix:// URL); no back-off on failure (the caller decides).
  absl::StatusOr<std::unique_ptr<Connection>> Connect(const RedisEndpoint* node) ABSL_LOCKS_EXCLUDED(mu_);
  // A pooled connection to `node`, or a new one; a failure to connect starts the back-off.
  absl::StatusOr<std::unique_ptr<Connection>> Take(const RedisEndpoint* node) ABSL_LOCKS_EXCLUDED(mu_);
  void Return(const RedisEndpoint* node, std::unique_ptr<Connection> c) ABSL_LOCKS_EXCLUDED(mu_);
  // Records a failure and starts the back-off; returns UNAVAILABLE with `what`.
  absl::Status Fail(const std::string& what) ABSL_LOCKS_EXCLUDED(mu_);
  // The cluster's slot map, read again (CLUSTER SLOTS from the known masters, then the seeds)
  // when none is held or it went stale; UNAVAILABLE when no node answers.
  absl::StatusOr<std::shared_ptr<const RedisSlotMap>> Slots() ABSL_LOCKS_EXCLUDED(mu_);
  // Runs `per_key` commands for each of `keys` — pipelined per node — and hands each key's
  // replies to `done` in key order, following MOVED and ASK for a key on the spot. I/O failures
  // and errors `done` returns fail the call (the back-off).
  absl::Status Exchange(const std::vector<std::string>& keys, int per_key, const AppendFn& append,
                        const DoneFn& done) ABSL_LOCKS_EXCLUDED(mu_);
  // Re-sends key `key`'s commands where the MOVED or ASK in replies[0] points (a few hops at most);
  // leaves `replies` as they are when replies[0] is no redirection.
  absl::Status FollowRedirect(size_t key, int per_key, const AppendFn& append, std::vector<Reply>& replies)
      ABSL_LOCKS_EXCLUDED(mu_);
  // On a new connection: reads maxmemory and maxmemory-policy (CONFIG GET) into the stats and
  // warns once when Redis will refuse writes when full instead of evicting (noeviction) or has no
  // memory bound. A server that does not allow CONFIG is left unchecked (logged at debug).
  void CheckMemoryPolicy(Connection& c) ABSL_LOCKS_EXCLUDED(mu_);

  const RemoteTierOptions options_;
  std::string host_, unix_path_, username_, password_;
  std::string secret_;  // tiers.redis_secret_file's first line; never logged
  std::unique_ptr<ValueCipher> cipher_;
  int port_ = 6379;
  int db_ = 0;
  bool cluster_ = false;
  std::vector<RedisEndpoint> seeds_;  // redis-cluster:// nodes to read the slot map from
  std::atomic<int64_t> down_until_ns_{0};

  mutable absl::Mutex mu_;
  // Idle connections by node name ("" for the single server).
  absl::flat_hash_map<std::string, std::vector<std::unique_ptr<Connection>>> idle_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const RedisSlotMap> slots_ ABSL_GUARDED_BY(mu_);
  bool slots_stale_ ABSL_GUARDED_BY(mu_) = true;
  RemoteStats stats_ ABSL_GUARDED_BY(mu_);
  bool warned_policy_ ABSL_GUARDED_BY(mu_) = false;
  bool warned_oom_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvd
