#include "gpu/cuda_block_copier.h"

#include <cuda_runtime_api.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "gpu/cuda_device.h"
#include "gpu/cuda_status.h"
#include "proto/vocab/status_macros.h"

namespace kvd {

absl::Status CudaCopy(int device, void* dst, const void* src, int64_t bytes) {
  KVD_CUDA_SCOPED_DEVICE(device);
  return CudaStatus(cudaMemcpy(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault), "cudaMemcpy");
}

absl::StatusOr<PinnedBuffer> PinnedBuffer::Allocate(int64_t bytes) {
  void* p = nullptr;
  KVD_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, bytes, cudaHostAllocPortable),
                           absl::StrCat("cudaHostAlloc(", bytes, ")"));
  return PinnedBuffer(static_cast<uint8_t*>(p), bytes);
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() {
  if (data_ != nullptr) cudaFreeHost(data_);
}

absl::StatusOr<std::unique_ptr<CudaBlockCopier>> CudaBlockCopier::Create(int device) {
  KVD_CUDA_SCOPED_DEVICE(device);
  cudaStream_t stream = nullptr;
  KVD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                           "cudaStreamCreateWithFlags");
  return std::unique_ptr<CudaBlockCopier>(new CudaBlockCopier(device, stream));
}

CudaBlockCopier::~CudaBlockCopier() {
  ScopedCudaDevice scope(device_);
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

absl::Status CudaBlockCopier::Enqueue(uint8_t* slab, const StridedBlock& region, uint8_t* buffer,
                                      bool to_slab) {
  KVD_CUDA_SCOPED_DEVICE(device_);
  uint8_t* in_slab = slab + region.slab_offset;
  const auto width = static_cast<size_t>(region.row_bytes);
  const auto rows = static_cast<size_t>(region.rows);
  const auto pitch = static_cast<size_t>(region.slab_pitch);
  auto stream = static_cast<cudaStream_t>(stream_);
  KVD_CUDA_RETURN_IF_ERROR(
      to_slab ? cudaMemcpy2DAsync(in_slab, pitch, buffer, width, width, rows, cudaMemcpyDefault, stream)
              : cudaMemcpy2DAsync(buffer, width, in_slab, pitch, width, rows, cudaMemcpyDefault, stream),
      "cudaMemcpy2DAsync");
  return absl::OkStatus();
}

absl::Status CudaBlockCopier::Copy(const SlabLayout& layout, uint8_t* slab,
                                   absl::Span<const BlockIndex> blocks, uint8_t* host, bool to_slab) {
  for (size_t i = 0; i < blocks.size(); ++i) {
    const StridedBlock region = layout.Block(blocks[i]);
    KVD_RETURN_IF_ERROR(Enqueue(slab, region, host + static_cast<int64_t>(i) * region.bytes(), to_slab));
  }
  return absl::OkStatus();
}

absl::Status CudaBlockCopier::Gather(const SlabLayout& layout, const uint8_t* slab,
                                     absl::Span<const BlockIndex> blocks, uint8_t* host) {
  return Copy(layout, const_cast<uint8_t*>(slab), blocks, host, /*to_slab=*/false);
}

absl::Status CudaBlockCopier::Scatter(const SlabLayout& layout, const uint8_t* host,
                                      absl::Span<const BlockIndex> blocks, uint8_t* slab) {
  return Copy(layout, slab, blocks, const_cast<uint8_t*>(host), /*to_slab=*/true);
}

absl::Status CudaBlockCopier::Wait() {
  KVD_CUDA_SCOPED_DEVICE(device_);
  return CudaStatus(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), "cudaStreamSynchronize");
}

}  // namespace kvd
