// A worker's mapping of one daemon CUDA slab, opened from its IPC handle.
//
// cudaIpcOpenMemHandle is an expensive driver call that grows with the allocation size, so a
// worker opens each slab once and keeps it for its life (the client does). Opening fails when the
// worker cannot see the daemon's process or the device: workers must share the daemon's PID
// namespace (Kubernetes: hostPID or shareProcessNamespace) and have the GPU device files (the
// device plugin); the error says so.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace kvd {

class ImportedCudaSlab {
 public:
  // `handle` is the 64-byte cudaIpcMemHandle_t from ListPools. Opens with
  // cudaIpcMemLazyEnablePeerAccess on `device`.
  static absl::StatusOr<ImportedCudaSlab> Open(int device, const std::string& handle, int64_t size);
  ImportedCudaSlab(ImportedCudaSlab&& o) noexcept;
  ImportedCudaSlab& operator=(ImportedCudaSlab&& o) noexcept;
  ImportedCudaSlab(const ImportedCudaSlab&) = delete;
  ImportedCudaSlab& operator=(const ImportedCudaSlab&) = delete;
  ~ImportedCudaSlab();  // cudaIpcCloseMemHandle

  uint8_t* data() const { return static_cast<uint8_t*>(ptr_); }  // a device pointer
  int64_t size() const { return size_; }
  int device() const { return device_; }

 private:
  ImportedCudaSlab(void* ptr, int64_t size, int device) : ptr_(ptr), size_(size), device_(device) {}
  void Close();
  void* ptr_ = nullptr;
  int64_t size_ = 0;
  int device_ = -1;
};

}  // namespace kvd
