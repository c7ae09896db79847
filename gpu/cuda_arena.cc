#include "gpu/cuda_arena.h"

#include <cuda_runtime_api.h>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gpu/cuda_device.h"
#include "gpu/cuda_status.h"
#include "proto/vocab/status_macros.h"
#include "gpu/slab_layout.h"

namespace kvd {

absl::Status ProbeCuda() {
  KVD_ASSIGN_OR_RETURN(std::vector<DeviceIdentity> devices, ListCudaDevices());
  if (devices.empty()) {
    return absl::UnavailableError(absl::StrCat("the CUDA runtime reports no device (NVIDIA driver ",
                                               CudaVersionString(CudaDriverVersion()), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CudaArena>> CudaArena::Create(const std::vector<PoolGeometry>& pools,
                                                             std::vector<OfferedSlab> offered) {
  std::unique_ptr<CudaArena> arena(new CudaArena());
  arena->geometries_ = pools;
  KVD_ASSIGN_OR_RETURN(std::vector<DeviceIdentity> identities, ListCudaDevices());
  const int count = static_cast<int>(identities.size());
  for (PoolId p = 0; p < pools.size(); ++p) {
    const SlabLayout layout(pools[p]);
    for (int32_t shard = 0; shard < pools[p].num_shards; ++shard) {
      const int device = DeviceOfShard(pools[p], shard);
      if (device < 0 || device >= count) {
        return absl::InvalidArgumentError(absl::StrCat("pool '", pools[p].name, "' shard ", shard,
                                                       " wants device ", device, "; this node has ",
                                                       count));
      }
      KVD_CUDA_SCOPED_DEVICE(device);
      SlabDescriptor d;
      d.pool = p;
      d.shard = static_cast<uint32_t>(shard);
      d.device = device;
      d.device_uuid = identities[device].uuid;
      d.device_pci_bus_id = identities[device].pci_bus_id;
      int64_t size = layout.slab_bytes();
      if (pools[p].allocator == PoolAllocator::kVmm) {
        UniqueFd kept;
        for (OfferedSlab& o : offered) {
          if (o.pool == p && o.shard == static_cast<uint32_t>(shard) && o.fd.valid()) {
            kept = std::move(o.fd);
            d.memory_id = o.memory_id;
          }
        }
        // Workers tell kept memory from new by this id (their mappings of kept memory stay).
        if (d.memory_id.empty()) d.memory_id = absl::StrFormat("%016x%016x", absl::Uniform<uint64_t>(absl::BitGen()),
                                                               absl::Uniform<uint64_t>(absl::BitGen()));
        const bool adopting = kept.valid();
        KVD_ASSIGN_OR_RETURN(VmmSlab slab, adopting ? VmmSlab::Import(device, std::move(kept), size)
                                                    : VmmSlab::Create(device, size));
        arena->adopted_ += adopting ? 1 : 0;
        size = slab.size();
        d.cuda_vmm = true;
        d.fd = slab.fd();
        arena->device_ptrs_.push_back(slab.data());
        arena->vmm_.push_back(std::make_unique<VmmSlab>(std::move(slab)));
      } else {
        void* ptr = nullptr;
        KVD_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr, size),
                                 absl::StrCat("cudaMalloc(", size, ") on device ", device));
        arena->device_ptrs_.push_back(ptr);  // freed by the destructor from here on
        arena->vmm_.push_back(nullptr);
        KVD_CUDA_RETURN_IF_ERROR(cudaMemset(ptr, 0, size), "cudaMemset");
        cudaIpcMemHandle_t handle;
        KVD_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&handle, ptr), "cudaIpcGetMemHandle");
        d.cuda_ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
      }
      d.size_bytes = size;
      arena->descriptors_.push_back(std::move(d));
      if (!arena->movers_.contains(device)) {
        KVD_ASSIGN_OR_RETURN(std::unique_ptr<CudaBlockCopier> copier, CudaBlockCopier::Create(device));
        arena->movers_[device] = Mover{std::make_unique<std::mutex>(), std::move(copier)};
      }
    }
  }
  return arena;
}

CudaArena::~CudaArena() {
  movers_.clear();
  vmm_.clear();  // unmaps and releases this process's handles; the memory lives while others hold it
  for (size_t i = 0; i < device_ptrs_.size(); ++i) {
    if (i < descriptors_.size() && descriptors_[i].cuda_vmm) continue;
    ScopedCudaDevice scope(i < descriptors_.size() ? descriptors_[i].device : 0);
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

absl::Status CudaArena::CopyBlock(uint8_t* slab, int device, const StridedBlock& region,
                                  uint8_t* buffer, bool to_slab) const {
  auto it = movers_.find(device);
  if (it == movers_.end()) return absl::InternalError(absl::StrCat("no mover for device ", device));
  std::lock_guard<std::mutex> lock(*it->second.mu);
  KVD_RETURN_IF_ERROR(it->second.copier->Enqueue(slab, region, buffer, to_slab));
  return it->second.copier->Wait();
}

}  // namespace kvd
