// What the CUDA runtime shows this process — devices with their identities, the driver's version —
// and ScopedCudaDevice, which selects a device for a library call and leaves the caller's current
// device (its current context) exactly as it found it.
//
// Rules every CUDA call in kvd's libraries follows (a worker's engine owns its current device):
//  - select the device of the memory touched through ScopedCudaDevice, never a bare cudaSetDevice;
//  - never create a context on a GPU the process does not use: listing devices reads properties
//    only (no context), and the scope restores the caller's *context* (possibly none) through the
//    driver's cuCtxGetCurrent/cuCtxSetCurrent, not a device ordinal, so restoring never creates
//    a primary context on the caller's old device.
// Compiled only with the CUDA toolkit (KVD_HAVE_CUDA).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu/device_identity.h"

namespace kvd {

// The devices this process sees, in ordinal order (UUID, PCI bus id, name). UNAVAILABLE when the
// runtime cannot be used (no driver: the message names the driver version, 0 when absent).
absl::StatusOr<std::vector<DeviceIdentity>> ListCudaDevices();

// cudaDriverGetVersion (e.g. 13000 for 13.0); 0 when no NVIDIA driver is installed.
int CudaDriverVersion();
// The runtime kvd was built with (CUDART_VERSION), e.g. 13000.
int CudaRuntimeVersion();
// "13.0" from 13000; "none" for 0.
std::string CudaVersionString(int version);
// A CUDA driver API entry point fetched through the runtime (cudaGetDriverEntryPoint, version-
// guarded), so that nothing links libcuda; nullptr when the driver lacks it or is absent.
void* CudaDriverSymbol(const char* name);

class ScopedCudaDevice {
 public:
  // Makes `device` current on this thread (its primary context) until destruction; status() says
  // whether that worked. A no-op when it is current already.
  explicit ScopedCudaDevice(int device);
  ~ScopedCudaDevice();
  ScopedCudaDevice(const ScopedCudaDevice&) = delete;
  ScopedCudaDevice& operator=(const ScopedCudaDevice&) = delete;
  const absl::Status& status() const { return status_; }

 private:
  void* saved_context_ = nullptr;  // CUcontext; nullptr: the thread had none
  bool restore_ = false;
  int previous_ordinal_ = -1;      // restored with cudaSetDevice when the driver API is missing
  absl::Status status_;
};

}  // namespace kvd

// Returns from the enclosing function when `device` cannot be selected; the scope lasts to the
// end of the enclosing block.
#define KVD_CUDA_SCOPED_DEVICE(device)                                    \
  ::kvd::ScopedCudaDevice kvd_scoped_device_(device);                     \
  if (!kvd_scoped_device_.status().ok()) return kvd_scoped_device_.status()
