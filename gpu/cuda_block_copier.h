// CudaBlockCopier moves whole KV blocks between a device slab and host memory (the tier copies of
// G1 <-> G2) on its own non-blocking stream. It is the one copier of the CUDA path: the daemon's
// CudaArena moves every tier copy through it, and kvd_cuda_bench measures it.
//
// A block of one shard is a strided region (SlabLayout::Block): with the layer-major layout,
// num_layers rows of layer_block_bytes, capacity * layer_block_bytes apart. Each block is one
// cudaMemcpy2DAsync (the DMA engine walks the stride), never a copy per layer; a gather or scatter
// of many blocks is enqueued back to back and waited for once. The host side keeps each block
// contiguous: [block][layer][layer_block_bytes]; pinned host memory (PinnedBuffer, or the host
// tier's cudaHostRegister'ed slots) lets the copies run asynchronously.
//
// Every call selects the copier's device through ScopedCudaDevice and leaves the caller's current
// device as it found it.
// Streams are passed as opaque pointers so that no CUDA type leaves gpu/.
#pragma once

#include <cstdint>
#include <memory>

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

// A synchronous cudaMemcpy (cudaMemcpyDefault: any mix of host and device pointers) with `device`
// current: memory opened from another process's IPC handle is mapped in that device's context
// only, and the calling thread may have another device (or none) current.
absl::Status CudaCopy(int device, void* dst, const void* src, int64_t bytes);

class CudaBlockCopier {
 public:
  // A non-blocking stream on `device`.
  static absl::StatusOr<std::unique_ptr<CudaBlockCopier>> Create(int device);
  ~CudaBlockCopier();

  // Enqueues copies of `blocks` from the device slab at `slab` (laid out by `layout`) into
  // `host`, block i at host + i * block_bytes. REQUIRES: host has blocks.size() * block_bytes.
  absl::Status Gather(const SlabLayout& layout, const uint8_t* slab,
                      absl::Span<const BlockIndex> blocks, uint8_t* host);
  // The reverse: host block i into `blocks[i]` of the slab.
  absl::Status Scatter(const SlabLayout& layout, const uint8_t* host,
                       absl::Span<const BlockIndex> blocks, uint8_t* slab);
  // Enqueues one region: `region` of the slab at `slab` to or from `buffer` (packed rows).
  absl::Status Enqueue(uint8_t* slab, const StridedBlock& region, uint8_t* buffer, bool to_slab);
  // Waits for everything enqueued so far.
  absl::Status Wait();

 private:
  CudaBlockCopier(int device, void* stream) : device_(device), stream_(stream) {}
  absl::Status Copy(const SlabLayout& layout, uint8_t* slab, absl::Span<const BlockIndex> blocks,
                    uint8_t* host, bool to_slab);
  int device_;
  void* stream_;  // cudaStream_t
};

}  // namespace kvd
