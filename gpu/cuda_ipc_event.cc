#include "gpu/cuda_ipc_event.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gpu/cuda_device.h"
#include "gpu/cuda_status.h"

namespace kvd {

absl::StatusOr<InterprocessEvent> InterprocessEvent::Create(int device) {
  KVD_CUDA_SCOPED_DEVICE(device);
  cudaEvent_t event = nullptr;
  KVD_CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&event, cudaEventInterprocess | cudaEventDisableTiming),
      "cudaEventCreateWithFlags(interprocess)");
  cudaIpcEventHandle_t h;
  absl::Status s = CudaStatus(cudaIpcGetEventHandle(&h, event), "cudaIpcGetEventHandle");
  if (!s.ok()) {
    cudaEventDestroy(event);
    return s;
  }
  return InterprocessEvent(event, device, std::string(reinterpret_cast<const char*>(&h), sizeof(h)));
}

absl::StatusOr<InterprocessEvent> InterprocessEvent::Open(int device, const std::string& handle) {
  cudaIpcEventHandle_t h;
  if (handle.size() != sizeof(h)) {
    return absl::InvalidArgumentError(absl::StrCat("a CUDA IPC event handle is ", sizeof(h), " bytes"));
  }
  std::memcpy(&h, handle.data(), sizeof(h));
  KVD_CUDA_SCOPED_DEVICE(device);
  cudaEvent_t event = nullptr;
  KVD_CUDA_RETURN_IF_ERROR(cudaIpcOpenEventHandle(&event, h), "cudaIpcOpenEventHandle");
  return InterprocessEvent(event, device, handle);
}

InterprocessEvent::InterprocessEvent(InterprocessEvent&& o) noexcept
    : event_(std::exchange(o.event_, nullptr)), device_(o.device_), handle_(std::move(o.handle_)) {}

InterprocessEvent& InterprocessEvent::operator=(InterprocessEvent&& o) noexcept {
  if (this != &o) {
    Destroy();
    event_ = std::exchange(o.event_, nullptr);
    device_ = o.device_;
    handle_ = std::move(o.handle_);
  }
  return *this;
}

InterprocessEvent::~InterprocessEvent() { Destroy(); }

void InterprocessEvent::Destroy() {
  if (event_ == nullptr) return;
  ScopedCudaDevice scope(device_);
  cudaEventDestroy(static_cast<cudaEvent_t>(event_));
  event_ = nullptr;
}

absl::Status InterprocessEvent::Record(void* stream) {
  KVD_CUDA_SCOPED_DEVICE(device_);  // an event records only on a stream of its own device
  return CudaStatus(cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(stream)),
                    "cudaEventRecord");
}

absl::Status InterprocessEvent::Synchronize() {
  KVD_CUDA_SCOPED_DEVICE(device_);
  return CudaStatus(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)), "cudaEventSynchronize");
}

absl::Status InterprocessEvent::StreamWait(void* stream) {
  return CudaStatus(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event_), 0),
                    "cudaStreamWaitEvent");
}

}  // namespace kvd
