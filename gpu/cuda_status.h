// The one conversion of cudaError_t to absl::Status (DESIGN.md §4: only gpu/ sees cudaError_t).
// The status message keeps the CUDA error's name and text, e.g.
//   "cudaMalloc(2097152) on device 0: cudaErrorMemoryAllocation: out of memory".
// Private to gpu/*.cc: headers outside gpu/ never include this.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvd {

// OK for cudaSuccess. No GPU (cudaErrorNoDevice, cudaErrorInsufficientDriver) is UNAVAILABLE;
// out of memory is RESOURCE_EXHAUSTED; bad arguments INVALID_ARGUMENT; the rest INTERNAL.
absl::Status CudaStatus(cudaError_t err, absl::string_view what);

}  // namespace kvd

#define KVD_CUDA_RETURN_IF_ERROR(call, what)                      \
  do {                                                            \
    ::absl::Status kvd_cuda_status_ = ::kvd::CudaStatus((call), (what)); \
    if (!kvd_cuda_status_.ok()) return kvd_cuda_status_;          \
  } while (0)
