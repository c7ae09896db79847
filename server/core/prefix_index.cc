#include "server/core/prefix_index.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "proto/vocab/status_macros.h"

namespace kvd {
namespace {

// Zeroed memory for `n` objects, committed page by page as it is first written: a pool's node
// array and token slab cost nothing until blocks are cached in them.
template <typename T>
T* Zeroed(int64_t n) {
  void* p = std::calloc(static_cast<size_t>(n), sizeof(T));
  if (p == nullptr) throw std::bad_alloc();
  return static_cast<T*>(p);
}

// Key tables start at this many entries at most and grow with the cache.
constexpr int64_t kInitialTableEntries = int64_t{1} << 20;

}  // namespace

PrefixIndex::PrefixIndex(absl::Span<const PoolGeometry> pools, absl::Span<const int64_t> ghost_capacity) {
  for (size_t i = 0; i < pools.size(); ++i) {
    const PoolGeometry& g = pools[i];
    const int64_t ghosts = i < ghost_capacity.size() ? std::clamp<int64_t>(ghost_capacity[i], 0, int64_t{1} << 30) : 0;
    auto p = std::make_unique<PoolNodes>(std::min(g.capacity_blocks + ghosts, kInitialTableEntries));
    p->ghost_capacity = ghosts;
    p->capacity = g.capacity_blocks;
    p->block_tokens = g.block_tokens;
    p->nodes = {Zeroed<CachedBlock>(g.capacity_blocks), &std::free};
    p->tokens = {Zeroed<Token>(g.capacity_blocks * g.block_tokens), &std::free};
    pools_.push_back(std::move(p));
  }
}

void PrefixIndex::Prefetch(BlockAddress address, const BlockKey& key) const {
  const PoolNodes& pool = *pools_[address.pool];
  pool.table.Prefetch(key);
  if (address.index < pool.capacity) {
    __builtin_prefetch(&pool.nodes[address.index], /*rw=*/1);
    __builtin_prefetch(&pool.tokens[static_cast<int64_t>(address.index) * pool.block_tokens], /*rw=*/1);
  }
}

int64_t PrefixIndex::memory_bytes() const {
  int64_t bytes = 0;
  for (const auto& p : pools_) {
    bytes += p->capacity * (static_cast<int64_t>(sizeof(CachedBlock)) + p->block_tokens * static_cast<int64_t>(sizeof(Token)));
    bytes += p->table.memory_bytes();
  }
  return bytes;
}

NamespaceRoot* PrefixIndex::FindRoot(const Namespace& ns) const {
  auto it = roots_.find(ns);
  return it == roots_.end() ? nullptr : it->second.get();
}

NamespaceRoot* PrefixIndex::GetOrCreateRoot(const Namespace& ns, PoolId pool) {
  KVD_CHECK(pool < pools_.size());
  auto& slot = roots_[ns];
  if (slot == nullptr) {
    slot = std::make_unique<NamespaceRoot>();
    slot->ns = ns;
    slot->key = NamespaceRootKey(ns);
    slot->pool = pool;
  }
  return slot.get();
}

std::vector<CachedBlock*> PrefixIndex::Match(const NamespaceRoot* root,
                                             absl::Span<const Token> tokens, int32_t block_tokens,
                                             int64_t max_blocks, absl::Span<const BlockKey> keys) const {
  std::vector<CachedBlock*> out;
  if (root == nullptr) return out;
  const int64_t full = static_cast<int64_t>(tokens.size()) / block_tokens;
  const int64_t limit = std::min(full, max_blocks);
  const int64_t nkeys = std::min(limit, static_cast<int64_t>(keys.size()));
  const KeyTable& table = pools_[root->pool]->table;
  // Slots of the next few keys are loaded while this one is verified, so misses overlap.
  constexpr int64_t kAhead = 8;
  for (int64_t i = 0; i < std::min(nkeys, kAhead); ++i) table.Prefetch(keys[i]);
  out.reserve(static_cast<size_t>(limit));
  CachedBlock* parent = nullptr;
  for (int64_t i = 0; i < limit; ++i) {
    if (i + kAhead < nkeys) table.Prefetch(keys[i + kAhead]);
    CachedBlock* child = FindChild(*root, parent, tokens.subspan(i * block_tokens, block_tokens),
                                   i < nkeys ? &keys[i] : nullptr);
    if (child == nullptr) break;
    out.push_back(child);
    parent = child;
  }
  return out;
}

CachedBlock* PrefixIndex::FindChild(const NamespaceRoot& root, const CachedBlock* parent,
                                    absl::Span<const Token> tokens, const BlockKey* key) const {
  const PoolNodes& pool = *pools_[root.pool];
  const BlockKey parent_key = parent == nullptr ? BlockKey{} : parent->key;
  const uint32_t index = pool.table.Find(key != nullptr ? *key : ChainBlockKey(parent_key, root.key, tokens),
                                         KeyOfNode{&pool});
  if ((index & kGhost) != 0) return nullptr;  // absent (kNone) or a ghost
  CachedBlock* node = &pool.nodes[index];
  // The key only finds a candidate: verify the namespace, the chain and the tokens exactly.
  if (node->root != &root || node->parent != parent || static_cast<int64_t>(tokens.size()) != pool.block_tokens ||
      std::memcmp(TokensOf(*node).data(), tokens.data(), tokens.size() * sizeof(Token)) != 0) {
    return nullptr;
  }
  return node;
}

CachedBlock* PrefixIndex::Insert(NamespaceRoot* root, CachedBlock* parent,
                                 absl::Span<const Token> tokens, BlockAddress address, const BlockKey* given,
                                 bool* was_ghost) {
  KVD_CHECK(address.pool == root->pool);
  PoolNodes& pool = *pools_[address.pool];
  KVD_CHECK(address.index < pool.capacity && static_cast<int64_t>(tokens.size()) == pool.block_tokens);
  CachedBlock& node = pool.nodes[address.index];
  KVD_CHECK(node.root == nullptr);
  const BlockKey parent_key = parent == nullptr ? BlockKey{} : parent->key;
  const BlockKey key = given != nullptr ? *given : ChainBlockKey(parent_key, root->key, tokens);
  if (was_ghost != nullptr) *was_ghost = false;
  if (uint32_t* entry = pool.table.FindValue(key, KeyOfNode{&pool}); entry == nullptr) {
    KVD_CHECK(pool.table.Insert(key, address.index, KeyOfNode{&pool}));
  } else if ((*entry & kGhost) != 0) {
    // A ghost comes back: its entry becomes the block's. Its ring slot goes stale and is
    // overwritten in turn.
    *entry = address.index;
    --pool.ghosts;
    if (was_ghost != nullptr) *was_ghost = true;
  } else {
    // A different block with the same 128-bit key (a true collision): the new block is simply
    // not indexed. Callers see nullptr and keep the block private.
    return nullptr;
  }
  Token* slab = &pool.tokens[static_cast<int64_t>(address.index) * pool.block_tokens];
  std::memcpy(slab, tokens.data(), tokens.size() * sizeof(Token));
  node = CachedBlock{};
  node.key = key;
  node.parent = parent;
  node.root = root;
  node.address = address;
  node.serial = next_serial_++;
  if (parent != nullptr) ++parent->num_children;
  ++root->num_blocks;
  ++num_blocks_;
  return &node;
}

void PrefixIndex::AddGhost(PoolNodes& pool, const BlockKey& key) {
  if (static_cast<int64_t>(pool.ghost_ring.size()) < pool.ghost_capacity) {
    pool.ghost_ring.push_back(key);
    *pool.table.FindValue(key, KeyOfNode{&pool}) = kGhost | static_cast<uint32_t>(pool.ghost_ring.size() - 1);
    ++pool.ghosts;
    return;
  }
  // The ring is full: its oldest entry leaves, and with it its key, should that key be a ghost
  // now (added again after coming back, even `key` itself: then it is forgotten at once).
  const size_t pos = pool.ghost_next;
  pool.ghost_next = (pos + 1) % pool.ghost_ring.size();
  // The ring is a FIFO: the key that leaves a few additions from now is known, so its table
  // slot is loaded ahead and that miss overlaps other work.
  constexpr size_t kAhead = 8;
  pool.table.Prefetch(pool.ghost_ring[(pos + kAhead) % pool.ghost_ring.size()]);
  if (pool.ghost_ring[pos] == key) {
    KVD_CHECK(pool.table.Erase(key, KeyOfNode{&pool}));
    return;
  }
  const uint32_t old = pool.table.Find(pool.ghost_ring[pos], KeyOfNode{&pool});
  if (old != KeyTable::kNone && (old & kGhost) != 0) {
    KVD_CHECK(pool.table.Erase(pool.ghost_ring[pos], KeyOfNode{&pool}));
    --pool.ghosts;
  }
  pool.ghost_ring[pos] = key;
  *pool.table.FindValue(key, KeyOfNode{&pool}) = kGhost | static_cast<uint32_t>(pos);
  ++pool.ghosts;
}

void PrefixIndex::Erase(CachedBlock* block, bool as_ghost) {
  KVD_CHECK(block->num_children == 0 && block->root != nullptr);
  NamespaceRoot* root = block->root;
  if (block->parent != nullptr) --block->parent->num_children;
  PoolNodes& pool = *pools_[block->address.pool];
  if (as_ghost && pool.ghost_capacity > 0) {
    AddGhost(pool, block->key);
  } else {
    KVD_CHECK(pool.table.Erase(block->key, KeyOfNode{&pool}));
  }
  block->root = nullptr;
  block->parent = nullptr;
  --num_blocks_;
  if (--root->num_blocks == 0) {
    const Namespace ns = root->ns;  // the key must outlive the erase of its own map entry
    roots_.erase(ns);
  }
}

}  // namespace kvd
