#include "gpu/cuda_block_copier.h"

#include <cuda_runtime_api.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "gpu/cuda_status.h"

namespace kvd {

absl::Status CudaCopy(void* dst, const void* src, int64_t bytes) {
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
  KVD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  cudaStream_t stream = nullptr;
  KVD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                           "cudaStreamCreateWithFlags");
  return std::unique_ptr<CudaBlockCopier>(new CudaBlockCopier(device, stream));
}

CudaBlockCopier::~CudaBlockCopier() {
  cudaSetDevice(device_);
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

absl::Status CudaBlockCopier::Submit(std::vector<void*>& dsts, std::vector<const void*>& srcs,
                                     std::vector<size_t>& sizes) {
  if (dsts.empty()) return absl::OkStatus();
  KVD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  auto stream = static_cast<cudaStream_t>(stream_);
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t attr_index = 0;
  cudaError_t err = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attr,
                                         &attr_index, 1, stream);
  if (err == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();
  // Older drivers may not support batched copies: one async copy per chunk, still no host sync.
  for (size_t i = 0; i < dsts.size(); ++i) {
    KVD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, stream),
                             "cudaMemcpyAsync");
  }
  return absl::OkStatus();
}

absl::Status CudaBlockCopier::Copy(const SlabLayout& layout, int32_t num_layers, uint8_t* slab,
                                   absl::Span<const BlockIndex> blocks, uint8_t* host,
                                   bool to_host) {
  const int64_t chunk = layout.layer_block_bytes();
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  for (size_t i = 0; i < blocks.size(); ++i) {
    for (int32_t l = 0; l < num_layers; ++l) {
      uint8_t* device_chunk = slab + layout.OffsetUnchecked(blocks[i], l);
      uint8_t* host_chunk = host + (static_cast<int64_t>(i) * num_layers + l) * chunk;
      dsts.push_back(to_host ? host_chunk : device_chunk);
      srcs.push_back(to_host ? device_chunk : host_chunk);
      sizes.push_back(static_cast<size_t>(chunk));
    }
  }
  return Submit(dsts, srcs, sizes);
}

absl::Status CudaBlockCopier::Gather(const SlabLayout& layout, int32_t num_layers,
                                     const uint8_t* slab, absl::Span<const BlockIndex> blocks,
                                     uint8_t* host) {
  return Copy(layout, num_layers, const_cast<uint8_t*>(slab), blocks, host, /*to_host=*/true);
}

absl::Status CudaBlockCopier::Scatter(const SlabLayout& layout, int32_t num_layers,
                                      const uint8_t* host, absl::Span<const BlockIndex> blocks,
                                      uint8_t* slab) {
  return Copy(layout, num_layers, slab, blocks, const_cast<uint8_t*>(host), /*to_host=*/false);
}

absl::Status CudaBlockCopier::Wait() {
  return CudaStatus(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), "cudaStreamSynchronize");
}

}  // namespace kvd
