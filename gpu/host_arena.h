// HostArena: KV slabs in host memory, one sealed memfd per pool per shard.
//
// Each slab is memfd_create'd, sized to SlabLayout::slab_bytes(), mapped MAP_SHARED and
// pre-faulted (so the first request does not pay for page faults), then sealed against shrinking
// and growing: a worker that maps it can never see it truncated under its feet. Workers receive
// the fd over the side socket (SCM_RIGHTS) and map it themselves.
//
// Adoption: Create may be handed memfds a previous kvd process made (systemd's fd store keeps
// them across a crash restart). A slab adopts one when it is a memfd of exactly the slab's size
// sealed as above; its bytes are kept (workers that mapped it keep valid mappings) but their
// meaning is not: the daemon starts with an empty index, every block free.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu/device_arena.h"
#include "gpu/unique_fd.h"
#include "proto/vocab/pool_geometry.h"

namespace kvd {

class HostArena final : public DeviceArena {
 public:
  // A memfd offered for slab (pool, shard).
  using Offered = OfferedSlab;
  // One slab per shard of every pool, adopting from `offered` what fits (see above); the rest of
  // `offered` is closed. RESOURCE_EXHAUSTED/INTERNAL with the failing syscall named.
  static absl::StatusOr<std::unique_ptr<HostArena>> Create(const std::vector<PoolGeometry>& pools,
                                                           std::vector<Offered> offered = {});
  ~HostArena() override;

  std::string backend() const override { return "host"; }
  const std::vector<SlabDescriptor>& slabs() const override { return descriptors_; }
  void* HostAddress(PoolId pool, uint32_t shard) const override;
  // Slabs adopted from `offered` (memory kept from a previous process).
  int adopted() const { return adopted_; }

 protected:
  uint8_t* SlabBase(PoolId pool, uint32_t shard) const override {
    return static_cast<uint8_t*>(HostAddress(pool, shard));
  }
  absl::Status CopyBlock(uint8_t* slab, int device, const StridedBlock& region, uint8_t* buffer,
                         bool to_slab) const override;

 private:
  struct Slab {
    UniqueFd fd;
    void* base = nullptr;
    int64_t size = 0;
  };
  HostArena() = default;

  std::vector<Slab> slabs_;  // parallel to descriptors_
  std::vector<SlabDescriptor> descriptors_;
  int adopted_ = 0;
};

// A worker's mapping of one slab it received as a file descriptor. Unmaps on destruction.
class MappedSlab {
 public:
  // Maps `size` bytes of `fd` read-write and shared. INTERNAL naming the errno on failure.
  static absl::StatusOr<MappedSlab> Map(UniqueFd fd, int64_t size);
  MappedSlab(MappedSlab&& o) noexcept;
  MappedSlab& operator=(MappedSlab&& o) noexcept;
  MappedSlab(const MappedSlab&) = delete;
  MappedSlab& operator=(const MappedSlab&) = delete;
  ~MappedSlab();

  uint8_t* data() const { return static_cast<uint8_t*>(base_); }
  int64_t size() const { return size_; }

 private:
  MappedSlab(UniqueFd fd, void* base, int64_t size) : fd_(std::move(fd)), base_(base), size_(size) {}
  UniqueFd fd_;
  void* base_ = nullptr;
  int64_t size_ = 0;
};

}  // namespace kvd
