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

#include "absl/status/status.h"
#include "gpu/slab_layout.h"
#include "gpu/unique_fd.h"
#include "proto/vocab/pool_geometry.h"
#include "proto/vocab/types.h"

namespace kvd {

// The device ordinal of `shard` of a pool: PoolGeometry::devices, default shard i on device i.
inline int DeviceOfShard(const PoolGeometry& g, uint32_t shard) {
  return shard < g.devices.size() ? g.devices[shard] : static_cast<int>(shard);
}

struct SlabDescriptor {
  PoolId pool = 0;
  uint32_t shard = 0;
  int device = -1;               // the daemon's CUDA ordinal; -1 for host memory
  std::string device_uuid;       // CUDA: "GPU-…" (workers resolve their own ordinal from it)
  std::string device_pci_bus_id; // CUDA: "0000:17:00.0"
  int64_t size_bytes = 0;        // multiple of 2 MiB
  int fd = -1;                   // host backend: the memfd; cuda vmm: the exported handle (arena's)
  std::string cuda_ipc_handle;   // CUDA backend, allocator ipc: 64 bytes of cudaIpcMemHandle_t
  bool cuda_vmm = false;         // CUDA backend, allocator vmm: `fd` is the allocation's POSIX fd
  std::string memory_id;         // cuda vmm: names the allocation for its whole life, across handoffs
};

// A slab's memory handed to a new arena by a previous kvd process (a memfd on the host backend, a
// VMM fd on CUDA): see HostArena::Create and CudaArena::Create.
struct OfferedSlab {
  PoolId pool = 0;
  uint32_t shard = 0;
  UniqueFd fd;
  std::string memory_id;  // cuda vmm: SlabDescriptor::memory_id in the previous process
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

  // Tier copies (device_arena.cc). A block's contiguous form is [shard][layer][layer block bytes],
  // geometry.block_bytes_all_shards() bytes, whatever the slab layout. OUT_OF_RANGE for a bad
  // pool or index; the backend's copy error otherwise. The caller guarantees nobody writes the
  // block meanwhile (it is cached and immutable, or owned by the request being filled).
  absl::Status ReadBlock(PoolId pool, BlockIndex index, uint8_t* dst) const;
  absl::Status WriteBlock(PoolId pool, BlockIndex index, const uint8_t* src) const;
  // Makes host memory that tier copies use page-locked for fast DMA (cudaHostRegister on the CUDA
  // backend; nothing on the host backend). Unregister before freeing it.
  virtual absl::Status RegisterHostMemory(void* p, int64_t bytes) const { return absl::OkStatus(); }
  virtual void UnregisterHostMemory(void* p) const {}
  const std::vector<PoolGeometry>& geometries() const { return geometries_; }

 protected:
  // The base address of a slab as the backend's copy understands it (host or device pointer).
  virtual uint8_t* SlabBase(PoolId pool, uint32_t shard) const = 0;
  // Copies one shard's block (`region` of the slab at `slab`, on `device`) to or from `buffer`,
  // packed ([layer][layer block bytes]); `to_slab` tells the direction. Returns when done.
  virtual absl::Status CopyBlock(uint8_t* slab, int device, const StridedBlock& region,
                                 uint8_t* buffer, bool to_slab) const = 0;
  std::vector<PoolGeometry> geometries_;  // set by the backend's Create

 private:
  absl::Status CopyBlockAllShards(PoolId pool, BlockIndex index, uint8_t* buffer, bool to_slab) const;
};

}  // namespace kvd
