// PrefixIndex is the radix structure over cached full blocks, one root per namespace.
//
// Each cached block is a node that owns a copy of its tokens and points at its parent (the block
// before it in the same prefix). A namespace root holds a hash map from chained block key to node;
// a lookup computes the key, then verifies the node's parent and tokens exactly, so a hash
// collision reads as a miss. Roots are structurally separate: a lookup in one namespace never
// reaches a node of another. An empty root is deleted.
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
#include "proto/vocab/types.h"

namespace kvd {

struct NamespaceRoot;

// One cached, immutable full block. Fields below `tokens` are KvCache's bookkeeping.
struct CachedBlock {
  BlockKey key;
  CachedBlock* parent = nullptr;  // nullptr for the first block of a prefix
  NamespaceRoot* root = nullptr;
  BlockAddress address;
  uint64_t serial = 0;            // unique per insertion; never reused
  uint32_t publisher = 0;         // KvCache's index of the publishing worker; 0 = none
  std::vector<Token> tokens;      // exactly block_tokens tokens

  int32_t num_children = 0;       // cached blocks whose parent is this one
  int32_t protect_count = 0;      // sessions protecting this block
  uint64_t last_use = 0;          // recency tick (KvCache's logical clock)
  bool queued = false;            // in its pool's eviction queue
  uint8_t queue_tier = 0;         // EvictionQueue::Tier it is filed under, while queued
  bool reused = false;            // SLRU policy: reused or re-stored after eviction (main tier)
};

struct NamespaceRoot {
  Namespace ns;
  BlockKey key;   // NamespaceRootKey(ns)
  PoolId pool = 0;
  absl::flat_hash_map<BlockKey, std::unique_ptr<CachedBlock>> blocks;
};

class PrefixIndex {
 public:
  PrefixIndex() = default;
  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;

  // The root of `ns`, or nullptr when nothing is cached in it.
  NamespaceRoot* FindRoot(const Namespace& ns) const;
  NamespaceRoot* GetOrCreateRoot(const Namespace& ns, PoolId pool);

  // The longest chain of cached blocks that equals the leading full blocks of `tokens`, at most
  // `max_blocks` long. `root` may be nullptr (a miss). `keys`, when not empty, are the blocks'
  // chained keys (ChainKeys of the same namespace and tokens, computed before the caller's lock);
  // else they are computed here. Either way a candidate is verified by parent and tokens.
  std::vector<CachedBlock*> Match(const NamespaceRoot* root, absl::Span<const Token> tokens,
                                  int32_t block_tokens, int64_t max_blocks,
                                  absl::Span<const BlockKey> keys = {}) const;

  // The cached child of `parent` (nullptr: first block) holding exactly `tokens`, or nullptr.
  // `key`, when given, is its chained key.
  CachedBlock* FindChild(const NamespaceRoot& root, const CachedBlock* parent,
                         absl::Span<const Token> tokens, const BlockKey* key = nullptr) const;

  // Inserts a new node. REQUIRES: FindChild(root, parent, tokens) == nullptr. `key`, when given,
  // is ChainBlockKey(parent's key, root's key, tokens).
  CachedBlock* Insert(NamespaceRoot* root, CachedBlock* parent, absl::Span<const Token> tokens,
                      BlockAddress address, const BlockKey* key = nullptr);

  // Removes `block` and deletes its root if it became empty. REQUIRES: block->num_children == 0.
  void Erase(CachedBlock* block);

  int64_t num_blocks() const { return num_blocks_; }
  int64_t num_roots() const { return static_cast<int64_t>(roots_.size()); }

  // Calls fn(CachedBlock*) for every node, in no particular order.
  template <typename Fn>
  void ForEach(Fn fn) const {
    for (const auto& [ns, root] : roots_) {
      for (const auto& [key, block] : root->blocks) fn(block.get());
    }
  }

 private:
  absl::flat_hash_map<Namespace, std::unique_ptr<NamespaceRoot>> roots_;
  // Erased nodes kept for reuse (with their token storage), so a churning cache allocates nothing.
  std::vector<std::unique_ptr<CachedBlock>> spare_nodes_;
  int64_t num_blocks_ = 0;
  uint64_t next_serial_ = 1;
};

}  // namespace kvd
