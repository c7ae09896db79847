// RouterEventPublisher streams kvd's cache events to cluster routers in the wire format vLLM's
// ZmqEventPublisher uses (and SGLang and the llm-d KV-cache indexer consume):
//
//   PUB socket, one message per batch, three frames:
//     topic                 (options.topic with {node} and {pool} filled in; one topic per pool)
//     sequence number       (8 bytes, big-endian, one counter over all topics, first batch 0)
//     msgpack payload       [timestamp (float seconds), [event, ...], data_parallel_rank]
//   events, arrays led by their type name:
//     ["BlockStored", [block ids], parent id or nil, [token ids], block_size, lora_id (nil), medium]
//     ["BlockRemoved", [block ids], medium]
//     ["AllBlocksCleared"]
//   ROUTER replay socket: a request [identity, "", start sequence (8 bytes BE)] gets every
//   buffered batch from that sequence on as [identity, "", sequence, payload], then
//   [identity, "", -1 (8 bytes), ""] to mark the end.
//
// Block ids are router hashes (router_hash.h), so a router hashing prompts itself matches them.
// Consecutive blocks of one chain stored together become one BlockStored; consecutive removals
// one BlockRemoved. medium: options.device_medium for the device pool (G1), "DISK" for blocks a
// warm restart reloaded onto G3. Demotions and promotions between lower tiers are not announced.
//
// The cache's event listener only queues (never blocks on ZMQ); one thread owns both sockets,
// hashes, encodes, sends and serves replays. Thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/core/event_log.h"
#include "server/events/router_hash.h"

namespace kvd {

class KvCache;

struct RouterEventsOptions {
  // ZMQ endpoint the PUB socket binds, e.g. "tcp://*:5557" or "ipc:///run/kvd/events". Empty
  // disables router events.
  std::string endpoint;
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
  // Batches kept for replay.
  int64_t buffer_batches = 10000;
  // Most events in one batch.
  int64_t max_batch_events = 1024;
  // Events waiting for the publisher thread before new ones are dropped (the router then sees
  // "AllBlocksCleared" and the blocks stored after it).
  int64_t max_queued_events = 1 << 20;
  // ZMQ send high-water mark of the PUB socket (batches).
  int64_t send_hwm = 100000;
  // The medium of device-pool blocks: "GPU" on the CUDA backend, "CPU" on the host backend.
  std::string device_medium = "GPU";
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
  uint64_t last_sequence = 0;      // of the last batch sent (valid when batches > 0)
};

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
  };

  explicit RouterEventPublisher(RouterEventsOptions options);
  void Run();                                             // the publisher thread
  void Publish(std::vector<CacheEvent> events);           // publisher thread only
  void Send(const std::string& pool, const Batch& batch); // publisher thread only
  void ServeReplay();                                     // publisher thread only
  std::string TopicOf(const std::string& pool) const;

  const RouterEventsOptions options_;
  const RouterHasher hasher_;
  KvCache* cache_ = nullptr;
  int listener_ = 0;
  std::vector<std::string> pools_;  // topics an "all cleared" goes to
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
  uint64_t next_sequence_ = 0;
  struct Buffered {
    uint64_t sequence;
    std::string payload;
  };
  std::deque<Buffered> buffer_;

  std::thread thread_;  // last: joined first
};

}  // namespace kvd
