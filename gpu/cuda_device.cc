#include "gpu/cuda_device.h"

#include <cuda_runtime_api.h>

#include <array>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "gpu/cuda_status.h"

namespace kvd {
namespace {

// Driver entry points fetched through the runtime, so that nothing links libcuda directly (the
// daemon must start where no driver is installed). CUresult is an int-sized enum; CUcontext a
// pointer.
using CtxGetCurrentFn = int (*)(void** ctx);
using CtxSetCurrentFn = int (*)(void* ctx);

struct DriverContextApi {
  CtxGetCurrentFn get = nullptr;
  CtxSetCurrentFn set = nullptr;
};

}  // namespace

void* CudaDriverSymbol(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess) {
#else
  if (cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &found) != cudaSuccess) {
#endif
    (void)cudaGetLastError();
    return nullptr;
  }
  return found == cudaDriverEntryPointSuccess ? fn : nullptr;
}

namespace {

const DriverContextApi& ContextApi() {
  static DriverContextApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    api.get = reinterpret_cast<CtxGetCurrentFn>(CudaDriverSymbol("cuCtxGetCurrent"));
    api.set = reinterpret_cast<CtxSetCurrentFn>(CudaDriverSymbol("cuCtxSetCurrent"));
  });
  return api;
}

}  // namespace

int CudaDriverVersion() {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return v;
}

int CudaRuntimeVersion() { return CUDART_VERSION; }

std::string CudaVersionString(int version) {
  if (version <= 0) return "none";
  return absl::StrCat(version / 1000, ".", (version % 1000) / 10);
}

absl::StatusOr<std::vector<DeviceIdentity>> ListCudaDevices() {
  int count = 0;
  if (cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::UnavailableError(absl::StrCat(
        "CUDA is not usable: ", cudaGetErrorName(err), " (NVIDIA driver ",
        CudaVersionString(CudaDriverVersion()), ", kvd's runtime ",
        CudaVersionString(CudaRuntimeVersion()), ")"));
  }
  std::vector<DeviceIdentity> out;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    KVD_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, i),
                             absl::StrCat("cudaGetDeviceProperties(", i, ")"));
    DeviceIdentity d;
    d.ordinal = i;
    std::array<uint8_t, 16> uuid{};
    std::memcpy(uuid.data(), prop.uuid.bytes, uuid.size());
    d.uuid = FormatGpuUuid(uuid);
    char bus[32] = {};
    if (cudaDeviceGetPCIBusId(bus, sizeof(bus), i) == cudaSuccess) {
      d.pci_bus_id = CanonicalPciBusId(bus);
    } else {
      (void)cudaGetLastError();
    }
    d.name = prop.name;
    out.push_back(std::move(d));
  }
  return out;
}

ScopedCudaDevice::ScopedCudaDevice(int device) {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == device) {
    // Selected already; cudaGetDevice answers 0 on a thread with no context, so make sure the
    // context exists only when the caller chose this device (the runtime creates it lazily).
    return;
  }
  (void)cudaGetLastError();
  const DriverContextApi& api = ContextApi();
  if (api.get != nullptr && api.set != nullptr && api.get(&saved_context_) == 0) {
    restore_ = true;
  } else {
    previous_ordinal_ = current;  // no driver entry points: fall back to the ordinal
  }
  status_ = CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
}

ScopedCudaDevice::~ScopedCudaDevice() {
  if (restore_) {
    ContextApi().set(saved_context_);
  } else if (previous_ordinal_ >= 0) {
    (void)cudaSetDevice(previous_ordinal_);
  }
}

}  // namespace kvd
