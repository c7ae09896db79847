#include "server/core/prefix_index.h"

#include <algorithm>

#include "proto/vocab/status_macros.h"

namespace kvd {
namespace {

bool SameTokens(const std::vector<Token>& a, absl::Span<const Token> b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

}  // namespace

NamespaceRoot* PrefixIndex::FindRoot(const Namespace& ns) const {
  auto it = roots_.find(ns);
  return it == roots_.end() ? nullptr : it->second.get();
}

NamespaceRoot* PrefixIndex::GetOrCreateRoot(const Namespace& ns, PoolId pool) {
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
  CachedBlock* parent = nullptr;
  for (int64_t i = 0; i < limit; ++i) {
    CachedBlock* child = FindChild(*root, parent, tokens.subspan(i * block_tokens, block_tokens),
                                   i < static_cast<int64_t>(keys.size()) ? &keys[i] : nullptr);
    if (child == nullptr) break;
    out.push_back(child);
    parent = child;
  }
  return out;
}

CachedBlock* PrefixIndex::FindChild(const NamespaceRoot& root, const CachedBlock* parent,
                                    absl::Span<const Token> tokens, const BlockKey* key) const {
  const BlockKey parent_key = parent == nullptr ? BlockKey{} : parent->key;
  auto it = root.blocks.find(key != nullptr ? *key : ChainBlockKey(parent_key, root.key, tokens));
  if (it == root.blocks.end()) return nullptr;
  CachedBlock* node = it->second.get();
  // The key only finds a candidate: verify the chain and the tokens exactly.
  if (node->parent != parent || !SameTokens(node->tokens, tokens)) return nullptr;
  return node;
}

CachedBlock* PrefixIndex::Insert(NamespaceRoot* root, CachedBlock* parent,
                                 absl::Span<const Token> tokens, BlockAddress address, const BlockKey* given) {
  const BlockKey parent_key = parent == nullptr ? BlockKey{} : parent->key;
  const BlockKey key = given != nullptr ? *given : ChainBlockKey(parent_key, root->key, tokens);
  std::unique_ptr<CachedBlock> node;
  if (spare_nodes_.empty()) {
    node = std::make_unique<CachedBlock>();
  } else {
    node = std::move(spare_nodes_.back());
    spare_nodes_.pop_back();
    std::vector<Token> storage = std::move(node->tokens);
    *node = CachedBlock{};
    node->tokens = std::move(storage);
  }
  node->key = key;
  node->parent = parent;
  node->root = root;
  node->address = address;
  node->serial = next_serial_++;
  node->tokens.assign(tokens.begin(), tokens.end());
  CachedBlock* raw = node.get();
  auto [it, inserted] = root->blocks.try_emplace(key, nullptr);
  if (!inserted) {
    // A different block with the same 128-bit key (a true collision): the new block is simply not
    // indexed. Callers see nullptr and keep the block private.
    spare_nodes_.push_back(std::move(node));
    return nullptr;
  }
  it->second = std::move(node);
  if (parent != nullptr) ++parent->num_children;
  ++num_blocks_;
  return raw;
}

void PrefixIndex::Erase(CachedBlock* block) {
  KVD_CHECK(block->num_children == 0);
  NamespaceRoot* root = block->root;
  if (block->parent != nullptr) --block->parent->num_children;
  auto it = root->blocks.find(block->key);
  KVD_CHECK(it != root->blocks.end() && it->second.get() == block);
  spare_nodes_.push_back(std::move(it->second));
  root->blocks.erase(it);
  --num_blocks_;
  if (root->blocks.empty()) {
    const Namespace ns = root->ns;  // the key must outlive the erase of its own map entry
    roots_.erase(ns);
  }
}

}  // namespace kvd
