#include "server/core/key_table.h"

#include <catch2/catch.hpp>
#include <deque>
#include <random>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "server/core/prefix_index.h"

namespace kvd {
namespace {

// Keys whose low 32 bits (the tag, hence the home slot) repeat often, so probes run long, tags
// collide between different keys and backward-shift deletion moves entries across the wrap.
BlockKey KeyOf(std::mt19937_64& rng, int distinct_tags) {
  return BlockKey{rng(), static_cast<uint64_t>(rng() % distinct_tags) | (rng() << 32)};
}

TEST_CASE("KeyTable agrees with a hash map under random inserts and erases", "[core][key_table]") {
  for (int distinct_tags : {3, 64, 1 << 20}) {
    std::mt19937_64 rng(distinct_tags);
    std::vector<BlockKey> keys;  // value v stands for keys[v]
    const auto key_of = [&](uint32_t v) -> const BlockKey& { return keys[v]; };
    KeyTable table(0);  // starts at 16 slots: grows several times
    absl::flat_hash_map<BlockKey, uint32_t> model;
    for (int step = 0; step < 20000; ++step) {
      const int op = static_cast<int>(rng() % 3);
      if (op < 2 || model.empty()) {
        keys.push_back(KeyOf(rng, distinct_tags));
        const uint32_t v = static_cast<uint32_t>(keys.size() - 1);
        REQUIRE(table.Insert(keys[v], v, key_of) == model.emplace(keys[v], v).second);
        REQUIRE(!table.Insert(keys[v], v, key_of));  // present: refused, unchanged
      } else {
        // Erase a present key (chosen at random) or an absent one.
        auto it = model.begin();
        std::advance(it, static_cast<long>(rng() % std::min<size_t>(model.size(), 8)));
        const BlockKey k = it->first;
        REQUIRE(table.Erase(k, key_of));
        model.erase(k);
        REQUIRE(!table.Erase(k, key_of));
      }
      REQUIRE(table.size() == static_cast<int64_t>(model.size()));
      if (step % 997 == 0) {
        for (const auto& [k, v] : model) REQUIRE(table.Find(k, key_of) == v);
        for (int i = 0; i < 50; ++i) REQUIRE(table.Find(KeyOf(rng, distinct_tags), key_of) == KeyTable::kNone);
      }
    }
    for (const auto& [k, v] : model) REQUIRE(table.Find(k, key_of) == v);
  }
}

TEST_CASE("A KeyTable sized for n holds n without growing", "[core][key_table]") {
  KeyTable table(1000);
  const int64_t bytes = table.memory_bytes();
  std::vector<BlockKey> keys;
  std::mt19937_64 rng(7);
  const auto key_of = [&](uint32_t v) -> const BlockKey& { return keys[v]; };
  for (uint32_t i = 0; i < 1000; ++i) {
    keys.push_back(BlockKey{rng(), rng()});
    REQUIRE(table.Insert(keys[i], i, key_of));
  }
  REQUIRE(table.memory_bytes() == bytes);
}

// The reference the index's ghosts must equal: a FIFO of additions over a set (the engine's first
// ghost list, whose SLRU hit rates the shared-table one must keep exactly).
class ReferenceGhost {
 public:
  explicit ReferenceGhost(int64_t capacity) : capacity_(capacity) {}
  void Add(const BlockKey& key) {
    if (capacity_ <= 0) return;
    if (keys_.insert(key).second) order_.push_back(key);
    while (static_cast<int64_t>(order_.size()) > capacity_) {
      keys_.erase(order_.front());
      order_.pop_front();
    }
  }
  bool Take(const BlockKey& key) { return keys_.erase(key) > 0; }
  int64_t size() const { return static_cast<int64_t>(keys_.size()); }

 private:
  int64_t capacity_;
  absl::flat_hash_set<BlockKey> keys_;
  std::deque<BlockKey> order_;
};

TEST_CASE("Index ghosts answer exactly as a FIFO of additions over a set", "[core][key_table]") {
  for (int64_t capacity : {0, 1, 5, 64}) {
    std::mt19937_64 rng(static_cast<uint64_t>(capacity) + 11);
    PoolGeometry g;
    g.name = "m";
    g.block_tokens = 4;
    g.capacity_blocks = 64;
    const std::vector<int64_t> ghost_capacity = {capacity};
    PrefixIndex index({g}, ghost_capacity);
    NamespaceRoot* root = index.GetOrCreateRoot(Namespace{.pool = "m"}, 0);
    ReferenceGhost ref(capacity);
    // 40 one-block prefixes, each cached in block t while live: erased as ghosts or not, cached
    // again, so re-adds, returns of remembered and forgotten keys and stale ring entries
    // (including the very key being added) all happen often.
    std::vector<CachedBlock*> live(40, nullptr);
    for (int step = 0; step < 20000; ++step) {
      const uint32_t t = static_cast<uint32_t>(rng() % live.size());
      const std::vector<Token> tokens(4, t);
      if (live[t] != nullptr) {
        const bool as_ghost = rng() % 3 != 0;
        const BlockKey key = live[t]->key;
        index.Erase(live[t], as_ghost);
        live[t] = nullptr;
        if (as_ghost) ref.Add(key);
      } else {
        bool was_ghost = false;
        live[t] = index.Insert(root, nullptr, tokens, BlockAddress{0, t}, nullptr, &was_ghost);
        REQUIRE(live[t] != nullptr);
        REQUIRE(was_ghost == ref.Take(live[t]->key));
        REQUIRE(index.FindChild(*root, nullptr, tokens) == live[t]);
      }
      REQUIRE(index.num_ghosts(0) == ref.size());
      // A ghost is never a hit.
      for (uint32_t u = 0; u < 4; ++u) {
        REQUIRE(index.FindChild(*root, nullptr, std::vector<Token>(4, u)) == live[u]);
      }
    }
  }
}

}  // namespace
}  // namespace kvd
