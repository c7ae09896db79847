// Options is the daemon's whole configuration: one sub-struct per component, each field with its
// meaning and default. Flags, the YAML config file and environment overrides all land here, and
// Validate() runs once at start-up, before anything binds.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/core/cache_options.h"
#include "server/events/router_event_publisher.h"
#include "server/transfer/transfer_options.h"
#include "server/store/tier_types.h"

namespace kvd {

struct ServerOptions {
  // gRPC address: unix:///path (default: /run/kvd/kvd.sock as root, else
  // $XDG_RUNTIME_DIR/kvd/kvd.sock or /tmp/kvd-<uid>/kvd.sock) or HOST:PORT for TCP.
  std::string listen;
  // Side socket that passes slab fds to workers. Default: the gRPC socket path + ".slabs".
  std::string side_socket;
  // Socket a new kvd connects to for a hot handoff (kvd --takeover; server/handoff.h), mode 0600.
  // Default: the gRPC socket path + ".handoff" on a Unix socket; "off" (or a TCP listen address)
  // disables it.
  std::string handoff_socket;
  // Prometheus /metrics endpoint, HOST:PORT (port 0 picks one). Empty disables. Default
  // 127.0.0.1:9464.
  std::string metrics_listen = "127.0.0.1:9464";
  // Memory backend: "host", "cuda" or "auto" (cuda when a GPU is usable, else host). Default host.
  std::string backend = "host";
  // Largest gRPC message accepted, in bytes. Default 64 MiB.
  int64_t max_message_bytes = int64_t{64} << 20;
  // A worker that sends no heartbeat for this long is considered dead. Default 10s.
  absl::Duration lease_ttl = absl::Seconds(10);
  // On SIGTERM, how long running requests may take to finish. Default 30s.
  absl::Duration drain_timeout = absl::Seconds(30);
  // A gRPC connection with no call in flight this long is closed (its client reconnects on the
  // next call), so idle connections cannot pin descriptors. Default 120 s.
  absl::Duration max_connection_idle = absl::Seconds(120);
  // When set, a JSON file written once kvd serves: {"grpc": ..., "side_socket": ..., "metrics_port": N}.
  std::string ready_file;
  // spdlog level: trace, debug, info, warn, error. Default info.
  std::string log_level = "info";
  // TLS for a TCP listen address (ignored on Unix sockets, whose peers are checked by the
  // kernel): PEM certificate chain and private key. Both or neither.
  std::string tls_cert_file;
  std::string tls_key_file;
  // PEM CA bundle: when set, clients must present a certificate it signed (mutual TLS).
  std::string tls_client_ca_file;
  // Local users allowed on the Unix sockets besides root and kvd's own user (SO_PEERCRED; a gid
  // matches the primary or a supplementary group). Others get PERMISSION_DENIED on gRPC and are
  // refused on the side socket. Both empty: whoever can open the sockets (mode 0660).
  // Group owning the Unix sockets (name or number; mode stays 0660): workers join it to connect.
  // Empty: the daemon's group.
  std::string socket_group;
  std::vector<int64_t> allowed_uids;
  std::vector<int64_t> allowed_gids;
};

struct Options {
  ServerOptions server;
  CacheOptions cache;
  TierOptions tiers;  // the `tiers:` map of the config file; off unless host_bytes or disk_dir
  RouterEventsOptions router_events;  // the `router_events:` map; off unless endpoint is set
  TransferOptions transfer;  // the `transfer:` map: peer transfer between kvds; off unless listen is set

  // Fills defaults that depend on the environment (listen address, side socket, default pool).
  void ApplyDefaults();
  // INVALID_ARGUMENT naming the first bad field.
  absl::Status Validate() const;
};

// The gid of a group given by name or number. INVALID_ARGUMENT naming it when there is none.
absl::StatusOr<gid_t> ResolveGroup(const std::string& name);

// The pools served when the config declares none, so that README's walkthrough runs on a bare
// `kvd`: "default", Llama-3-8B-shaped (32 layers, 4 KiB per token per layer in bf16, 16-token
// blocks of 2 MiB), 64 blocks (128 MiB), also the template a configured pool starts from; and
// "tiny-engine", declared for the reference engine (`python3 -m kvd.engine.worker`: 2 layers,
// 2 kv heads x 8 dims, float32), 1,024 blocks (4 MiB).
PoolGeometry DefaultPool();
PoolGeometry ReferenceEnginePool();

// Reads a YAML config file into `options` (fields it names override, others stay).
// INVALID_ARGUMENT naming the file, key and problem.
absl::Status LoadConfigFile(const std::string& path, Options* options);
// The effective configuration as a YAML config file (kvd --print-config): every key, so that
// LoadConfigFile of the output reproduces `options` exactly.
std::string FormatConfig(const Options& options);

}  // namespace kvd
