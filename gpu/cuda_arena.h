// CudaArena: KV slabs in GPU memory, shared with workers through CUDA IPC handles.
//
// Each pool gets one cudaMalloc allocation per shard, on that shard's device (PoolGeometry::
// devices, default shard i on device i), sized to SlabLayout::slab_bytes() — a multiple of 2 MiB,
// so an IPC handle never exposes a neighbouring allocation. Each slab's cudaIpcGetMemHandle (64
// bytes) travels in ListPools; workers open it once (gpu/cuda_slab_import.h).
//
// Pools with `allocator: vmm` (PoolAllocator::kVmm) are allocated with the driver's virtual-memory
// API instead (gpu/cuda_vmm.h): each slab is a POSIX fd, which workers receive through the side
// socket like host memfds and import, and which a hot handoff passes to the next kvd: Create
// imports an `offered` fd for a slab instead of allocating (the memory and its bytes are kept).
//
// Slabs are freed only when the arena is destroyed, after every worker is gone: a freed-and-reused
// range can yield a byte-identical IPC handle, so a worker holding a stale mapping would silently
// alias new memory.
//
// Compiled only when the CUDA toolkit is found (KVD_HAVE_CUDA); links CUDA::cudart_static.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu/cuda_block_copier.h"
#include "gpu/cuda_vmm.h"
#include "gpu/device_arena.h"
#include "gpu/device_identity.h"
#include "proto/vocab/pool_geometry.h"

namespace kvd {

// OK when the CUDA runtime sees at least one device; UNAVAILABLE naming the CUDA error otherwise.
absl::Status ProbeCuda();

class CudaArena final : public DeviceArena {
 public:
  // `offered`: VMM slab fds handed over by a previous kvd (consumed; those of no vmm slab closed).
  static absl::StatusOr<std::unique_ptr<CudaArena>> Create(const std::vector<PoolGeometry>& pools,
                                                           std::vector<OfferedSlab> offered = {});
  ~CudaArena() override;

  std::string backend() const override { return "cuda"; }
  // VMM slabs imported from `offered` (memory kept from a previous process).
  int adopted() const { return adopted_; }
  const std::vector<SlabDescriptor>& slabs() const override { return descriptors_; }
  void* HostAddress(PoolId, uint32_t) const override { return nullptr; }
  // The daemon's device pointer of a slab (for tier copies), or nullptr.
  void* DeviceAddress(PoolId pool, uint32_t shard) const;
  absl::Status RegisterHostMemory(void* p, int64_t bytes) const override;
  void UnregisterHostMemory(void* p) const override;

 protected:
  uint8_t* SlabBase(PoolId pool, uint32_t shard) const override {
    return static_cast<uint8_t*>(DeviceAddress(pool, shard));
  }
  // One cudaMemcpy2DAsync on the device's mover stream (CudaBlockCopier), then its wait.
  absl::Status CopyBlock(uint8_t* slab, int device, const StridedBlock& region, uint8_t* buffer,
                         bool to_slab) const override;

 private:
  CudaArena() = default;
  // One copier (stream) per device the pools use, each behind its own mutex: tier copies from
  // several threads (demotion, flush, Redis) queue per device rather than share a stream.
  struct Mover {
    std::unique_ptr<std::mutex> mu;
    std::unique_ptr<CudaBlockCopier> copier;
  };
  std::map<int, Mover> movers_;  // by device ordinal; built by Create, read-only after
  std::vector<void*> device_ptrs_;  // parallel to descriptors_
  std::vector<std::unique_ptr<VmmSlab>> vmm_;  // parallel to descriptors_; null for ipc slabs
  int adopted_ = 0;
  std::vector<SlabDescriptor> descriptors_;
};

}  // namespace kvd
