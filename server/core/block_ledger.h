// BlockLedger is the record of who may write each block (DESIGN.md invariant 17): at most one
// writer-owner per block, named by the attachment (a worker id: one per attachment, never reused)
// and an epoch (the serial of the grant; unique per owner for the cache's life). Every hand-out,
// return and take-over of a block is a transition here, and a transition names the owner it
// expects: a block is taken from its owner only by that owner's own word (a step naming it), or
// when the owner is gone (its attachment ended, its fence lifted).
//
// What it records now: worker credit (grant, adoption by a grow, return by name, the worker
// going); requests' writable blocks (hand-out by Acquire, a grow or a resume, credit adopted,
// published, released; KvCache::HandOverWritesLocked hands them to another owner, a fence);
// pulls (TierPort::PinBlocks of a request's blocks until UnpinBlocks); fences (a fenced request's
// blocks handed over, credit transferred, a block nobody writes assigned; a lift gives back what
// the fence writes, to another fence that still holds the block: kv_cache_fences.cc states the
// rules). Pin names reads and is never a writer.
// KvCache::CheckInvariantsForTesting walks it: every owned block is in the owner's record, no
// block has two writers, every writable block of a live request is that request's or its pull's,
// a cached or free block has no writer, a fence owner is a live fence writing only blocks it
// holds, and a fenced block is written by such a fence or by the request that resumed it.
//
// Plain data: no I/O, no callbacks, no clock. Thread-compatible: KvCache guards it with its mutex
// (mu_), and every call is O(1) per block except ForEach (O(capacity), for the invariant checker).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "proto/vocab/types.h"

namespace kvd {

enum class OwnerKind : uint8_t {
  kRequest,  // a live request's writable blocks
  kCredit,   // a worker's block credit: it may place them into its requests without asking
  kPin,      // held for a peer's lease (read by the peer; written by nobody)
  kPull,     // being written by kvd for a request (a tier's promotion, a peer's blocks); its
             // attachment is the request's worker, which is not the writer meanwhile
  kFence,    // a writer kvd can no longer reach may still write it, until lifted
};
std::string OwnerKindName(OwnerKind kind);

struct Owner {
  OwnerKind kind = OwnerKind::kCredit;
  WorkerId attachment;  // the attachment that may write (empty: nobody reachable, e.g. a time fence)
  uint64_t epoch = 0;   // > 0: the grant's serial; an Owner is identified by it
  friend bool operator==(const Owner& a, const Owner& b) {
    return a.kind == b.kind && a.epoch == b.epoch && a.attachment == b.attachment;
  }
};

class BlockLedger {
 public:
  // Adds a pool of `capacity_blocks` blocks, all unowned; pools are numbered in order from 0.
  void AddPool(int64_t capacity_blocks);

  // Unowned -> owned by `to` (its first block registers it). FAILED_PRECONDITION, changing
  // nothing, when another owner holds the block; INVALID_ARGUMENT for epoch 0, an epoch
  // registered with another owner or pool, or a block out of range.
  absl::Status Assign(PoolId pool, BlockIndex block, const Owner& to);
  // Owned by `from` -> unowned (the owner's last block forgets it). FAILED_PRECONDITION, changing
  // nothing, when `from` does not hold the block: nobody gives back what another owns.
  absl::Status Release(PoolId pool, BlockIndex block, const Owner& from);
  // Owned by `from` -> owned by `to` in one transition (credit adopted by a request, a request's
  // blocks fenced). Assign's and Release's errors; changes nothing on error.
  absl::Status Transfer(PoolId pool, BlockIndex block, const Owner& from, const Owner& to);

  // The block's writer-owner, or null. REQUIRES: the block is in range.
  const Owner* OwnerOf(PoolId pool, BlockIndex block) const;
  // The blocks `epoch` owns (empty when it owns none), and its pool.
  const absl::flat_hash_set<BlockIndex>& BlocksOf(uint64_t epoch) const;
  const Owner* Find(uint64_t epoch) const;
  // Every owned block with its owner, pool by pool in block order. O(capacity of every pool).
  void ForEach(const std::function<void(PoolId, BlockIndex, const Owner&)>& fn) const;
  // Every registered owner (one with at least one block), with its pool and blocks.
  void ForEachOwner(
      const std::function<void(const Owner&, PoolId, const absl::flat_hash_set<BlockIndex>&)>& fn) const;
  int64_t num_owned() const { return num_owned_; }

 private:
  struct Record {
    Owner owner;
    PoolId pool = 0;
    absl::flat_hash_set<BlockIndex> blocks;
  };
  absl::Status CheckBlock(PoolId pool, BlockIndex block) const;

  std::vector<std::vector<uint64_t>> writer_;  // per pool, per block: the owner's epoch, 0 none
  absl::flat_hash_map<uint64_t, Record> owners_;
  int64_t num_owned_ = 0;
};

}  // namespace kvd
