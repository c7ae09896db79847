#include "gpu/cuda_arena.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "gpu/cuda_status.h"
#include "gpu/slab_layout.h"

namespace kvd {

int DeviceOfShard(const PoolGeometry& g, uint32_t shard) {
  return shard < g.devices.size() ? g.devices[shard] : static_cast<int>(shard);
}

absl::Status ProbeCuda() {
  int count = 0;
  KVD_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (count == 0) return absl::UnavailableError("the CUDA runtime reports no device");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CudaArena>> CudaArena::Create(const std::vector<PoolGeometry>& pools) {
  std::unique_ptr<CudaArena> arena(new CudaArena());
  arena->geometries_ = pools;
  int count = 0;
  KVD_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  for (PoolId p = 0; p < pools.size(); ++p) {
    const SlabLayout layout(pools[p]);
    for (int32_t shard = 0; shard < pools[p].num_shards; ++shard) {
      const int device = DeviceOfShard(pools[p], shard);
      if (device < 0 || device >= count) {
        return absl::InvalidArgumentError(absl::StrCat("pool '", pools[p].name, "' shard ", shard,
                                                       " wants device ", device, "; this node has ",
                                                       count));
      }
      KVD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
      void* ptr = nullptr;
      const int64_t size = layout.slab_bytes();
      KVD_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr, size),
                               absl::StrCat("cudaMalloc(", size, ") on device ", device));
      arena->device_ptrs_.push_back(ptr);  // freed by the destructor from here on
      KVD_CUDA_RETURN_IF_ERROR(cudaMemset(ptr, 0, size), "cudaMemset");
      cudaIpcMemHandle_t handle;
      KVD_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&handle, ptr), "cudaIpcGetMemHandle");
      SlabDescriptor d;
      d.pool = p;
      d.shard = static_cast<uint32_t>(shard);
      d.device = device;
      d.size_bytes = size;
      d.cuda_ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
      arena->descriptors_.push_back(std::move(d));
    }
  }
  return arena;
}

CudaArena::~CudaArena() {
  for (size_t i = 0; i < device_ptrs_.size(); ++i) {
    if (i < descriptors_.size()) cudaSetDevice(descriptors_[i].device);
    cudaFree(device_ptrs_[i]);
  }
}

void* CudaArena::DeviceAddress(PoolId pool, uint32_t shard) const {
  for (size_t i = 0; i < descriptors_.size(); ++i) {
    if (descriptors_[i].pool == pool && descriptors_[i].shard == shard) return device_ptrs_[i];
  }
  return nullptr;
}

absl::Status CudaArena::RegisterHostMemory(void* p, int64_t bytes) const {
  return CudaStatus(cudaHostRegister(p, static_cast<size_t>(bytes), cudaHostRegisterPortable),
                    absl::StrCat("cudaHostRegister(", bytes, " bytes)"));
}

void CudaArena::UnregisterHostMemory(void* p) const { cudaHostUnregister(p); }

absl::Status CudaArena::CopyChunk(void* dst, const void* src, int64_t bytes, bool) const {
  // cudaMemcpyDefault: unified addressing tells the direction; tier copies are synchronous here.
  return CudaStatus(cudaMemcpy(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault), "cudaMemcpy");
}

}  // namespace kvd
