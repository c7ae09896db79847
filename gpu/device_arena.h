// DeviceArena owns the KV memory of every pool: one slab per pool per shard, allocated when the
// arena is created and never freed while it lives (a freed-and-reused range can yield a
// byte-identical CUDA IPC handle, and workers keep their mappings for their whole life).
//
// Implementations: HostArena (sealed memfd slabs, shared by passing file descriptors) and
// CudaArena (cudaMalloc slabs, shared by CUDA IPC handles). Thread-safe after construction: all
// accessors are const.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "server/core/types.h"

namespace kvd {

struct SlabDescriptor {
  PoolId pool = 0;
  uint32_t shard = 0;
  int device = -1;               // CUDA ordinal; -1 for host memory
  int64_t size_bytes = 0;        // multiple of 2 MiB
  int fd = -1;                   // host backend: the memfd, owned by the arena
  std::string cuda_ipc_handle;   // CUDA backend: 64 bytes of cudaIpcMemHandle_t
};

class DeviceArena {
 public:
  virtual ~DeviceArena() = default;
  // "host" or "cuda".
  virtual std::string backend() const = 0;
  // Every slab, ordered by (pool, shard).
  virtual const std::vector<SlabDescriptor>& slabs() const = 0;
  // The daemon's own view of a slab's bytes; nullptr where the daemon cannot address them (CUDA).
  virtual void* HostAddress(PoolId pool, uint32_t shard) const = 0;
};

}  // namespace kvd
