// PrefixIndex is the radix structure over cached full blocks, one root per namespace.
//
// The index node *is* the device block: each pool has a node array and a token slab indexed by
// BlockIndex (both preallocated for the pool's capacity, their pages committed as blocks are
// first used), and one open-addressing KeyTable from chained block key to BlockIndex. A cached
// block's node points at its parent (the block before it in the same prefix) and its namespace
// root; its tokens sit at slab[index * block_tokens]. A lookup finds the candidate by key, then
// verifies root, parent and tokens (one memcmp), so a hash collision reads as a miss, never wrong
// KV. Roots are structurally separate: a candidate of another namespace fails the root check. An
// empty root is deleted. Inserting and erasing allocate nothing (past the table's growth).
//
// Ghosts (the SLRU policy's memory of recently evicted blocks) share the key table: erasing a
// block "as a ghost" turns its table entry into a ghost entry in place (the value names a slot of
// a fixed FIFO ring of keys), and caching the same key again finds it in the same probe. The ghost
// set answers exactly as a FIFO of the last `ghost_capacity` additions over a set: when the ring
// wraps, the key leaving it is forgotten, even one remembered again since.
//
// The index stores nodes; it does not count references or decide eviction (KvCache does).
// Thread-compatible: the caller serializes access.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"
#include "proto/vocab/block_key.h"
#include "proto/vocab/pool_geometry.h"
#include "proto/vocab/types.h"
#include "server/core/key_table.h"

namespace kvd {

struct NamespaceRoot;

// One cached, immutable full block; its tokens are in the pool's token slab (PrefixIndex::TokensOf).
// Fields below `serial` are KvCache's bookkeeping. An aggregate whose all-zero bytes are the "not
// cached" state, so node arrays start as untouched zero pages. 96 bytes: a node spans at most two
// cache lines.
struct CachedBlock {
  BlockKey key;
  CachedBlock* parent = nullptr;  // nullptr for the first block of a prefix
  NamespaceRoot* root = nullptr;  // nullptr: the slot holds no cached block
  BlockAddress address;
  uint64_t serial = 0;            // unique per insertion; never reused
  uint32_t publisher = 0;         // KvCache's index of the publishing worker; 0 = none

  int32_t num_children = 0;       // cached blocks whose parent is this one
  int32_t protect_count = 0;      // sessions protecting this block
  uint32_t use_clock = 0;         // the pool's store clock at the last use (EvictionQueue::clock)
  uint64_t last_use = 0;          // recency tick (KvCache's logical clock)
  bool queued = false;            // in its pool's eviction queue
  uint8_t queue_tier = 0;         // EvictionQueue::Tier it is filed under, while queued
  bool reused = false;            // SLRU policy: reused or re-stored after eviction (main tier)
  bool queue_spilled = false;     // queued in its tier's ordered spill, not its recency list
  CachedBlock* queue_prev = nullptr;  // recency list links, while queued and not spilled
  CachedBlock* queue_next = nullptr;
};
static_assert(sizeof(CachedBlock) <= 96, "a node spans at most two cache lines");

struct NamespaceRoot {
  Namespace ns;
  BlockKey key;   // NamespaceRootKey(ns)
  PoolId pool = 0;
  int64_t num_blocks = 0;
};

class PrefixIndex {
 public:
  // One node array, token slab and key table per pool, sized by its geometry; pool i remembers
  // up to ghost_capacity[i] ghosts (none past the span's end; at most 2^30).
  explicit PrefixIndex(absl::Span<const PoolGeometry> pools, absl::Span<const int64_t> ghost_capacity = {});
  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;

  // The root of `ns`, or nullptr when nothing is cached in it.
  NamespaceRoot* FindRoot(const Namespace& ns) const;
  NamespaceRoot* GetOrCreateRoot(const Namespace& ns, PoolId pool);

  // The longest chain of cached blocks that equals the leading full blocks of `tokens`, at most
  // `max_blocks` long. `root` may be nullptr (a miss). `keys`, when not empty, are the blocks'
  // chained keys (ChainKeys of the same namespace and tokens, computed before the caller's lock)
  // and their table slots are prefetched ahead of the walk; else keys are computed here. Either
  // way a candidate is verified by root, parent and tokens.
  std::vector<CachedBlock*> Match(const NamespaceRoot* root, absl::Span<const Token> tokens,
                                  int32_t block_tokens, int64_t max_blocks,
                                  absl::Span<const BlockKey> keys = {}) const;

  // The cached child of `parent` (nullptr: first block) holding exactly `tokens`, or nullptr.
  // `key`, when given, is its chained key.
  CachedBlock* FindChild(const NamespaceRoot& root, const CachedBlock* parent,
                         absl::Span<const Token> tokens, const BlockKey* key = nullptr) const;

  // Caches `tokens` as the node of block `address`. REQUIRES: FindChild(root, parent, tokens) ==
  // nullptr, the slot is not cached, address.pool == root->pool, and tokens is the pool's
  // block_tokens long. `key`, when given, is ChainBlockKey(parent's key, root's key, tokens).
  // nullptr when another block holds the same 128-bit key (a true collision): not indexed.
  // `*was_ghost` (when given) tells whether the key was a ghost, which it no longer is.
  CachedBlock* Insert(NamespaceRoot* root, CachedBlock* parent, absl::Span<const Token> tokens,
                      BlockAddress address, const BlockKey* key = nullptr, bool* was_ghost = nullptr);

  // Removes `block` and deletes its root if it became empty; `as_ghost`: its key is remembered
  // as a ghost (no-op for a pool without ghosts). REQUIRES: block->num_children == 0.
  void Erase(CachedBlock* block, bool as_ghost = false);

  // Hints the CPU to load the table slot of `key` and the node and tokens of block `address` (an
  // Insert of them that follows soon then hits the cache).
  void Prefetch(BlockAddress address, const BlockKey& key) const;

  // The block's tokens: exactly its pool's block_tokens, in the pool's token slab.
  absl::Span<const Token> TokensOf(const CachedBlock& block) const {
    const PoolNodes& pool = *pools_[block.address.pool];
    return {&pool.tokens[static_cast<int64_t>(block.address.index) * pool.block_tokens],
            static_cast<size_t>(pool.block_tokens)};
  }

  // Ghosts remembered in `pool`.
  int64_t num_ghosts(PoolId pool) const { return pools_[pool]->ghosts; }

  int64_t num_blocks() const { return num_blocks_; }
  int64_t num_roots() const { return static_cast<int64_t>(roots_.size()); }
  // Bytes of the node arrays, token slabs and key tables now committed or allocated (an upper
  // bound: untouched pages of the arrays count too).
  int64_t memory_bytes() const;

  // Calls fn(CachedBlock*) for every node, in no particular order. O(capacity).
  template <typename Fn>
  void ForEach(Fn fn) const {
    for (const auto& pool : pools_) {
      for (int64_t i = 0; i < pool->capacity; ++i) {
        if (pool->nodes[i].root != nullptr) fn(&pool->nodes[i]);
      }
    }
  }

 private:
  struct PoolNodes {
    int64_t capacity = 0;
    int32_t block_tokens = 0;
    std::unique_ptr<CachedBlock[], void (*)(void*)> nodes{nullptr, nullptr};  // calloc'd
    std::unique_ptr<Token[], void (*)(void*)> tokens{nullptr, nullptr};       // calloc'd
    KeyTable table;  // key -> block index, or kGhost | ghost ring position
    int64_t ghost_capacity = 0;
    std::vector<BlockKey> ghost_ring;  // FIFO of ghost additions; grows, then wraps at ghost_next
    size_t ghost_next = 0;
    int64_t ghosts = 0;                // table entries that are ghosts
    explicit PoolNodes(int64_t expected) : table(expected) {}
  };
  static constexpr uint32_t kGhost = uint32_t{1} << 31;  // table value flag: a ghost entry
  struct KeyOfNode {  // the key a table value stands for
    const PoolNodes* pool;
    const BlockKey& operator()(uint32_t v) const {
      return (v & kGhost) != 0 ? pool->ghost_ring[v & ~kGhost] : pool->nodes[v].key;
    }
  };
  // Remembers `key`, whose table entry is a live block's, as a ghost (turns that entry into one).
  static void AddGhost(PoolNodes& pool, const BlockKey& key);
  absl::flat_hash_map<Namespace, std::unique_ptr<NamespaceRoot>> roots_;
  std::vector<std::unique_ptr<PoolNodes>> pools_;
  int64_t num_blocks_ = 0;
  uint64_t next_serial_ = 1;
};

}  // namespace kvd
