// RouterEventPublisher streams kvd's cache events to cluster routers in the wire format vLLM's
// ZmqEventPublisher uses (and SGLang, the llm-d KV-cache indexer and NVIDIA Dynamo consume):
//
//   PUB socket, one message per batch, three frames:
//     topic                 (options.topic with {node} and {pool} filled in; one topic per pool)
//     sequence number       (8 bytes, big-endian; one counter per topic, first batch 0)
//     msgpack payload       [timestamp (float seconds), [event, ...], data_parallel_rank]
//   events, arrays led by their type name (or maps, format "vllm-map"):
//     ["BlockStored", [block ids], parent id or nil, [token ids], block_size, lora_id (nil), medium,
//      lora_name]
//     ["BlockRemoved", [block ids], medium]
//     ["AllBlocksCleared"]
//   and, on a hybrid pool (one with KV groups, docs/hybrid.md §2.9), vLLM's hybrid fields after
//   those: BlockStored [..., lora_name, extra_keys (nil), group_idx, kv_cache_spec_kind,
//   kv_cache_spec_sliding_window], BlockRemoved [..., medium, group_idx]
//   (router_event_encoding.h). A hybrid pool announces its spine: one block per prefix position,
//   as its first full-attention group with that group's index and block size. A position is
//   stored when its full block is cached and removed when it leaves the cache (its unit evicted);
//   a window block tombstoned or a state checkpoint dropped under the node is not announced.
//   The PUB socket binds or connects by vLLM's rule (mode "auto": bind when the endpoint is a
//   wildcard, "::", ipc:// or inproc://; connect otherwise), so a central indexer can bind and
//   every node connect to it.
//   ROUTER replay socket: a request [identity, "", start sequence (8 bytes BE)], or
//   [identity, "", topic, start sequence] for one topic, gets every buffered batch of the topic(s)
//   from that sequence on as [identity, "", topic, sequence, payload] (vLLM >= 0.26, PR #45177;
//   without the topic frame when replay_topic_frame is false), then the end marker
//   [identity, "", "", -1 (8 bytes), ""] ([identity, "", -1, ""] without topic frames).
//
// Block ids are router hashes (router_hash.h), so a router hashing prompts itself matches them.
// Consecutive blocks of one chain stored together become one BlockStored; consecutive removals
// one BlockRemoved. medium: options.medium[pool] (default options.device_medium) for the device
// pool (G1), "DISK" for blocks a warm restart reloaded onto G3. Demotions and promotions between
// lower tiers are not announced.
//
// The cache's event listener only queues (never blocks on ZMQ); one thread owns both sockets,
// hashes, encodes, sends and serves replays. Thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "proto/vocab/pool_geometry.h"
#include "server/core/event_log.h"
#include "server/events/router_event_encoding.h"
#include "server/events/router_hash.h"

namespace kvd {

class KvCache;

struct RouterEventsOptions {
  // ZMQ endpoint of the PUB socket, e.g. "tcp://*:5557" or "ipc:///run/kvd/events" (bound), or
  // "tcp://indexer:5557" (connected, for an indexer that binds). Empty disables router events.
  std::string endpoint;
  // "auto" (vLLM's rule: bind a wildcard, "::", ipc:// or inproc:// endpoint, connect to any
  // other), "bind" or "connect".
  std::string endpoint_mode = "auto";
  // ZMQ endpoint of the ROUTER replay socket. Empty: no replay.
  std::string replay_endpoint;
  // Topic of each batch; "{node}" becomes `node`, "{pool}" the pool (model) name.
  std::string topic = "kv@{node}@{pool}";
  // This node's name in topics. Default: the host name.
  std::string node;
  // The engine's PYTHONHASHSEED: the first block's parent hash is SHA-256(cbor(seed)).
  std::string hash_seed = "0";
  // data_parallel_rank in every batch.
  int64_t data_parallel_rank = 0;
  // Batches kept for replay, per topic.
  int64_t buffer_batches = 10000;
  // Replay replies carry the topic before the sequence (vLLM >= 0.26, llm-d); false: the older
  // [sequence, payload] replies.
  bool replay_topic_frame = true;
  // Most events in one batch.
  int64_t max_batch_events = 1024;
  // Events waiting for the publisher thread before new ones are dropped (the router then sees
  // "AllBlocksCleared" and the blocks stored after it).
  int64_t max_queued_events = 1 << 20;
  // ZMQ send high-water mark of the PUB socket (batches).
  int64_t send_hwm = 100000;
  // The medium of device-pool blocks: "GPU" on the CUDA backend, "CPU" on the host backend.
  std::string device_medium = "GPU";
  // Per pool: the medium routers are told instead of device_medium (a host-backend pool a router
  // should score as GPU memory, say). Keys name configured pools; the key "" applies to every pool.
  absl::flat_hash_map<std::string, std::string> medium;
  // The pools whose events are published (their topics must not prefix-match each other).
  std::vector<std::string> pools;
  // Wire format of a batch (docs/integration.md, "Router events"):
  //   "vllm"      msgpack arrays, as vLLM's array-era KVEventBatch: [ts, [events], dp_rank] with
  //               BlockStored = [tag, block_hashes, parent, token_ids, block_size, lora_id,
  //               medium, lora_name] (lora_name is the adapter; vLLM PR #27577 made it the
  //               required 8th field), BlockRemoved = [tag, block_hashes, medium];
  //   "vllm-map"  the same as msgpack maps with a "type" tag, as vLLM's msgspec structs without
  //               array_like encode them ({"ts", "events", "data_parallel_rank"}).
  std::string format = "vllm";

  bool enabled() const { return !endpoint.empty(); }
};

struct RouterEventStats {
  uint64_t batches = 0;            // sent on the PUB socket
  uint64_t events = 0;             // router events in them
  uint64_t replay_requests = 0;
  uint64_t replayed_batches = 0;
  uint64_t dropped = 0;            // cache events dropped (queue full)
  uint64_t unhashable = 0;         // stored blocks whose parent's hash was unknown (not announced)
  uint64_t last_sequence = 0;      // of the last batch sent, in its topic (valid when batches > 0)
};

// The group a hybrid pool's router events carry (its first full group; docs/hybrid.md §2.9).
// REQUIRES: g.hybrid().
RouterEventGroup SpineGroupOf(const PoolGeometry& g);

// Whether the PUB socket binds `endpoint` under `mode` ("auto", "bind" or "connect").
bool RouterEndpointBinds(const std::string& endpoint, const std::string& mode);
// OK when endpoint_mode is auto, bind or connect; no pool's topic is a prefix of another's (a ZMQ
// subscription is a prefix match, so a router subscribed to "kv@n1@m" would also receive
// "kv@n1@m2"); and options.medium names only configured pools, each with one word.
// INVALID_ARGUMENT naming what is wrong otherwise (both topics, for an overlap).
absl::Status CheckRouterEventsOptions(const RouterEventsOptions& options);

class RouterEventPublisher {
 public:
  // Binds the sockets and starts the thread. Register with a cache (Attach) before it emits
  // anything a router must see (a warm restart's reload). INVALID_ARGUMENT for a bad option,
  // UNAVAILABLE naming the endpoint that cannot be bound.
  static absl::StatusOr<std::unique_ptr<RouterEventPublisher>> Start(RouterEventsOptions options);
  ~RouterEventPublisher();

  // Subscribes to `cache`'s events. Once; `cache` must outlive this.
  void Attach(KvCache* cache);
  // Queues one cache event (what Attach's listener calls).
  void Enqueue(const CacheEvent& event) ABSL_LOCKS_EXCLUDED(mu_);

  RouterEventStats Stats() const ABSL_LOCKS_EXCLUDED(stats_mu_);
  const RouterEventsOptions& options() const { return options_; }

 private:
  struct Batch;  // events of one pool being encoded
  struct Known {
    RouterHash hash;
    int32_t stored = 0;  // stored events minus removed events seen for this key
    int64_t depth = 0;   // the block's index in its prompt (0 for a first block)
  };

  explicit RouterEventPublisher(RouterEventsOptions options);
  void Run();                                             // the publisher thread
  void Publish(std::vector<CacheEvent> events);           // publisher thread only
  void Send(const std::string& pool, const Batch& batch); // publisher thread only
  void ServeReplay();                                     // publisher thread only
  std::string TopicOf(const std::string& pool) const;
  std::optional<RouterEventGroup> GroupOf(const std::string& pool) const;  // nullopt: no groups
  const std::string& MediumOf(const std::string& pool) const;

  const RouterEventsOptions options_;
  const RouterHasher hasher_;
  KvCache* cache_ = nullptr;
  int listener_ = 0;
  std::vector<std::string> pools_;  // topics an "all cleared" goes to
  // Each pool's model fingerprint (empty when it declares none), hashed into its blocks' ids.
  // Set by Attach, before the listener that feeds the publisher thread.
  absl::flat_hash_map<std::string, std::string> model_fingerprints_;
  // Each hybrid pool's group in its events (SpineGroupOf); pools without groups are absent.
  absl::flat_hash_map<std::string, RouterEventGroup> groups_;
  void* ctx_ = nullptr;     // zmq context
  void* pub_ = nullptr;     // PUB socket (publisher thread after Start)
  void* replay_ = nullptr;  // ROUTER socket, or nullptr
  int wake_fd_ = -1;        // eventfd: the listener wakes the thread

  mutable absl::Mutex mu_;
  std::vector<CacheEvent> queue_ ABSL_GUARDED_BY(mu_);
  bool overflowed_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;

  mutable absl::Mutex stats_mu_;
  RouterEventStats stats_ ABSL_GUARDED_BY(stats_mu_);

  // Publisher thread only.
  absl::flat_hash_map<BlockKey, Known> known_;
  struct Buffered {
    uint64_t sequence;
    std::string payload;
  };
  struct Topic {
    std::string name;
    uint64_t next_sequence = 0;
    std::deque<Buffered> buffer;  // the last buffer_batches batches, for replay
    // Cached kvd blocks behind each announced id: two blocks of different namespaces can share an
    // id (a block before a prompt's image carries no media key, as in vLLM), so an id is stored
    // when its first block comes and removed when its last goes.
    // Keyed by (id, medium): the same id on another medium is another entry for a router.
    absl::flat_hash_map<std::pair<uint64_t, std::string>, int32_t> live;
  };
  absl::flat_hash_map<std::string, Topic> topics_;  // by pool

  std::thread thread_;  // last: joined first
};

}  // namespace kvd
