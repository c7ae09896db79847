// UcxNode is this kvd's UCX endpoint for peer transfer: one UCX context and worker, every slab of
// every transferable pool mapped once (ucp_mem_map, remote read only: peers can read a slab,
// never write it), and the one-sided gets a pull issues into this kvd's own slabs.
//
// UCX chooses the transport (TCP and shared memory on Debian's build; RDMA, and CUDA memory with a
// CUDA-aware build, elsewhere; UCX_TLS narrows it). A pool is transferable when its memory is
// host memory, or CUDA memory and this UCX reports CUDA among its memory types; otherwise
// Transferable() names the reason and nothing of the pool is mapped.
//
// A progress thread serves peers' reads: on TCP and shared memory UCX emulates RMA with active
// messages, so a node's worker must progress for its slabs to be read. It sleeps on the worker's
// event fd (UCP_FEATURE_WAKEUP) between events.
//
// Thread-safe: the worker is created serialized and every UCX call runs under mu_, which guards
// nothing else; gets from several pulls interleave on the one worker. mu_ is held only for a UCX
// call or one progress pass, never across a wait.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gpu/device_arena.h"

namespace kvd {

class UcxNode {
 public:
  // UNAVAILABLE naming the UCX call that failed. `arena` is borrowed and must outlive this.
  static absl::StatusOr<std::unique_ptr<UcxNode>> Create(const DeviceArena* arena);
  ~UcxNode();
  UcxNode(const UcxNode&) = delete;
  UcxNode& operator=(const UcxNode&) = delete;

  // The worker's address, for peers to connect to.
  const std::string& address() const { return address_; }
  // OK, or FAILED_PRECONDITION naming why `pool` cannot be read or written over UCX here.
  absl::Status Transferable(PoolId pool) const;

  // One shard's slab as a peer reaches it. Valid when Transferable(pool).
  struct SlabKey {
    uint64_t address = 0;
    int64_t size_bytes = 0;
    std::string rkey;  // packed remote key
  };
  const SlabKey& slab_key(PoolId pool, uint32_t shard) const { return pools_[pool].slabs[shard].key; }
  // This kvd's own slab base (the destination of gets), by pool and shard.
  uint8_t* local_base(PoolId pool, uint32_t shard) const { return pools_[pool].slabs[shard].base; }

  // One get: `length` bytes of the peer's slab for `shard`, at `remote`, into `local` (inside
  // this kvd's slab of `pool`, shard `shard`).
  struct Read {
    uint32_t shard = 0;
    uint8_t* local = nullptr;
    uint64_t remote = 0;
    int64_t length = 0;
  };
  // Connects to the worker at `peer_address`, unpacks one remote key per shard (`rkeys`) and
  // issues every read, all in flight at once; returns when all completed. `on_read` (may be
  // empty) is called with the index of each read as it completes, on this thread without mu_;
  // an error it returns ends the transfer like a failed read. On error or at
  // `deadline` it closes the connection by force and waits until no read can still land, so that
  // after it returns nothing writes to the destination any more (INTERNAL if that wait itself
  // gave out: the caller must then never reuse the destination). INVALID_ARGUMENT for a remote
  // key UCX cannot unpack; UNAVAILABLE for a connection or read error; DEADLINE_EXCEEDED.
  absl::Status Get(const std::string& peer_address, PoolId pool, const std::vector<std::string>& rkeys,
                   const std::vector<Read>& reads, absl::Time deadline,
                   const std::function<absl::Status(size_t read)>& on_read = {}) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct MappedSlab {
    void* memh = nullptr;  // ucp_mem_h
    uint8_t* base = nullptr;
    SlabKey key;
  };
  struct MappedPool {
    std::string refusal;  // empty: transferable
    std::vector<MappedSlab> slabs;
  };
  UcxNode() = default;
  // Progresses the worker once; true when it did something.
  bool ProgressOnce() ABSL_LOCKS_EXCLUDED(mu_);
  void ProgressLoop() ABSL_LOCKS_EXCLUDED(mu_);

  void* context_ = nullptr;  // ucp_context_h
  void* worker_ = nullptr;   // ucp_worker_h
  std::string address_;
  std::vector<MappedPool> pools_;  // by PoolId; fixed after Create
  mutable absl::Mutex mu_;         // serializes UCX calls on context_ and worker_
  int event_fd_ = -1;              // the worker's (owned by UCX)
  std::atomic<bool> stop_{false};
  std::atomic<int> active_gets_{0};  // Gets driving the worker now: the progress thread waits
  std::thread progress_;
};

}  // namespace kvd
