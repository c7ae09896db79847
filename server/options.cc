#include "server/options.h"

#include <grp.h>

#include <limits>
#include <map>

#include <yaml-cpp/yaml.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "proto/vocab/status_macros.h"
#include "proto/vocab/default_paths.h"
#include "server/config_values.h"
#include "server/store/remote_tier.h"

namespace kvd {
namespace {

template <typename T>
absl::Status Read(const YAML::Node& node, const char* key, T* out, const std::string& where) {
  const YAML::Node v = node[key];
  if (!v) return absl::OkStatus();
  try {
    *out = v.as<T>();
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": key '", key, "': ", e.what()));
  }
  return absl::OkStatus();
}

// A scalar's text, for the parsers of config_values.h. False when `key` is absent.
absl::StatusOr<bool> ReadText(const YAML::Node& node, const char* key, std::string* out, const std::string& where) {
  const YAML::Node v = node[key];
  if (!v) return false;
  if (!v.IsScalar()) return absl::InvalidArgumentError(absl::StrCat(where, ": ", key, ": expected a single value"));
  *out = v.as<std::string>();
  return true;
}

absl::Status Prefixed(const std::string& where, const absl::Status& s) {
  return s.ok() ? s : absl::InvalidArgumentError(absl::StrCat(where, ": ", s.message()));
}

// Durations: seconds as a number, or with units (config_values.h).
absl::Status ReadSeconds(const YAML::Node& node, const char* key, absl::Duration* out,
                         const std::string& where) {
  std::string text;
  KVD_ASSIGN_OR_RETURN(bool present, ReadText(node, key, &text, where));
  if (!present) return absl::OkStatus();
  absl::StatusOr<absl::Duration> d = ParseDurationValue(key, text);
  if (!d.ok()) return Prefixed(where, d.status());
  *out = *d;
  return absl::OkStatus();
}

// Sizes in bytes: a whole number, or with a unit (config_values.h).
absl::Status ReadSize(const YAML::Node& node, const char* key, int64_t* out, const std::string& where) {
  std::string text;
  KVD_ASSIGN_OR_RETURN(bool present, ReadText(node, key, &text, where));
  if (!present) return absl::OkStatus();
  absl::StatusOr<int64_t> bytes = ParseSize(key, text);
  if (!bytes.ok()) return Prefixed(where, bytes.status());
  *out = *bytes;
  return absl::OkStatus();
}

absl::Status CheckKeys(const YAML::Node& node, const std::string& where,
                       std::initializer_list<const char*> known);

// One entry of a pool's `groups` (docs/hybrid.md §2.1). `where` ends in "groups[j]": errors read
// "...pools[i].groups[j].<field>: value, what is allowed".
absl::Status ReadGroup(const YAML::Node& node, const std::string& where, KvGroup* k) {
  KVD_RETURN_IF_ERROR(CheckKeys(node, where,
                                {"name", "kind", "layers", "bytes_per_token", "bytes_per_state", "window", "chunk",
                                 "checkpoint_every_blocks", "checkpoint_at_end", "capacity_blocks", "capacity_slots"}));
  KVD_RETURN_IF_ERROR(Read(node, "name", &k->name, where));
  std::string kind;
  KVD_RETURN_IF_ERROR(Read(node, "kind", &kind, where));
  if (!ParseKvGroupKind(kind, &k->kind)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".kind: '", kind,
                                                   "' is not allowed; allowed: full, sliding_window, chunked_local, state"));
  }
  const YAML::Node layers = node["layers"];
  if (layers && !layers.IsSequence()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".layers: expected a list of layer indices, \"a-b\" or \"a-b/s\""));
  }
  if (layers) {
    for (size_t i = 0; i < layers.size(); ++i) {
      if (!layers[i].IsScalar()) return absl::InvalidArgumentError(absl::StrCat(where, ".layers[", i, "]: expected a single value"));
      absl::StatusOr<std::vector<int32_t>> parsed = ParseLayerSpec(layers[i].as<std::string>());
      if (!parsed.ok()) return absl::InvalidArgumentError(absl::StrCat(where, ".layers[", i, "]: ", parsed.status().message()));
      k->layers.insert(k->layers.end(), parsed->begin(), parsed->end());
    }
  }
  KVD_RETURN_IF_ERROR(ReadSize(node, "bytes_per_token", &k->bytes_per_token, where));
  KVD_RETURN_IF_ERROR(ReadSize(node, "bytes_per_state", &k->bytes_per_state, where));
  KVD_RETURN_IF_ERROR(Read(node, "window", &k->window, where));
  KVD_RETURN_IF_ERROR(Read(node, "chunk", &k->chunk, where));
  KVD_RETURN_IF_ERROR(Read(node, "checkpoint_every_blocks", &k->checkpoint_every_blocks, where));
  KVD_RETURN_IF_ERROR(Read(node, "checkpoint_at_end", &k->checkpoint_at_end, where));
  // Keys of the other kinds that the struct cannot tell from their defaults.
  const char* capacity = k->attention() ? "capacity_blocks" : "capacity_slots";
  const char* other = k->attention() ? "capacity_slots" : "capacity_blocks";
  if (node[other]) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".", other, ": ", node[other].as<std::string>(),
                                                   " is not a key of kind ", kind, "; allowed: ", capacity));
  }
  if (k->attention() && node["checkpoint_at_end"]) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".checkpoint_at_end: ", node["checkpoint_at_end"].as<std::string>(),
                                                   " is not a key of kind ", kind, "; allowed only on state"));
  }
  KVD_RETURN_IF_ERROR(Read(node, capacity, &k->capacity, where));
  if (node[capacity] && k->capacity <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".", capacity, ": ", k->capacity, " is out of range; allowed: > 0"));
  }
  return absl::OkStatus();
}

absl::Status ReadPool(const YAML::Node& node, const std::string& where, PoolGeometry* g) {
  KVD_RETURN_IF_ERROR(CheckKeys(node, where,
                                {"name", "block_tokens", "num_layers", "bytes_per_token_per_layer",
                                 "capacity_blocks", "max_model_len", "shards", "devices", "layout", "dtype",
                                 "kv_heads", "head_dim", "kv_arrangement", "allocator", "model_fingerprint",
                                 "groups", "capacity_bytes", "step_tokens"}));
  *g = DefaultPool();
  g->name.clear();
  KVD_RETURN_IF_ERROR(Read(node, "name", &g->name, where));
  KVD_RETURN_IF_ERROR(Read(node, "block_tokens", &g->block_tokens, where));
  KVD_RETURN_IF_ERROR(Read(node, "num_layers", &g->num_layers, where));
  KVD_RETURN_IF_ERROR(Read(node, "bytes_per_token_per_layer", &g->bytes_per_token_per_layer, where));
  KVD_RETURN_IF_ERROR(Read(node, "capacity_blocks", &g->capacity_blocks, where));
  KVD_RETURN_IF_ERROR(Read(node, "max_model_len", &g->max_model_len, where));
  KVD_RETURN_IF_ERROR(Read(node, "shards", &g->num_shards, where));
  KVD_RETURN_IF_ERROR(Read(node, "devices", &g->devices, where));
  if (!g->devices.empty() && !node["shards"]) g->num_shards = static_cast<int32_t>(g->devices.size());
  KVD_RETURN_IF_ERROR(Read(node, "dtype", &g->kv.dtype, where));
  KVD_RETURN_IF_ERROR(Read(node, "kv_heads", &g->kv.kv_heads, where));
  KVD_RETURN_IF_ERROR(Read(node, "head_dim", &g->kv.head_dim, where));
  KVD_RETURN_IF_ERROR(Read(node, "kv_arrangement", &g->kv.arrangement, where));
  KVD_RETURN_IF_ERROR(Read(node, "model_fingerprint", &g->model_fingerprint, where));
  if (absl::Status s = CheckModelFingerprint(g->model_fingerprint); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, " (pool '", g->name, "'): ", s.message()));
  }
  std::string allocator = PoolAllocatorName(g->allocator);
  KVD_RETURN_IF_ERROR(Read(node, "allocator", &allocator, where));
  if (allocator == "ipc" || allocator == "vmm") {
    g->allocator = allocator == "vmm" ? PoolAllocator::kVmm : PoolAllocator::kIpc;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(where, ": allocator must be ipc or vmm, not '", allocator, "'"));
  }
  std::string layout = PoolLayoutName(g->layout);
  KVD_RETURN_IF_ERROR(Read(node, "layout", &layout, where));
  if (layout == "layer_major") {
    g->layout = PoolLayout::kLayerMajor;
  } else if (layout == "block_major") {
    g->layout = PoolLayout::kBlockMajor;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": layout must be layer_major or block_major, not '", layout, "'"));
  }
  KVD_RETURN_IF_ERROR(ReadSize(node, "capacity_bytes", &g->capacity_bytes, where));
  KVD_RETURN_IF_ERROR(Read(node, "step_tokens", &g->step_tokens, where));
  // `where` is "config PATH: pools[i]"; group errors continue it as "pools[i].groups[j].field".
  if (const YAML::Node groups = node["groups"]) {
    if (!groups.IsSequence() || groups.size() == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".groups: expected a list of 1 to ", kMaxKvGroups, " groups"));
    }
    if (node["capacity_blocks"]) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".capacity_blocks: ", node["capacity_blocks"].as<std::string>(),
          " is ambiguous in a pool with groups; allowed: the pool's capacity_bytes (split over the groups) or "
          "groups[j].capacity_blocks / capacity_slots"));
    }
    for (size_t j = 0; j < groups.size(); ++j) {
      KvGroup k;
      KVD_RETURN_IF_ERROR(ReadGroup(groups[j], absl::StrCat(where, ".groups[", j, "]"), &k));
      g->groups.push_back(std::move(k));
    }
  }
  if (absl::Status s = g->ResolveGroups(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".", s.message()));
  }
  return absl::OkStatus();
}

// INVALID_ARGUMENT unless `node` is a map whose keys are all in `known`.
absl::Status CheckKeys(const YAML::Node& node, const std::string& where,
                       std::initializer_list<const char*> known) {
  if (!node.IsMap()) return absl::InvalidArgumentError(absl::StrCat(where, ": not a map"));
  for (const auto& kv : node) {
    const std::string key = kv.first.as<std::string>();
    bool ok = false;
    for (const char* k : known) ok |= key == k;
    if (!ok) return absl::InvalidArgumentError(absl::StrCat(where, ": unknown key '", key, "'"));
  }
  return absl::OkStatus();
}

absl::Status ReadTiers(const YAML::Node& node, const std::string& where, TierOptions* t) {
  KVD_RETURN_IF_ERROR(CheckKeys(node, where,
                                {"host_bytes", "disk_dir", "disk_bytes", "codec", "segment_bytes",
                                 "idle_demote_after_s", "read_threads", "flush_on_drain", "max_prefetch_handles_per_worker", "redis_url", "redis_password_file", "redis_secret_file", "redis_encryption_key_file",
                                 "redis_key_prefix", "redis_ttl_s", "redis_connect_timeout_s", "redis_timeout_s",
                                 "redis_retry_after_s", "redis_write_through", "redis_max_pending_uploads"}));
  KVD_RETURN_IF_ERROR(ReadSize(node, "host_bytes", &t->host_bytes, where));
  KVD_RETURN_IF_ERROR(Read(node, "disk_dir", &t->disk_dir, where));
  KVD_RETURN_IF_ERROR(ReadSize(node, "disk_bytes", &t->disk_bytes, where));
  std::string codec = CodecName(t->codec);
  KVD_RETURN_IF_ERROR(Read(node, "codec", &codec, where));
  absl::StatusOr<Codec> parsed = ParseCodec(codec);
  if (!parsed.ok()) return absl::InvalidArgumentError(absl::StrCat(where, ": codec: ", parsed.status().message()));
  t->codec = *parsed;
  KVD_RETURN_IF_ERROR(ReadSize(node, "segment_bytes", &t->segment_bytes, where));
  KVD_RETURN_IF_ERROR(ReadSeconds(node, "idle_demote_after_s", &t->idle_demote_after, where));
  KVD_RETURN_IF_ERROR(Read(node, "read_threads", &t->read_threads, where));
  KVD_RETURN_IF_ERROR(Read(node, "flush_on_drain", &t->flush_on_drain, where));
  KVD_RETURN_IF_ERROR(Read(node, "max_prefetch_handles_per_worker", &t->max_prefetch_handles_per_worker, where));
  RemoteTierOptions& r = t->remote;
  KVD_RETURN_IF_ERROR(Read(node, "redis_url", &r.url, where));
  KVD_RETURN_IF_ERROR(Read(node, "redis_password_file", &r.password_file, where));
  KVD_RETURN_IF_ERROR(Read(node, "redis_secret_file", &r.secret_file, where));
  KVD_RETURN_IF_ERROR(Read(node, "redis_encryption_key_file", &r.encryption_key_file, where));
  KVD_RETURN_IF_ERROR(Read(node, "redis_key_prefix", &r.key_prefix, where));
  KVD_RETURN_IF_ERROR(ReadSeconds(node, "redis_ttl_s", &r.ttl, where));
  KVD_RETURN_IF_ERROR(ReadSeconds(node, "redis_connect_timeout_s", &r.connect_timeout, where));
  KVD_RETURN_IF_ERROR(ReadSeconds(node, "redis_timeout_s", &r.io_timeout, where));
  KVD_RETURN_IF_ERROR(ReadSeconds(node, "redis_retry_after_s", &r.retry_after, where));
  KVD_RETURN_IF_ERROR(Read(node, "redis_write_through", &r.write_through, where));
  KVD_RETURN_IF_ERROR(Read(node, "redis_max_pending_uploads", &r.max_pending_uploads, where));
  return absl::OkStatus();
}

absl::Status ReadTransfer(const YAML::Node& node, const std::string& where, TransferOptions* t) {
  KVD_RETURN_IF_ERROR(CheckKeys(node, where,
                                {"listen", "tls_cert_file", "tls_key_file", "tls_ca_file", "peers", "allowed_peers",
                                 "pull_timeout_s", "lease_s", "max_leases", "pull_threads"}));
  KVD_RETURN_IF_ERROR(Read(node, "listen", &t->listen, where));
  KVD_RETURN_IF_ERROR(Read(node, "tls_cert_file", &t->tls_cert_file, where));
  KVD_RETURN_IF_ERROR(Read(node, "tls_key_file", &t->tls_key_file, where));
  KVD_RETURN_IF_ERROR(Read(node, "tls_ca_file", &t->tls_ca_file, where));
  KVD_RETURN_IF_ERROR(Read(node, "allowed_peers", &t->allowed_peers, where));
  KVD_RETURN_IF_ERROR(ReadSeconds(node, "pull_timeout_s", &t->pull_timeout, where));
  KVD_RETURN_IF_ERROR(ReadSeconds(node, "lease_s", &t->lease, where));
  KVD_RETURN_IF_ERROR(Read(node, "max_leases", &t->max_leases, where));
  KVD_RETURN_IF_ERROR(Read(node, "pull_threads", &t->pull_threads, where));
  if (const YAML::Node peers = node["peers"]) {
    if (!peers.IsSequence()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": peers must be a list of {name, address}"));
    }
    for (size_t i = 0; i < peers.size(); ++i) {
      const std::string at = absl::StrCat(where, ": peers[", i, "]");
      if (!peers[i].IsMap()) return absl::InvalidArgumentError(absl::StrCat(at, ": expected {name, address}"));
      KVD_RETURN_IF_ERROR(CheckKeys(peers[i], at, {"name", "address"}));
      TransferPeer p;
      KVD_RETURN_IF_ERROR(Read(peers[i], "name", &p.name, at));
      KVD_RETURN_IF_ERROR(Read(peers[i], "address", &p.address, at));
      t->peers.push_back(std::move(p));
    }
  }
  return absl::OkStatus();
}

absl::Status ReadRouterEvents(const YAML::Node& node, const std::string& where, RouterEventsOptions* r) {
  KVD_RETURN_IF_ERROR(CheckKeys(node, where,
                                {"endpoint", "endpoint_mode", "replay_endpoint", "replay_topic_frame", "topic", "node",
                                 "hash_seed", "format", "medium", "data_parallel_rank", "buffer_batches",
                                 "max_batch_events", "send_hwm"}));
  KVD_RETURN_IF_ERROR(Read(node, "endpoint_mode", &r->endpoint_mode, where));
  KVD_RETURN_IF_ERROR(Read(node, "replay_topic_frame", &r->replay_topic_frame, where));
  // medium: one word for every pool, or a map of pool name to word.
  if (const YAML::Node m = node["medium"]) {
    if (m.IsScalar()) {
      r->medium[""] = m.as<std::string>();
    } else if (m.IsMap()) {
      for (const auto& kv : m) {
        if (!kv.second.IsScalar()) {
          return absl::InvalidArgumentError(absl::StrCat(where, ": medium: pool '", kv.first.as<std::string>(),
                                                         "': expected a single word such as GPU"));
        }
        r->medium[kv.first.as<std::string>()] = kv.second.as<std::string>();
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat(where, ": medium: expected a word (every pool) or a map of "
                                                     "pool name to word"));
    }
  }
  KVD_RETURN_IF_ERROR(Read(node, "endpoint", &r->endpoint, where));
  KVD_RETURN_IF_ERROR(Read(node, "replay_endpoint", &r->replay_endpoint, where));
  KVD_RETURN_IF_ERROR(Read(node, "topic", &r->topic, where));
  KVD_RETURN_IF_ERROR(Read(node, "node", &r->node, where));
  KVD_RETURN_IF_ERROR(Read(node, "hash_seed", &r->hash_seed, where));
  KVD_RETURN_IF_ERROR(Read(node, "data_parallel_rank", &r->data_parallel_rank, where));
  KVD_RETURN_IF_ERROR(Read(node, "buffer_batches", &r->buffer_batches, where));
  KVD_RETURN_IF_ERROR(Read(node, "max_batch_events", &r->max_batch_events, where));
  KVD_RETURN_IF_ERROR(Read(node, "send_hwm", &r->send_hwm, where));
  KVD_RETURN_IF_ERROR(Read(node, "format", &r->format, where));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<gid_t> ResolveGroup(const std::string& name) {
  if (group* g = getgrnam(name.c_str())) return g->gr_gid;
  uint32_t gid = 0;
  if (absl::SimpleAtoi(name, &gid)) return static_cast<gid_t>(gid);
  return absl::InvalidArgumentError(absl::StrCat("socket_group: no group '", name, "'"));
}

PoolGeometry DefaultPool() {
  PoolGeometry g;
  g.name = "default";
  g.block_tokens = 16;
  g.num_layers = 32;
  g.bytes_per_token_per_layer = 4096;
  g.capacity_blocks = 64;
  g.max_model_len = 32768;
  return g;
}

PoolGeometry ReferenceEnginePool() {
  PoolGeometry g;
  g.name = "tiny-engine";
  g.block_tokens = 16;
  g.num_layers = 2;
  g.bytes_per_token_per_layer = 128;  // K and V of 2 kv heads x 8 dims, float32
  g.capacity_blocks = 1024;           // 4 MiB
  g.max_model_len = 4096;
  g.kv = KvFormat{.dtype = "float32", .kv_heads = 2, .head_dim = 8, .arrangement = "token_kv_head_dim"};
  return g;
}

void Options::ApplyDefaults() {
  if (server.listen.empty()) server.listen = absl::StrCat("unix://", DefaultSocketDir(), "/kvd.sock");
  if (server.side_socket.empty()) {
    server.side_socket = absl::StartsWith(server.listen, "unix://")
                             ? absl::StrCat(server.listen.substr(7), ".slabs")
                             : absl::StrCat(DefaultSocketDir(), "/kvd-slabs.sock");
  }
  if (server.handoff_socket.empty() && absl::StartsWith(server.listen, "unix://")) {
    server.handoff_socket = absl::StrCat(server.listen.substr(7), ".handoff");
  }
  if (server.handoff_socket == "off") server.handoff_socket.clear();
  if (cache.pools.empty()) cache.pools = {DefaultPool(), ReferenceEnginePool()};
}

absl::Status Options::Validate() const {
  if (server.listen.empty()) return absl::InvalidArgumentError("listen address is empty");
  if (server.backend != "host" && server.backend != "cuda" && server.backend != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("backend must be host, cuda or auto, not '", server.backend, "'"));
  }
  // gRPC takes an int: anything larger would be cut to garbage (0 refuses every message).
  if (server.max_message_bytes < 4096 || server.max_message_bytes > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("max_message_bytes must be between 4096 and ",
                                                   std::numeric_limits<int32_t>::max(), ", not ",
                                                   server.max_message_bytes));
  }
  if (server.lease_ttl <= absl::ZeroDuration()) return absl::InvalidArgumentError(absl::StrCat("lease_ttl_s must be > 0, not ", absl::FormatDuration(server.lease_ttl)));
  if (server.max_connection_idle < absl::Seconds(1) || server.max_connection_idle > absl::Hours(24 * 20)) {
    return absl::InvalidArgumentError(absl::StrCat("max_connection_idle_s must be between 1s and 480h, not ", absl::FormatDuration(server.max_connection_idle)));
  }
  if (server.drain_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("drain_timeout_s must be >= 0, not ", absl::FormatDuration(server.drain_timeout)));
  }
  if (server.log_level != "trace" && server.log_level != "debug" && server.log_level != "info" &&
      server.log_level != "warn" && server.log_level != "error") {
    return absl::InvalidArgumentError(
        absl::StrCat("log_level must be trace, debug, info, warn or error, not '", server.log_level, "'"));
  }
  for (const PoolGeometry& g : cache.pools) {
    // (A hybrid pool's blocks move as whole units everywhere: peers, G2/G3, flush and warm restart,
    // and G4, docs/hybrid.md §2.9.)
    if (g.allocator == PoolAllocator::kVmm && server.backend == "host") {
      return absl::InvalidArgumentError(absl::StrCat("pool '", g.name, "': allocator vmm is CUDA memory; it needs "
                                                     "backend cuda (or auto on a GPU node), not host"));
    }
  }
  if (server.tls_cert_file.empty() != server.tls_key_file.empty()) {
    return absl::InvalidArgumentError("tls_cert_file and tls_key_file go together");
  }
  if (!server.tls_client_ca_file.empty() && server.tls_cert_file.empty()) {
    return absl::InvalidArgumentError("tls_client_ca_file needs tls_cert_file and tls_key_file");
  }
  if (!server.tls_cert_file.empty() && absl::StartsWith(server.listen, "unix://")) {
    return absl::InvalidArgumentError("tls_cert_file is for a TCP listen address, not a Unix socket");
  }
  if (!server.socket_group.empty() && !ResolveGroup(server.socket_group).ok()) {
    return ResolveGroup(server.socket_group).status();
  }
  for (int64_t id : server.allowed_uids) {
    if (id < 0 || id > 0xFFFFFFFE) return absl::InvalidArgumentError(absl::StrCat("allowed_uids: bad uid ", id));
  }
  for (int64_t id : server.allowed_gids) {
    if (id < 0 || id > 0xFFFFFFFE) return absl::InvalidArgumentError(absl::StrCat("allowed_gids: bad gid ", id));
  }
  if ((!server.allowed_uids.empty() || !server.allowed_gids.empty()) &&
      !absl::StartsWith(server.listen, "unix://")) {
    return absl::InvalidArgumentError("allowed_uids / allowed_gids need a Unix socket listen address (use TLS client certificates on TCP)");
  }
  if (tiers.host_bytes < 0) return absl::InvalidArgumentError(absl::StrCat("tiers.host_bytes must be >= 0, not ", tiers.host_bytes));
  if (tiers.disk_bytes <= 0) return absl::InvalidArgumentError(absl::StrCat("tiers.disk_bytes must be > 0, not ", tiers.disk_bytes));
  if (tiers.segment_bytes < 4096) return absl::InvalidArgumentError(absl::StrCat("tiers.segment_bytes must be >= 4096, not ", tiers.segment_bytes));
  if (tiers.read_threads < 1 || tiers.read_threads > 64) {
    return absl::InvalidArgumentError(absl::StrCat("tiers.read_threads must be in [1, 64], not ", tiers.read_threads));
  }
  if (tiers.idle_demote_after < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("tiers.idle_demote_after_s must be >= 0, not ", absl::FormatDuration(tiers.idle_demote_after)));
  }
  if (!tiers.disk_dir.empty() && tiers.disk_dir[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat("tiers.disk_dir must be absolute, not '", tiers.disk_dir, "'"));
  }
  const RemoteTierOptions& g4 = tiers.remote;
  if (g4.enabled()) {
    if (!absl::StartsWith(g4.url, "redis://") && !absl::StartsWith(g4.url, "unix:///") &&
        !absl::StartsWith(g4.url, "redis-cluster://")) {
      return absl::InvalidArgumentError(
          absl::StrCat("tiers.redis_url must be redis://host:port[/db], unix:///path or "
                       "redis-cluster://host:port[,host:port...], not '", RedactUrl(g4.url), "'"));
    }
    if (g4.key_prefix.empty()) return absl::InvalidArgumentError("tiers.redis_key_prefix is empty");
    if (g4.ttl < absl::Seconds(1)) return absl::InvalidArgumentError("tiers.redis_ttl_s must be >= 1");
    if (g4.connect_timeout <= absl::ZeroDuration() || g4.io_timeout <= absl::ZeroDuration()) {
      return absl::InvalidArgumentError("tiers.redis_connect_timeout_s and redis_timeout_s must be > 0");
    }
    if (g4.retry_after < absl::ZeroDuration()) return absl::InvalidArgumentError("tiers.redis_retry_after_s must be >= 0");
    if (g4.max_pending_uploads < 1) return absl::InvalidArgumentError("tiers.redis_max_pending_uploads must be >= 1");
  }
  const RouterEventsOptions& r = router_events;
  if (!r.replay_endpoint.empty() && r.endpoint.empty()) {
    return absl::InvalidArgumentError("router_events.replay_endpoint needs router_events.endpoint");
  }
  if (r.format != "vllm" && r.format != "vllm-map") {
    return absl::InvalidArgumentError(
        absl::StrCat("router_events.format must be vllm or vllm-map, not '", r.format, "'"));
  }
  if (r.buffer_batches < 1) return absl::InvalidArgumentError(absl::StrCat("router_events.buffer_batches must be >= 1, not ", r.buffer_batches));
  if (r.max_batch_events < 1) return absl::InvalidArgumentError(absl::StrCat("router_events.max_batch_events must be >= 1, not ", r.max_batch_events));
  if (r.send_hwm < 0) return absl::InvalidArgumentError(absl::StrCat("router_events.send_hwm must be >= 0, not ", r.send_hwm));
  if (r.data_parallel_rank < 0) return absl::InvalidArgumentError(absl::StrCat("router_events.data_parallel_rank must be >= 0, not ", r.data_parallel_rank));
  if (r.enabled()) {
    RouterEventsOptions named = r;
    for (const PoolGeometry& g : cache.pools) named.pools.push_back(g.name);
    KVD_RETURN_IF_ERROR(CheckRouterEventsOptions(named));
  }
  KVD_RETURN_IF_ERROR(transfer.Validate());
  KVD_RETURN_IF_ERROR(cache.Validate());
  if (cache.demote_reserve > 0 && tiers.host_bytes <= 0 && tiers.disk_dir.empty()) {
    return absl::InvalidArgumentError(
        "demote_reserve needs a tier to demote into (tiers.host_bytes or tiers.disk_dir)");
  }
  return absl::OkStatus();
}

absl::Status LoadConfigFile(const std::string& path, Options* options) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("config ", path, ": ", e.what()));
  }
  const std::string where = absl::StrCat("config ", path);
  if (root.IsNull()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, " is empty: expected a YAML map of settings (deploy/kvd.example.yaml shows every key)"));
  }
  KVD_RETURN_IF_ERROR(CheckKeys(
      root, where,
      {"listen", "side_socket", "handoff_socket", "metrics_listen", "backend", "max_message_bytes", "lease_ttl_s", "max_connection_idle_s",
       "drain_timeout_s", "log_level", "budget_bytes", "session_ttl_s", "session_max_protected_blocks",
       "checkpoint_budget_bytes", "checkpoint_ttl_s", "max_engine_state_bytes", "checkpoint_state_bytes",
       "max_checkpoint_state_bytes_per_worker", "boundary_high_watermark",
       "boundary_low_watermark", "demote_reserve", "event_buffer", "eviction_policy", "slru_main_fraction", "slru_ghost_fraction",
       "horizon_probation", "horizon_main", "horizon_sample_every", "horizon_margin",
       "max_requests_per_worker", "max_bytes_per_worker", "step_credit_blocks", "pools", "tiers", "router_events", "transfer", "tls_cert_file",
       "tls_key_file", "tls_client_ca_file", "allowed_uids", "allowed_gids", "socket_group"}));
  ServerOptions& s = options->server;
  CacheOptions& c = options->cache;
  KVD_RETURN_IF_ERROR(Read(root, "listen", &s.listen, where));
  if (!s.listen.empty()) {
    absl::StatusOr<std::string> listen = NormalizeListen("listen", s.listen);
    if (!listen.ok()) return Prefixed(where, listen.status());
    s.listen = *listen;
  }
  KVD_RETURN_IF_ERROR(Read(root, "side_socket", &s.side_socket, where));
  KVD_RETURN_IF_ERROR(Read(root, "handoff_socket", &s.handoff_socket, where));
  KVD_RETURN_IF_ERROR(Read(root, "metrics_listen", &s.metrics_listen, where));
  KVD_RETURN_IF_ERROR(Read(root, "backend", &s.backend, where));
  KVD_RETURN_IF_ERROR(ReadSize(root, "max_message_bytes", &s.max_message_bytes, where));
  KVD_RETURN_IF_ERROR(ReadSeconds(root, "lease_ttl_s", &s.lease_ttl, where));
  KVD_RETURN_IF_ERROR(ReadSeconds(root, "max_connection_idle_s", &s.max_connection_idle, where));
  KVD_RETURN_IF_ERROR(ReadSeconds(root, "drain_timeout_s", &s.drain_timeout, where));
  KVD_RETURN_IF_ERROR(Read(root, "log_level", &s.log_level, where));
  KVD_RETURN_IF_ERROR(Read(root, "tls_cert_file", &s.tls_cert_file, where));
  KVD_RETURN_IF_ERROR(Read(root, "tls_key_file", &s.tls_key_file, where));
  KVD_RETURN_IF_ERROR(Read(root, "tls_client_ca_file", &s.tls_client_ca_file, where));
  KVD_RETURN_IF_ERROR(Read(root, "allowed_uids", &s.allowed_uids, where));
  KVD_RETURN_IF_ERROR(Read(root, "socket_group", &s.socket_group, where));
  KVD_RETURN_IF_ERROR(Read(root, "allowed_gids", &s.allowed_gids, where));
  KVD_RETURN_IF_ERROR(ReadSize(root, "budget_bytes", &c.budget_bytes, where));
  KVD_RETURN_IF_ERROR(ReadSeconds(root, "session_ttl_s", &c.session_ttl, where));
  KVD_RETURN_IF_ERROR(Read(root, "session_max_protected_blocks", &c.session_max_protected_blocks, where));
  KVD_RETURN_IF_ERROR(ReadSize(root, "checkpoint_budget_bytes", &c.checkpoint_budget_bytes, where));
  KVD_RETURN_IF_ERROR(ReadSeconds(root, "checkpoint_ttl_s", &c.checkpoint_ttl, where));
  KVD_RETURN_IF_ERROR(ReadSize(root, "max_engine_state_bytes", &c.max_engine_state_bytes, where));
  KVD_RETURN_IF_ERROR(ReadSize(root, "checkpoint_state_bytes", &c.checkpoint_state_bytes, where));
  KVD_RETURN_IF_ERROR(ReadSize(root, "max_checkpoint_state_bytes_per_worker", &c.max_checkpoint_state_bytes_per_worker, where));
  KVD_RETURN_IF_ERROR(Read(root, "boundary_high_watermark", &c.boundary_high_watermark, where));
  KVD_RETURN_IF_ERROR(Read(root, "boundary_low_watermark", &c.boundary_low_watermark, where));
  KVD_RETURN_IF_ERROR(Read(root, "demote_reserve", &c.demote_reserve, where));
  KVD_RETURN_IF_ERROR(Read(root, "event_buffer", &c.event_buffer, where));
  std::string policy(EvictionPolicyName(c.eviction_policy));
  KVD_RETURN_IF_ERROR(Read(root, "eviction_policy", &policy, where));
  if (!ParseEvictionPolicy(policy, &c.eviction_policy)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": eviction_policy must be lru, slru or horizon, not '", policy, "'"));
  }
  KVD_RETURN_IF_ERROR(Read(root, "slru_main_fraction", &c.slru_main_fraction, where));
  KVD_RETURN_IF_ERROR(Read(root, "slru_ghost_fraction", &c.slru_ghost_fraction, where));
  KVD_RETURN_IF_ERROR(Read(root, "horizon_probation", &c.horizon_probation, where));
  KVD_RETURN_IF_ERROR(Read(root, "horizon_main", &c.horizon_main, where));
  KVD_RETURN_IF_ERROR(Read(root, "horizon_sample_every", &c.horizon_sample_every, where));
  KVD_RETURN_IF_ERROR(Read(root, "horizon_margin", &c.horizon_margin, where));
  KVD_RETURN_IF_ERROR(Read(root, "max_requests_per_worker", &c.max_requests_per_worker, where));
  KVD_RETURN_IF_ERROR(ReadSize(root, "max_bytes_per_worker", &c.max_bytes_per_worker, where));
  KVD_RETURN_IF_ERROR(Read(root, "step_credit_blocks", &c.step_credit_blocks, where));
  if (const YAML::Node tiers = root["tiers"]) {
    KVD_RETURN_IF_ERROR(ReadTiers(tiers, absl::StrCat(where, ": tiers"), &options->tiers));
  }
  if (const YAML::Node events = root["router_events"]) {
    KVD_RETURN_IF_ERROR(ReadRouterEvents(events, absl::StrCat(where, ": router_events"), &options->router_events));
  }
  if (const YAML::Node transfer = root["transfer"]) {
    KVD_RETURN_IF_ERROR(ReadTransfer(transfer, absl::StrCat(where, ": transfer"), &options->transfer));
  }
  if (const YAML::Node pools = root["pools"]) {
    if (!pools.IsSequence()) return absl::InvalidArgumentError(absl::StrCat(where, ": pools must be a list"));
    c.pools.clear();
    for (size_t i = 0; i < pools.size(); ++i) {
      PoolGeometry g;
      KVD_RETURN_IF_ERROR(ReadPool(pools[i], absl::StrCat(where, ": pools[", i, "]"), &g));
      c.pools.push_back(std::move(g));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvd

namespace kvd {

std::string FormatConfig(const Options& o) {
  YAML::Emitter out;
  out.SetDoublePrecision(6);
  const ServerOptions& s = o.server;
  const CacheOptions& c = o.cache;
  out << YAML::BeginMap;
  out << YAML::Key << "listen" << YAML::Value << s.listen;
  out << YAML::Key << "side_socket" << YAML::Value << s.side_socket;
  out << YAML::Key << "handoff_socket" << YAML::Value << (s.handoff_socket.empty() ? "off" : s.handoff_socket);
  out << YAML::Key << "metrics_listen" << YAML::Value << s.metrics_listen;
  out << YAML::Key << "backend" << YAML::Value << s.backend;
  out << YAML::Key << "max_message_bytes" << YAML::Value << s.max_message_bytes;
  out << YAML::Key << "lease_ttl_s" << YAML::Value << absl::ToDoubleSeconds(s.lease_ttl);
  out << YAML::Key << "max_connection_idle_s" << YAML::Value << absl::ToDoubleSeconds(s.max_connection_idle);
  out << YAML::Key << "drain_timeout_s" << YAML::Value << absl::ToDoubleSeconds(s.drain_timeout);
  out << YAML::Key << "log_level" << YAML::Value << s.log_level;
  out << YAML::Key << "tls_cert_file" << YAML::Value << s.tls_cert_file;
  out << YAML::Key << "tls_key_file" << YAML::Value << s.tls_key_file;
  out << YAML::Key << "tls_client_ca_file" << YAML::Value << s.tls_client_ca_file;
  out << YAML::Key << "socket_group" << YAML::Value << s.socket_group;
  out << YAML::Key << "allowed_uids" << YAML::Value << YAML::Flow << s.allowed_uids;
  out << YAML::Key << "allowed_gids" << YAML::Value << YAML::Flow << s.allowed_gids;
  out << YAML::Key << "budget_bytes" << YAML::Value << c.budget_bytes;
  out << YAML::Key << "session_ttl_s" << YAML::Value << absl::ToDoubleSeconds(c.session_ttl);
  out << YAML::Key << "session_max_protected_blocks" << YAML::Value << c.session_max_protected_blocks;
  out << YAML::Key << "checkpoint_budget_bytes" << YAML::Value << c.checkpoint_budget_bytes;
  out << YAML::Key << "checkpoint_ttl_s" << YAML::Value << absl::ToDoubleSeconds(c.checkpoint_ttl);
  out << YAML::Key << "max_engine_state_bytes" << YAML::Value << c.max_engine_state_bytes;
  out << YAML::Key << "checkpoint_state_bytes" << YAML::Value << c.checkpoint_state_bytes;
  out << YAML::Key << "max_checkpoint_state_bytes_per_worker" << YAML::Value << c.max_checkpoint_state_bytes_per_worker;
  out << YAML::Key << "boundary_high_watermark" << YAML::Value << c.boundary_high_watermark;
  out << YAML::Key << "boundary_low_watermark" << YAML::Value << c.boundary_low_watermark;
  out << YAML::Key << "demote_reserve" << YAML::Value << c.demote_reserve;
  out << YAML::Key << "event_buffer" << YAML::Value << c.event_buffer;
  out << YAML::Key << "eviction_policy" << YAML::Value << std::string(EvictionPolicyName(c.eviction_policy));
  out << YAML::Key << "slru_main_fraction" << YAML::Value << c.slru_main_fraction;
  out << YAML::Key << "slru_ghost_fraction" << YAML::Value << c.slru_ghost_fraction;
  out << YAML::Key << "horizon_probation" << YAML::Value << c.horizon_probation;
  out << YAML::Key << "horizon_main" << YAML::Value << c.horizon_main;
  out << YAML::Key << "horizon_sample_every" << YAML::Value << c.horizon_sample_every;
  out << YAML::Key << "horizon_margin" << YAML::Value << c.horizon_margin;
  out << YAML::Key << "max_requests_per_worker" << YAML::Value << c.max_requests_per_worker;
  out << YAML::Key << "max_bytes_per_worker" << YAML::Value << c.max_bytes_per_worker;
  out << YAML::Key << "step_credit_blocks" << YAML::Value << c.step_credit_blocks;
  out << YAML::Key << "pools" << YAML::Value << YAML::BeginSeq;
  for (const PoolGeometry& g : c.pools) {
    out << YAML::BeginMap;
    out << YAML::Key << "name" << YAML::Value << g.name;
    out << YAML::Key << "block_tokens" << YAML::Value << g.block_tokens;
    out << YAML::Key << "num_layers" << YAML::Value << g.num_layers;
    out << YAML::Key << "bytes_per_token_per_layer" << YAML::Value << g.bytes_per_token_per_layer;
    if (!g.hybrid()) out << YAML::Key << "capacity_blocks" << YAML::Value << g.capacity_blocks;
    if (g.capacity_bytes != 0) out << YAML::Key << "capacity_bytes" << YAML::Value << g.capacity_bytes;
    out << YAML::Key << "max_model_len" << YAML::Value << g.max_model_len;
    if (g.step_tokens != 0 || g.hybrid()) out << YAML::Key << "step_tokens" << YAML::Value << g.step_tokens_or_default();
    out << YAML::Key << "layout" << YAML::Value << PoolLayoutName(g.layout);
    if (g.allocator != PoolAllocator::kIpc) out << YAML::Key << "allocator" << YAML::Value << PoolAllocatorName(g.allocator);
    out << YAML::Key << "shards" << YAML::Value << g.num_shards;
    if (!g.devices.empty()) out << YAML::Key << "devices" << YAML::Value << YAML::Flow << g.devices;
    if (!g.kv.dtype.empty()) out << YAML::Key << "dtype" << YAML::Value << g.kv.dtype;
    if (g.kv.kv_heads != 0) out << YAML::Key << "kv_heads" << YAML::Value << g.kv.kv_heads;
    if (g.kv.head_dim != 0) out << YAML::Key << "head_dim" << YAML::Value << g.kv.head_dim;
    if (!g.kv.arrangement.empty()) out << YAML::Key << "kv_arrangement" << YAML::Value << g.kv.arrangement;
    if (!g.model_fingerprint.empty()) {
      out << YAML::Key << "model_fingerprint" << YAML::Value << YAML::DoubleQuoted << g.model_fingerprint;
    }
    if (g.hybrid()) {
      // Every group with its resolved capacity, so that the output reads back to the same split.
      out << YAML::Key << "groups" << YAML::Value << YAML::BeginSeq;
      for (const KvGroup& k : g.groups) {
        out << YAML::Flow << YAML::BeginMap;
        out << YAML::Key << "name" << YAML::Value << k.name;
        out << YAML::Key << "kind" << YAML::Value << KvGroupKindName(k.kind);
        out << YAML::Key << "layers" << YAML::Value << YAML::Flow << FormatLayers(k.layers);
        if (k.attention()) out << YAML::Key << "bytes_per_token" << YAML::Value << k.bytes_per_token;
        if (k.kind == KvGroupKind::kSlidingWindow) out << YAML::Key << "window" << YAML::Value << k.window;
        if (k.kind == KvGroupKind::kChunkedLocal) out << YAML::Key << "chunk" << YAML::Value << k.chunk;
        if (!k.attention()) {
          out << YAML::Key << "bytes_per_state" << YAML::Value << k.bytes_per_state;
          out << YAML::Key << "checkpoint_every_blocks" << YAML::Value << k.checkpoint_every_blocks;
          out << YAML::Key << "checkpoint_at_end" << YAML::Value << k.checkpoint_at_end;
        }
        out << YAML::Key << (k.attention() ? "capacity_blocks" : "capacity_slots") << YAML::Value << k.capacity;
        out << YAML::EndMap;
      }
      out << YAML::EndSeq;
    }
    out << YAML::EndMap;
  }
  out << YAML::EndSeq;
  const TierOptions& t = o.tiers;
  out << YAML::Key << "tiers" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "host_bytes" << YAML::Value << t.host_bytes;
  out << YAML::Key << "disk_dir" << YAML::Value << t.disk_dir;
  out << YAML::Key << "disk_bytes" << YAML::Value << t.disk_bytes;
  out << YAML::Key << "codec" << YAML::Value << CodecName(t.codec);
  out << YAML::Key << "segment_bytes" << YAML::Value << t.segment_bytes;
  out << YAML::Key << "idle_demote_after_s" << YAML::Value << absl::ToDoubleSeconds(t.idle_demote_after);
  out << YAML::Key << "read_threads" << YAML::Value << t.read_threads;
  out << YAML::Key << "flush_on_drain" << YAML::Value << t.flush_on_drain;
  out << YAML::Key << "max_prefetch_handles_per_worker" << YAML::Value << t.max_prefetch_handles_per_worker;
  out << YAML::Key << "redis_url" << YAML::Value << RedactUrl(t.remote.url);
  out << YAML::Key << "redis_password_file" << YAML::Value << t.remote.password_file;
  out << YAML::Key << "redis_secret_file" << YAML::Value << t.remote.secret_file;
  out << YAML::Key << "redis_encryption_key_file" << YAML::Value << t.remote.encryption_key_file;
  out << YAML::Key << "redis_key_prefix" << YAML::Value << t.remote.key_prefix;
  out << YAML::Key << "redis_ttl_s" << YAML::Value << absl::ToDoubleSeconds(t.remote.ttl);
  out << YAML::Key << "redis_connect_timeout_s" << YAML::Value << absl::ToDoubleSeconds(t.remote.connect_timeout);
  out << YAML::Key << "redis_timeout_s" << YAML::Value << absl::ToDoubleSeconds(t.remote.io_timeout);
  out << YAML::Key << "redis_retry_after_s" << YAML::Value << absl::ToDoubleSeconds(t.remote.retry_after);
  out << YAML::Key << "redis_write_through" << YAML::Value << t.remote.write_through;
  out << YAML::Key << "redis_max_pending_uploads" << YAML::Value << t.remote.max_pending_uploads;
  out << YAML::EndMap;
  const RouterEventsOptions& r = o.router_events;
  out << YAML::Key << "router_events" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "endpoint" << YAML::Value << r.endpoint;
  out << YAML::Key << "endpoint_mode" << YAML::Value << r.endpoint_mode;
  out << YAML::Key << "replay_endpoint" << YAML::Value << r.replay_endpoint;
  out << YAML::Key << "replay_topic_frame" << YAML::Value << r.replay_topic_frame;
  out << YAML::Key << "topic" << YAML::Value << r.topic;
  out << YAML::Key << "node" << YAML::Value << r.node;
  out << YAML::Key << "hash_seed" << YAML::Value << YAML::DoubleQuoted << r.hash_seed;
  out << YAML::Key << "data_parallel_rank" << YAML::Value << r.data_parallel_rank;
  out << YAML::Key << "buffer_batches" << YAML::Value << r.buffer_batches;
  out << YAML::Key << "max_batch_events" << YAML::Value << r.max_batch_events;
  out << YAML::Key << "send_hwm" << YAML::Value << r.send_hwm;
  out << YAML::Key << "format" << YAML::Value << r.format;
  if (!r.medium.empty()) {
    out << YAML::Key << "medium" << YAML::Value;
    if (r.medium.size() == 1 && r.medium.contains("")) {
      out << r.medium.at("");
    } else {
      std::map<std::string, std::string> sorted(r.medium.begin(), r.medium.end());
      out << YAML::BeginMap;
      for (const auto& [pool, medium] : sorted) out << YAML::Key << pool << YAML::Value << medium;
      out << YAML::EndMap;
    }
  }
  out << YAML::EndMap << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

}  // namespace kvd
