// CudaBlockCopier moves whole KV blocks between a device slab and pinned host memory (the tier
// copies of G1 <-> G2) on its own stream: a gather or scatter of many blocks is one batched
// submission (cudaMemcpyBatchAsync) and one wait, never a host sync per block.
//
// With the layer-major layout a block is `num_layers` separate chunks of layer_block_bytes (one
// per layer array); the host side keeps each block contiguous: [block][layer][layer_block_bytes].
// Streams are passed as opaque pointers so that no CUDA type leaves gpu/.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gpu/slab_layout.h"
#include "proto/vocab/types.h"

namespace kvd {

// Page-locked host memory from cudaHostAlloc, freed on destruction. Move-only.
class PinnedBuffer {
 public:
  static absl::StatusOr<PinnedBuffer> Allocate(int64_t bytes);
  PinnedBuffer(PinnedBuffer&& o) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer();
  uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  PinnedBuffer(uint8_t* d, int64_t s) : data_(d), size_(s) {}
  uint8_t* data_ = nullptr;
  int64_t size_ = 0;
};

// A synchronous cudaMemcpy (cudaMemcpyDefault: any mix of host and device pointers).
absl::Status CudaCopy(void* dst, const void* src, int64_t bytes);

class CudaBlockCopier {
 public:
  // A non-blocking stream on `device`.
  static absl::StatusOr<std::unique_ptr<CudaBlockCopier>> Create(int device);
  ~CudaBlockCopier();

  // Enqueues copies of `blocks` from the device slab at `slab` (laid out by `layout`) into
  // `host`, block i at host + i * block_bytes. REQUIRES: host has blocks.size() * block_bytes.
  absl::Status Gather(const SlabLayout& layout, int32_t num_layers, const uint8_t* slab,
                      absl::Span<const BlockIndex> blocks, uint8_t* host);
  // The reverse: host block i into `blocks[i]` of the slab.
  absl::Status Scatter(const SlabLayout& layout, int32_t num_layers, const uint8_t* host,
                       absl::Span<const BlockIndex> blocks, uint8_t* slab);
  // Waits for everything enqueued so far.
  absl::Status Wait();

 private:
  CudaBlockCopier(int device, void* stream) : device_(device), stream_(stream) {}
  absl::Status Submit(std::vector<void*>& dsts, std::vector<const void*>& srcs,
                      std::vector<size_t>& sizes);
  // One chunk per (block, layer), in the direction given; the pointers are only read from on
  // the source side.
  absl::Status Copy(const SlabLayout& layout, int32_t num_layers, uint8_t* slab,
                    absl::Span<const BlockIndex> blocks, uint8_t* host, bool to_host);
  int device_;
  void* stream_;  // cudaStream_t
};

}  // namespace kvd
