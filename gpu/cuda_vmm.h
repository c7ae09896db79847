// VmmSlab: a pool slab in device memory allocated with the CUDA driver's virtual-memory API, so
// that the memory is a POSIX file descriptor: passable over a Unix socket (to workers through the
// side socket, to a successor kvd at a hot handoff), alive as long as any process holds the fd or
// a mapping, and mapped by any process with cuMemImportFromShareableHandle. Pools opt in with
// `allocator: vmm` (PoolAllocator::kVmm); the default `ipc` pools stay on cudaMalloc + IPC handles.
//
// Create: cuMemCreate (pinned device memory on one device, requested handle type POSIX fd),
// cuMemAddressReserve + cuMemMap + cuMemSetAccess (read-write from that device), zeroed, then
// cuMemExportToShareableHandle. Import: cuMemImportFromShareableHandle of a received fd, then the
// same reserve/map/access. Sizes are rounded up to the allocation granularity (slab sizes are
// 2 MiB multiples, which is the granularity of current GPUs). Driver entry points come through
// cudaGetDriverEntryPoint (gpu/cuda_device.h): nothing links libcuda, and a machine without a
// driver gets a clear UNAVAILABLE.
//
// The device ordinal is the runtime's, which equals the driver's CUdevice ordinal in one process.
// Compiled only with the CUDA toolkit (KVD_HAVE_CUDA).
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "gpu/unique_fd.h"

namespace kvd {

class VmmSlab {
 public:
  // New zeroed device memory of at least `size` bytes on `device`, with its exported fd.
  static absl::StatusOr<VmmSlab> Create(int device, int64_t size);
  // Maps memory another process exported (`fd` is consumed; the mapping keeps the memory alive).
  // `size` is the size the exporter asked for (rounded up alike).
  static absl::StatusOr<VmmSlab> Import(int device, UniqueFd fd, int64_t size);
  VmmSlab(VmmSlab&& o) noexcept;
  VmmSlab& operator=(VmmSlab&& o) noexcept;
  VmmSlab(const VmmSlab&) = delete;
  VmmSlab& operator=(const VmmSlab&) = delete;
  ~VmmSlab();  // unmaps, frees the address range and releases this process's handle

  uint8_t* data() const { return reinterpret_cast<uint8_t*>(ptr_); }
  int64_t size() const { return size_; }
  int device() const { return device_; }
  // The shareable fd (Create: exported; Import: the one received), owned by this slab.
  int fd() const { return fd_.get(); }

 private:
  VmmSlab() = default;
  // The device's allocation granularity for these slabs.
  absl::StatusOr<size_t> Granularity() const;
  // Reserves size_ bytes of address space, maps handle_ there and makes it read-write from device_.
  absl::Status MapAll(size_t granularity);
  void Reset();

  uint64_t handle_ = 0;  // CUmemGenericAllocationHandle
  uint64_t ptr_ = 0;     // CUdeviceptr of the mapping
  int64_t size_ = 0;     // mapped bytes (rounded to the granularity)
  int device_ = -1;
  UniqueFd fd_;
};

}  // namespace kvd
