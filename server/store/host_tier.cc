#include "server/store/host_tier.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace kvd {

absl::StatusOr<std::unique_ptr<HostTier>> HostTier::Create(int64_t capacity, int64_t slot_bytes,
                                                           const DeviceArena* arena) {
  if (slot_bytes <= 0 || capacity < slot_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("tiers.host_bytes (", capacity,
                                                   ") must hold at least one block of ",
                                                   slot_bytes, " bytes"));
  }
  const int64_t slots = capacity / slot_bytes;
  const int64_t bytes = slots * slot_bytes;
  void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);  // pre-faulted, like the arena
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of the host tier (", bytes, " bytes): ", std::strerror(errno)));
  }
  bool pinned = false;
  if (arena != nullptr && arena->backend() == "cuda") {
    absl::Status s = arena->RegisterHostMemory(p, bytes);
    if (!s.ok()) {
      munmap(p, static_cast<size_t>(bytes));
      return s;
    }
    pinned = true;
  }
  return std::unique_ptr<HostTier>(
      new HostTier(static_cast<uint8_t*>(p), bytes, slot_bytes, arena, pinned));
}

HostTier::HostTier(uint8_t* base, int64_t bytes, int64_t slot_bytes, const DeviceArena* arena,
                   bool pinned)
    : base_(base), mapped_bytes_(bytes), slot_bytes_(slot_bytes),
      num_slots_(bytes / slot_bytes), arena_(arena), pinned_(pinned) {
  free_.reserve(static_cast<size_t>(num_slots_));
  for (int64_t i = num_slots_ - 1; i >= 0; --i) free_.push_back(static_cast<uint32_t>(i));
}

HostTier::~HostTier() {
  if (pinned_) arena_->UnregisterHostMemory(base_);
  munmap(base_, static_cast<size_t>(mapped_bytes_));
}

std::optional<std::vector<uint32_t>> HostTier::Allocate(int64_t n) {
  if (n > free_slots()) return std::nullopt;
  std::vector<uint32_t> out(free_.end() - n, free_.end());
  free_.resize(free_.size() - static_cast<size_t>(n));
  return out;
}

void HostTier::Free(absl::Span<const uint32_t> slots) {
  free_.insert(free_.end(), slots.begin(), slots.end());
}

void HostTier::Gather(absl::Span<const uint32_t> slots, int64_t bytes, uint8_t* out) const {
  for (uint32_t s : slots) {
    const int64_t n = std::min(bytes, slot_bytes_);
    std::memcpy(out, slot(s), static_cast<size_t>(n));
    out += n;
    bytes -= n;
  }
}

void HostTier::Scatter(absl::Span<const uint32_t> slots, const uint8_t* in, int64_t bytes) const {
  for (uint32_t s : slots) {
    const int64_t n = std::min(bytes, slot_bytes_);
    std::memcpy(slot(s), in, static_cast<size_t>(n));
    in += n;
    bytes -= n;
  }
}

}  // namespace kvd
