// KeyTable finds 32-bit values (block indices, ring positions) by 128-bit block key with open
// addressing: linear probing and backward-shift deletion, so there are no tombstones and a table
// that churns (the steady state of a full cache) never degrades.
//
// A slot is 8 bytes: a 32-bit tag of the key and the value. The caller keeps the full keys (a
// block's node, a ring entry) and passes `key_of(value)` to read one back, so a lookup touches
// one table line and reads the full key only when a tag matches; a miss usually touches nothing
// else. Keys are XXH3 outputs, already uniform: the tag is 32 of their bits and the home slot a
// Fibonacci hash of the tag (so entries can move and the table can grow from tags alone).
//
// Grows by doubling past 3/4 full (at most 2^31 slots); `expected` entries fit without growing.
// A slot array of 2 MiB or more is 2 MiB-aligned and advised as huge pages (MADV_HUGEPAGE; a
// kernel whose THP mode is "madvise" or "always" backs it with 2 MiB pages): every probe
// is a random access, and with 4 KiB pages a 16 MiB table (an slru pool's, ghosts included)
// misses the TLB on nearly every one (docs/performance.md, "Huge pages for the key table").
// Thread-compatible.
#pragma once

#include <cstdint>
#include <memory>

#include "proto/vocab/block_key.h"

namespace kvd {

class KeyTable {
 public:
  static constexpr uint32_t kNone = UINT32_MAX;  // "absent"; never a stored value

  explicit KeyTable(int64_t expected = 0);
  KeyTable(const KeyTable&) = delete;
  KeyTable& operator=(const KeyTable&) = delete;

  // The value stored under `key`, or kNone. `key_of(value)` returns the key a value stands for.
  template <typename KeyOf>
  uint32_t Find(const BlockKey& key, KeyOf key_of) const {
    return slots_[Probe(key, key_of)].value;
  }
  // The stored value itself, to be overwritten in place (the key stays), or nullptr when absent.
  // Valid until the next Insert or Erase.
  template <typename KeyOf>
  uint32_t* FindValue(const BlockKey& key, KeyOf key_of) {
    Slot& slot = slots_[Probe(key, key_of)];
    return slot.value == kNone ? nullptr : &slot.value;
  }
  // Stores `value` (!= kNone) under `key`. False, changing nothing, when `key` is present.
  template <typename KeyOf>
  bool Insert(const BlockKey& key, uint32_t value, KeyOf key_of);
  // Removes `key`. False when it was absent.
  template <typename KeyOf>
  bool Erase(const BlockKey& key, KeyOf key_of);
  // Hints the CPU to load `key`'s home slot (a lookup that follows soon then hits the cache).
  void Prefetch(const BlockKey& key) const { __builtin_prefetch(&slots_[Home(Tag(key))]); }

  int64_t size() const { return size_; }
  int64_t memory_bytes() const { return static_cast<int64_t>((mask_ + 1) * sizeof(Slot)); }

 private:
  struct Slot {
    uint32_t tag;
    uint32_t value;  // kNone: empty
  };
  static uint32_t Tag(const BlockKey& key) { return static_cast<uint32_t>(key.lo); }
  size_t Home(uint32_t tag) const { return static_cast<size_t>((tag * 0x9E3779B1u) >> shift_); }
  // The slot holding `key`, or the empty slot where its probe ends.
  template <typename KeyOf>
  size_t Probe(const BlockKey& key, KeyOf key_of) const {
    const uint32_t tag = Tag(key);
    size_t i = Home(tag);
    while (slots_[i].value != kNone && (slots_[i].tag != tag || !(key_of(slots_[i].value) == key))) {
      i = (i + 1) & mask_;
    }
    return i;
  }
  struct FreeSlots {
    void operator()(Slot* p) const;
  };
  static std::unique_ptr<Slot[], FreeSlots> AllocateSlots(size_t n);
  void Grow();
  void EraseAt(size_t hole);

  std::unique_ptr<Slot[], FreeSlots> slots_;
  size_t mask_ = 0;
  int shift_ = 32;  // 32 - log2(slots)
  int64_t size_ = 0;
};

template <typename KeyOf>
bool KeyTable::Insert(const BlockKey& key, uint32_t value, KeyOf key_of) {
  if (static_cast<size_t>(size_ + 1) > (mask_ + 1) / 4 * 3) Grow();
  Slot& slot = slots_[Probe(key, key_of)];
  if (slot.value != kNone) return false;
  slot = Slot{Tag(key), value};
  ++size_;
  return true;
}

template <typename KeyOf>
bool KeyTable::Erase(const BlockKey& key, KeyOf key_of) {
  const size_t i = Probe(key, key_of);
  if (slots_[i].value == kNone) return false;
  EraseAt(i);
  return true;
}

}  // namespace kvd
