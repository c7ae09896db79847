#include "gpu/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace kvd {

absl::Status CudaStatus(cudaError_t err, absl::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();  // clear the sticky-free error so later calls are not confused
  std::string msg = absl::StrCat(what, ": ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
  switch (err) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return absl::UnavailableError(absl::StrCat(
          msg, " (no usable GPU: check the NVIDIA driver and that /dev/nvidia* are visible; "
               "in Kubernetes, the device plugin must grant the GPU)"));
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace kvd
