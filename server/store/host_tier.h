// HostTier is the memory of G2: one pre-faulted host region of `capacity` bytes cut into slots of
// `slot_bytes` (the largest block of any pool), page-locked through the arena when the backend
// is CUDA so that G1 <-> G2 copies run at DMA speed. A block takes one slot; an object takes as
// many as its size needs (not contiguous). HostTier only hands out and takes back slots; TierStore
// decides what lives in them.
// Thread-compatible: TierStore serializes access.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gpu/device_arena.h"

namespace kvd {

class HostTier {
 public:
  // RESOURCE_EXHAUSTED/INTERNAL naming the failing call. `arena` (borrowed) pins the region.
  static absl::StatusOr<std::unique_ptr<HostTier>> Create(int64_t capacity, int64_t slot_bytes,
                                                          const DeviceArena* arena);
  ~HostTier();
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  int64_t slot_bytes() const { return slot_bytes_; }
  int64_t num_slots() const { return num_slots_; }
  int64_t free_slots() const { return static_cast<int64_t>(free_.size()); }
  int64_t SlotsFor(int64_t bytes) const { return (bytes + slot_bytes_ - 1) / slot_bytes_; }

  // `n` slots, or nullopt when fewer are free (nothing taken).
  std::optional<std::vector<uint32_t>> Allocate(int64_t n);
  void Free(absl::Span<const uint32_t> slots);
  uint8_t* slot(uint32_t i) const { return base_ + int64_t{i} * slot_bytes_; }
  // Copies `bytes` bytes spread over `slots` (in order) to / from contiguous memory.
  void Gather(absl::Span<const uint32_t> slots, int64_t bytes, uint8_t* out) const;
  void Scatter(absl::Span<const uint32_t> slots, const uint8_t* in, int64_t bytes) const;

 private:
  HostTier(uint8_t* base, int64_t bytes, int64_t slot_bytes, const DeviceArena* arena, bool pinned);
  uint8_t* base_;
  int64_t mapped_bytes_;
  int64_t slot_bytes_;
  int64_t num_slots_;
  const DeviceArena* arena_;
  bool pinned_;
  std::vector<uint32_t> free_;
};

}  // namespace kvd
