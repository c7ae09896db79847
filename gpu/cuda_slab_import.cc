#include "gpu/cuda_slab_import.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gpu/cuda_device.h"
#include "gpu/cuda_status.h"

namespace kvd {

absl::StatusOr<ImportedCudaSlab> ImportedCudaSlab::Open(int device, const std::string& handle,
                                                        int64_t size) {
  cudaIpcMemHandle_t h;
  if (handle.size() != sizeof(h)) {
    return absl::InvalidArgumentError(absl::StrCat("a CUDA IPC handle is ", sizeof(h), " bytes, got ",
                                                   handle.size()));
  }
  std::memcpy(&h, handle.data(), sizeof(h));
  KVD_CUDA_SCOPED_DEVICE(device);
  void* ptr = nullptr;
  absl::Status s = CudaStatus(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess),
                              absl::StrCat("cudaIpcOpenMemHandle on device ", device));
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat(
        s.message(), " (the worker must share the daemon's PID namespace — Kubernetes hostPID or "
                     "shareProcessNamespace — and see the GPU's device files via the device plugin)"));
  }
  return ImportedCudaSlab(ptr, size, device);
}

ImportedCudaSlab::ImportedCudaSlab(ImportedCudaSlab&& o) noexcept
    : ptr_(std::exchange(o.ptr_, nullptr)), size_(o.size_), device_(o.device_) {}

ImportedCudaSlab& ImportedCudaSlab::operator=(ImportedCudaSlab&& o) noexcept {
  if (this != &o) {
    Close();
    ptr_ = std::exchange(o.ptr_, nullptr);
    size_ = o.size_;
    device_ = o.device_;
  }
  return *this;
}

ImportedCudaSlab::~ImportedCudaSlab() { Close(); }

void ImportedCudaSlab::Close() {
  if (ptr_ == nullptr) return;
  ScopedCudaDevice scope(device_);
  cudaIpcCloseMemHandle(ptr_);
  ptr_ = nullptr;
}

}  // namespace kvd
