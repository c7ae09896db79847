#include "server/core/key_table.h"

#include <algorithm>
#include <cstdlib>

#include <sys/mman.h>

#include "proto/vocab/status_macros.h"

namespace kvd {
namespace {

constexpr int kMinLog2 = 4;
constexpr int kMaxLog2 = 31;

int Log2SlotsFor(int64_t entries) {
  int log2 = kMinLog2;
  while (log2 < kMaxLog2 && ((int64_t{1} << log2) / 4 * 3) < entries) ++log2;
  return log2;
}

}  // namespace

void KeyTable::FreeSlots::operator()(Slot* p) const { std::free(p); }

std::unique_ptr<KeyTable::Slot[], KeyTable::FreeSlots> KeyTable::AllocateSlots(size_t n) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes = n * sizeof(Slot);
  Slot* p;
  if (bytes >= kHuge) {
    p = static_cast<Slot*>(std::aligned_alloc(kHuge, bytes));
    if (p != nullptr) madvise(p, bytes, MADV_HUGEPAGE);
  } else {
    p = static_cast<Slot*>(std::malloc(bytes));
  }
  KVD_CHECK(p != nullptr);
  std::fill_n(p, n, Slot{0, kNone});
  return std::unique_ptr<Slot[], FreeSlots>(p);
}

KeyTable::KeyTable(int64_t expected) {
  const int log2 = Log2SlotsFor(expected);
  const size_t n = size_t{1} << log2;
  slots_ = AllocateSlots(n);
  mask_ = n - 1;
  shift_ = 32 - log2;
}

void KeyTable::EraseAt(size_t hole) {
  // Backward shift: pull later entries of the run into the hole unless their home lies in the
  // cyclic range (hole, j], where moving them would put them before their home.
  for (size_t j = (hole + 1) & mask_; slots_[j].value != kNone; j = (j + 1) & mask_) {
    const size_t home = Home(slots_[j].tag);
    const bool home_in_range = hole < j ? (hole < home && home <= j) : (hole < home || home <= j);
    if (!home_in_range) {
      slots_[hole] = slots_[j];
      hole = j;
    }
  }
  slots_[hole].value = kNone;
  --size_;
}

void KeyTable::Grow() {
  const size_t old_n = mask_ + 1;
  KVD_CHECK(shift_ > 32 - kMaxLog2);
  std::unique_ptr<Slot[], FreeSlots> old = std::move(slots_);
  const size_t n = old_n * 2;
  slots_ = AllocateSlots(n);
  mask_ = n - 1;
  --shift_;
  for (size_t i = 0; i < old_n; ++i) {
    if (old[i].value == kNone) continue;
    size_t j = Home(old[i].tag);
    while (slots_[j].value != kNone) j = (j + 1) & mask_;
    slots_[j] = old[i];
  }
}

}  // namespace kvd
