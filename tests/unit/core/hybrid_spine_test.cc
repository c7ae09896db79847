// HybridSpine (docs/hybrid.md §2.6-2.8): the window need per kind, table-driven lookups where
// each kind limits the hit, Lookup against a brute force that tries every d with the token-level
// rules, checkpoint acceptance outcomes, the checker naming each rule, and eviction cascades that
// keep U2-U4 after every random eviction.
#include "server/core/hybrid_spine.h"

#include <algorithm>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace kvd {
namespace {

constexpr BlockIndex kNone = HybridSpine::kNone;

KvGroup Full() { return KvGroup{.name = "full", .kind = KvGroupKind::kFull}; }
KvGroup Swa(int32_t w, std::string name = "swa") {
  return KvGroup{.name = std::move(name), .kind = KvGroupKind::kSlidingWindow, .window = w};
}
KvGroup Chunk(int32_t c) { return KvGroup{.name = "chunk", .kind = KvGroupKind::kChunkedLocal, .chunk = c}; }
KvGroup State(int32_t k, bool at_end = true, std::string name = "state") {
  return KvGroup{.name = std::move(name), .kind = KvGroupKind::kState, .checkpoint_every_blocks = k,
                 .checkpoint_at_end = at_end};
}

// A pool of the given groups, `capacity` units each, laid end to end as ResolveGroups lays them.
PoolGeometry Pool(std::vector<KvGroup> groups, int32_t block_tokens = 4, int64_t capacity = 256) {
  PoolGeometry g;
  g.name = "h";
  g.block_tokens = block_tokens;
  int64_t first = 0;
  for (KvGroup& kg : groups) {
    kg.capacity = capacity;
    kg.first_block = first;
    first += capacity;
  }
  g.groups = std::move(groups);
  g.capacity_blocks = first;
  return g;
}

// A PrefixIndex and a HybridSpine over one hybrid pool, with per-group allocators handing out
// pool-wide indices of each group's range.
class Fixture {
 public:
  explicit Fixture(PoolGeometry pool) : pool_(std::move(pool)), index_(absl::MakeConstSpan(&pool_, 1)) {
    auto spine = HybridSpine::Create(pool_, 0);
    REQUIRE(spine.ok());
    spine_.emplace(std::move(*spine));
    root_ = index_.GetOrCreateRoot(Namespace{.pool = "h"}, 0);
    free_.resize(pool_.groups.size());
    for (size_t g = 0; g < pool_.groups.size(); ++g) {
      for (int64_t i = pool_.groups[g].capacity - 1; i >= 0; --i) {
        free_[g].push_back(static_cast<BlockIndex>(pool_.groups[g].first_block + i));
      }
    }
  }

  HybridSpine& spine() { return *spine_; }
  PrefixIndex& index() { return index_; }
  const PoolGeometry& pool() const { return pool_; }
  int spine_group() const { return spine_->spine_group(); }

  BlockIndex Take(int g) {
    REQUIRE(!free_[g].empty());
    BlockIndex b = free_[g].back();
    free_[g].pop_back();
    return b;
  }
  void Give(int g, BlockIndex b) { free_[g].push_back(b); }
  size_t num_free(int g) const { return free_[g].size(); }

  // A child of `parent` (nullptr: a first block) with fresh tokens; no components.
  CachedBlock* Node(CachedBlock* parent) {
    std::vector<Token> tokens(pool_.block_tokens);
    for (auto& t : tokens) t = next_token_++;
    CachedBlock* n = index_.Insert(root_, parent, tokens, {0, Take(spine_group())});
    REQUIRE(n != nullptr);
    return n;
  }
  // A chain of `n` nodes below `parent`.
  std::vector<CachedBlock*> Chain(int n, CachedBlock* parent = nullptr) {
    std::vector<CachedBlock*> out;
    for (int i = 0; i < n; ++i) out.push_back(parent = Node(parent));
    return out;
  }
  void Block(CachedBlock* node, int g) { spine_->AttachBlock(*node, g, Take(g)); }
  void Checkpoint(CachedBlock* node, int g, int64_t depth, bool tail = false) {
    spine_->AttachCheckpoint(*node, g, Take(g), depth, tail);
  }

  // Carries out a plan as KvCache would: frees components, erases nodes in order.
  void Apply(const EvictionPlan& plan) {
    for (const SpineDrop& d : plan.components) {
      REQUIRE(pool_.GroupOf(d.index) == d.group);
      Give(d.group, d.index);
    }
    for (CachedBlock* n : plan.nodes) {
      REQUIRE(n->num_children == 0);  // leaf once those before it are gone
      for (int g = 0; g < static_cast<int>(pool_.groups.size()); ++g) {
        if (g != spine_group()) REQUIRE(spine_->block(*n, g) == kNone);
      }
      Give(spine_group(), n->address.index);
      index_.Erase(n);
    }
  }

 private:
  PoolGeometry pool_;
  PrefixIndex index_;
  std::optional<HybridSpine> spine_;
  NamespaceRoot* root_ = nullptr;
  std::vector<std::vector<BlockIndex>> free_;
  Token next_token_ = 1;
};

std::vector<const CachedBlock*> Const(const std::vector<CachedBlock*>& v) { return {v.begin(), v.end()}; }

TEST_CASE("HybridSpine::Create wants a hybrid pool with a full group", "[core][hybrid_spine]") {
  PoolGeometry plain;
  plain.name = "p";
  CHECK(absl::IsInvalidArgument(HybridSpine::Create(plain, 0).status()));
  CHECK(absl::IsInvalidArgument(HybridSpine::Create(Pool({Swa(8), State(2)}), 0).status()));
  CHECK(absl::IsInvalidArgument(HybridSpine::Create(Pool({Full(), Chunk(6)}), 0).status()));  // not a multiple
  auto s = HybridSpine::Create(Pool({Swa(8), Full(), State(2)}), 0);
  REQUIRE(s.ok());
  CHECK(s->spine_group() == 1);
  CHECK(s->has_state_group());

  // A pool as configuration resolves it (kv_group_test's gpt-oss-like one).
  PoolGeometry g;
  g.name = "oss";
  g.block_tokens = 16;
  g.num_layers = 8;
  g.bytes_per_token_per_layer = 256;
  g.max_model_len = 4096;
  g.groups = {KvGroup{.name = "full", .kind = KvGroupKind::kFull, .layers = {1, 3, 5, 7}, .capacity = 512},
              KvGroup{.name = "swa", .kind = KvGroupKind::kSlidingWindow, .layers = {0, 2, 4, 6}, .window = 128,
                      .capacity = 200}};
  REQUIRE(g.ResolveGroups().ok());
  auto r = HybridSpine::Create(g, 0);
  REQUIRE(r.ok());
  CHECK(r->WindowNeed(1, 100) == 8);  // ceil(127 / 16)
  CHECK_FALSE(r->has_state_group());
}

TEST_CASE("WindowNeed: ceil((W - 1) / bt) clamped at d; the chunk's blocks before d", "[core][hybrid_spine]") {
  struct Case {
    int32_t bt, window;
    int64_t depth, need;
  };
  // The window reads positions [L - W + 1, L): W - 1 tokens, so W = bt + 1 needs one block, bt + 2 two.
  for (const Case& c : std::vector<Case>{{4, 1, 5, 0},  {4, 2, 5, 1},  {4, 4, 5, 1},  {4, 5, 5, 1},
                                         {4, 6, 5, 2},  {4, 9, 5, 2},  {4, 10, 5, 3}, {4, 10, 2, 2},
                                         {4, 10, 0, 0}, {16, 128, 9, 8}, {16, 129, 9, 8}, {16, 130, 9, 9},
                                         {1, 7, 10, 6}}) {
    INFO("bt " << c.bt << " W " << c.window << " d " << c.depth);
    auto s = HybridSpine::Create(Pool({Full(), Swa(c.window)}, c.bt), 0);
    REQUIRE(s.ok());
    CHECK(s->WindowNeed(1, c.depth) == c.need);
  }
  auto s = HybridSpine::Create(Pool({Full(), Chunk(12), State(2)}, 4), 0);
  REQUIRE(s.ok());
  const std::vector<int64_t> need = {0, 1, 2, 0, 1, 2, 0};  // C = 3 blocks
  for (int64_t d = 0; d < 7; ++d) CHECK(s->WindowNeed(1, d) == need[d]);
  CHECK(s->WindowNeed(0, 7) == 7);
  CHECK(s->WindowNeed(2, 7) == 0);
}

// Lays out `present` (one string per group; 'x': the node holds the group's block or, for a state
// group, a checkpoint) on a fresh chain, and returns it.
std::vector<CachedBlock*> Layout(Fixture& f, const std::vector<std::string>& present) {
  const size_t len = present[f.spine_group()].size();
  auto chain = f.Chain(static_cast<int>(len));
  for (size_t g = 0; g < present.size(); ++g) {
    if (static_cast<int>(g) == f.spine_group()) continue;
    REQUIRE(present[g].size() == len);
    if (f.pool().groups[g].kind == KvGroupKind::kState) continue;
    for (size_t j = 0; j < len; ++j) {
      if (present[g][j] == 'x') f.Block(chain[j], static_cast<int>(g));
    }
  }
  for (size_t g = 0; g < present.size(); ++g) {
    if (f.pool().groups[g].kind != KvGroupKind::kState) continue;
    for (size_t j = 0; j < len; ++j) {
      if (present[g][j] == 'x') f.Checkpoint(chain[j], static_cast<int>(g), static_cast<int64_t>(j + 1));
    }
  }
  return chain;
}

TEST_CASE("Lookup: the longest d every group serves, and which group limited it", "[core][hybrid_spine]") {
  struct Case {
    const char* name;
    std::vector<KvGroup> groups;
    std::vector<std::string> present;  // per group; the spine group's string sets F
    int64_t depth;
    int limited_by;
  };
  // bt = 4 throughout: W = 6 reads 2 blocks, W = 5 one, W = 10 three; C = 12 is 3 blocks.
  const std::vector<Case> cases = {
      {"every window block", {Full(), Swa(6)}, {"xxxxx", "xxxxx"}, 5, -1},
      {"old tombstones are fine", {Full(), Swa(6)}, {"xxxxx", "..xxx"}, 5, -1},
      {"a tombstone 2 back limits W = 6", {Full(), Swa(6)}, {"xxxxx", "xxx.x"}, 3, 1},
      {"but not W = 5 (one block)", {Full(), Swa(5)}, {"xxxxx", "xxx.x"}, 5, -1},
      {"W = 9 reads 2 blocks", {Full(), Swa(9)}, {"xxxxx", "xx.xx"}, 5, -1},
      {"W = 10 reads 3 blocks", {Full(), Swa(10)}, {"xxxxx", "xx.xx"}, 2, 1},
      {"the window is clamped at the chain's start", {Full(), Swa(10)}, {"xxxxx", "x...."}, 1, 1},
      {"W = 1 reads nothing", {Full(), Swa(1)}, {"xxxx", "...."}, 4, -1},
      {"chunk: blocks since the chunk start", {Full(), Chunk(12)}, {"xxxxx", "x.xxx"}, 5, -1},
      {"chunk: a gap in the current chunk limits", {Full(), Chunk(12)}, {"xxxxx", "xxx.x"}, 3, 1},
      {"chunk: a chunk start needs nothing", {Full(), Chunk(12)}, {"xxxxxx", "xx.xx."}, 6, -1},
      {"state: the deepest checkpoint", {Full(), State(2)}, {"xxxxx", ".x.x."}, 4, 1},
      {"state: a checkpoint at F", {Full(), State(2)}, {"xxxx", ".x.x"}, 4, -1},
      {"state: none is a hit of 0", {Full(), State(2)}, {"xxxx", "...."}, 0, 1},
      {"window limits a mix", {Full(), Swa(6), Chunk(12), State(2)}, {"xxxxxx", "xxxxx.", "xxxxxx", ".x.x.x"}, 4, 1},
      {"state limits a mix", {Full(), Swa(6), Chunk(12), State(2)}, {"xxxxx", "xxx..", "xxxxx", ".x..."}, 2, 3},
      {"chunk limits a mix", {Full(), Swa(6), Chunk(12), State(2)}, {"xxxxx", "xxxxx", "xx..x", ".x.xx"}, 2, 2},
      {"two windows: the wider limits", {Full(), Swa(5, "a"), Swa(10, "b")}, {"xxxxx", "xxxxx", "xx.xx"}, 2, 2},
      {"spine group not first", {Swa(6), Full()}, {"xxxxx", "xxxxx"}, 5, -1},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    Fixture f(Pool(c.groups));
    auto chain = Layout(f, c.present);
    HybridHit hit;
    f.spine().Lookup(Const(chain), &hit);
    CHECK(hit.full_depth == static_cast<int64_t>(chain.size()));
    CHECK(hit.depth == c.depth);
    CHECK(hit.limited_by == c.limited_by);
  }
}

TEST_CASE("Lookup names the components the hit reads", "[core][hybrid_spine]") {
  Fixture f(Pool({Full(), Swa(6), Chunk(12), State(2)}));
  auto chain = Layout(f, {"xxxxxx", "xxxxx.", "xxxxxx", ".x.x.x"});
  HybridHit hit;
  f.spine().Lookup(Const(chain), &hit);
  REQUIRE(hit.depth == 4);
  CHECK(hit.groups[1].first_position == 2);  // W = 6: blocks 2, 3
  CHECK(hit.groups[1].blocks == std::vector<BlockIndex>{f.spine().block(*chain[2], 1), f.spine().block(*chain[3], 1)});
  CHECK(hit.groups[2].first_position == 3);  // chunk [3, 6): block 3
  CHECK(hit.groups[2].blocks == std::vector<BlockIndex>{f.spine().block(*chain[3], 2)});
  CHECK(hit.groups[3].checkpoint == f.spine().checkpoint(*chain[3], 3));
  CHECK(hit.groups[3].checkpoint != kNone);
  CHECK(hit.groups[0].blocks.empty());

  // Reused: a shorter chain clears what the longer one filled.
  f.spine().Lookup(Const({chain[0]}), &hit);
  CHECK(hit.depth == 0);
  CHECK(hit.groups[1].blocks.empty());
  CHECK(hit.groups[3].checkpoint == kNone);
  f.spine().Lookup({}, &hit);
  CHECK(hit.depth == 0);
  CHECK(hit.limited_by == -1);
}

// The token-level rules of §2.6, written independently of WindowNeed: the window reads positions
// [L - W + 1, L), the chunk positions [floor(L / C) * C, L); a block is read if it holds one.
struct Reference {
  const PoolGeometry& pool;
  int64_t FirstRead(int g, int64_t d) const {
    const KvGroup& kg = pool.groups[g];
    const int64_t bt = pool.block_tokens, L = d * bt;
    switch (kg.kind) {
      case KvGroupKind::kFull: return 0;
      case KvGroupKind::kSlidingWindow: {
        const int64_t first_pos = std::max<int64_t>(0, L - kg.window + 1);
        return first_pos >= L ? d : first_pos / bt;
      }
      case KvGroupKind::kChunkedLocal: return (L / kg.chunk) * kg.chunk / bt;
      case KvGroupKind::kState: return d;
    }
    return d;
  }
  bool Serves(const HybridSpine& s, int g, const std::vector<CachedBlock*>& chain, int64_t d) const {
    if (g == s.spine_group()) return true;
    if (pool.groups[g].kind == KvGroupKind::kState) return d == 0 || s.checkpoint(*chain[d - 1], g) != kNone;
    for (int64_t j = FirstRead(g, d); j < d; ++j) {
      if (s.block(*chain[j], g) == kNone) return false;
    }
    return true;
  }
};

TEST_CASE("Lookup equals a brute force that tries every d (randomized)", "[core][hybrid_spine]") {
  std::mt19937 rng(20241);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int iter = 0; iter < 400; ++iter) {
    const int32_t bt = std::vector<int32_t>{1, 2, 3, 4, 16}[pick(0, 4)];
    std::vector<KvGroup> groups = {Full()};
    const int extra = pick(1, 4);
    for (int i = 0; i < extra; ++i) {
      switch (pick(0, 2)) {
        case 0: groups.push_back(Swa(pick(1, 6 * bt + 3), absl::StrCat("swa", i))); break;
        case 1: groups.push_back(KvGroup{.name = absl::StrCat("c", i), .kind = KvGroupKind::kChunkedLocal,
                                         .chunk = bt * pick(1, 5)});
          break;
        default: groups.push_back(State(pick(1, 3), true, absl::StrCat("st", i))); break;
      }
    }
    std::shuffle(groups.begin(), groups.end(), rng);
    Fixture f(Pool(groups, bt));
    const int len = pick(0, 24);
    std::vector<std::string> present(groups.size());
    for (size_t g = 0; g < groups.size(); ++g) {
      const int p = groups[g].kind == KvGroupKind::kState ? pick(10, 60) : pick(50, 100);
      for (int j = 0; j < len; ++j) present[g] += (static_cast<int>(g) == f.spine_group() || pick(1, 100) <= p) ? 'x' : '.';
    }
    auto chain = Layout(f, present);
    HybridHit hit;
    f.spine().Lookup(Const(chain), &hit);

    Reference ref{f.pool()};
    const int n = static_cast<int>(groups.size());
    int64_t best = -1;
    std::vector<int64_t> alone(n, 0);
    for (int64_t d = len; d >= 0; --d) {
      bool all = true;
      for (int g = 0; g < n; ++g) {
        const bool ok = ref.Serves(f.spine(), g, chain, d);
        if (ok) alone[g] = std::max(alone[g], d);
        all = all && ok;
      }
      if (all && best < 0) best = d;
    }
    int limited = -1;
    if (best < len) {
      for (int g = 0; g < n; ++g) {
        if (alone[g] < len && (limited < 0 || alone[g] < alone[limited])) limited = g;
      }
    }
    INFO("iteration " << iter << " bt " << bt << " len " << len);
    for (int g = 0; g < n; ++g) {
      INFO(KvGroupKindName(groups[g].kind) << " W " << groups[g].window << " C " << groups[g].chunk << " k "
                                           << groups[g].checkpoint_every_blocks << " " << present[g]);
    }
    REQUIRE(hit.depth == best);
    REQUIRE(hit.limited_by == limited);
    for (int g = 0; g < n; ++g) {
      if (g == f.spine_group()) continue;
      if (groups[g].kind == KvGroupKind::kState) {
        REQUIRE(hit.groups[g].checkpoint == (best == 0 ? kNone : f.spine().checkpoint(*chain[best - 1], g)));
        continue;
      }
      std::vector<BlockIndex> want;
      for (int64_t j = ref.FirstRead(g, best); j < best; ++j) want.push_back(f.spine().block(*chain[j], g));
      REQUIRE(hit.groups[g].first_position == ref.FirstRead(g, best));
      REQUIRE(hit.groups[g].blocks == want);
    }
  }
}

TEST_CASE("CanAcceptCheckpoint: kept, already_cached, no_chain, no_window, not_aligned", "[core][hybrid_spine]") {
  // bt = 4, W = 6: a checkpoint at d reads window blocks d - 2 and d - 1.
  Fixture f(Pool({Full(), Swa(6), State(2, /*at_end=*/true, "tail"), State(2, /*at_end=*/false, "grid")}));
  auto chain = f.Chain(5);
  for (int j : {0, 2, 3, 4}) f.Block(chain[j], 1);  // position 1 is a tombstone
  const auto c = Const(chain);
  auto outcome = [&](int g, std::vector<const CachedBlock*> ch, int64_t d, bool tail,
                     std::vector<HeldWindow> held = {}) {
    return CheckpointOutcomeName(f.spine().CanAcceptCheckpoint(g, ch, d, tail, held));
  };
  CHECK(outcome(2, c, 4, false) == "kept");          // reads positions 2, 3
  CHECK(outcome(2, c, 0, false) == "not_aligned");   // the empty prefix needs none
  CHECK(outcome(2, c, 3, false) == "not_aligned");   // off the grid
  CHECK(outcome(2, c, 5, true) == "kept");           // End's tail, checkpoint_at_end
  CHECK(outcome(3, c, 5, true) == "not_aligned");    // tail refused without checkpoint_at_end
  CHECK(outcome(3, c, 4, true) == "kept");           // on the grid anyway
  CHECK(outcome(2, {c[0], c[1], c[2]}, 4, false) == "no_chain");
  CHECK(outcome(2, c, 2, false) == "no_window");     // reads positions 0, 1: 1 is gone
  CHECK(outcome(2, c, 2, false, {{}, {1, 2}}) == "kept");  // the request holds position 1
  CHECK(outcome(2, c, 2, false, {{}, {0, 1}}) == "no_window");
  CHECK(outcome(2, c, 2, false, {{}, {2, 5}}) == "no_window");
  CHECK(outcome(2, c, 3, true) == "no_window");      // tail at 3 reads positions 1, 2
  f.Checkpoint(chain[3], 2, 4);
  CHECK(outcome(2, c, 4, false) == "already_cached");
  CHECK(outcome(3, c, 4, false) == "kept");          // another group's checkpoint is its own
  CHECK(f.spine().window_cover(*chain[2], 1) == 1);
  CHECK(f.spine().window_cover(*chain[3], 1) == 1);
  CHECK(f.spine().window_cover(*chain[4], 1) == 0);
  CHECK(f.spine().window_cover(*chain[0], 1) == 0);
}

TEST_CASE("CheckInvariants names the node and the rule", "[core][hybrid_spine]") {
  const NoSpineRefs none;
  auto message = [&](Fixture& f) { return std::string(f.spine().CheckInvariants(f.index(), none).message()); };
  {  // U2, pool without a state group: a tombstone leaf.
    Fixture f(Pool({Full(), Swa(6)}));
    auto chain = f.Chain(3);
    for (auto* n : chain) f.Block(n, 1);
    REQUIRE(f.spine().CheckInvariants(f.index(), none).ok());
    f.spine().Tombstone(*chain[2], 1);
    CHECK_THAT(message(f), Catch::Contains("depth 3") && Catch::Contains("U2: leaf without a block of group swa"));
  }
  {  // U2, state pool: a leaf without a checkpoint; U3: off the grid; U3: window gone; U4.
    Fixture f(Pool({Full(), Swa(6), State(2, /*at_end=*/false)}));
    auto chain = f.Chain(4);
    for (auto* n : chain) f.Block(n, 1);
    CHECK_THAT(message(f), Catch::Contains("U2: leaf without a checkpoint of group state"));
    f.Checkpoint(chain[3], 2, 4);
    CHECK_THAT(message(f), Catch::Contains("depth 1") && Catch::Contains("U4: window block"));
    f.Checkpoint(chain[1], 2, 2);
    REQUIRE(f.spine().CheckInvariants(f.index(), none).ok());
    auto branch = f.Chain(1, chain[1]);  // depth 3: off the k = 2 grid
    f.Block(branch[0], 1);
    f.Checkpoint(branch[0], 2, 3, /*tail=*/true);
    CHECK_THAT(message(f), Catch::Contains("depth 3") && Catch::Contains("U3: checkpoint of group state off the"));
  }
  {  // U3: a checkpoint whose window lost a block (detached behind the spine's back).
    Fixture f(Pool({Full(), Swa(6), State(2)}));
    auto chain = f.Chain(2);
    for (auto* n : chain) f.Block(n, 1);
    f.Checkpoint(chain[1], 2, 2);
    REQUIRE(f.spine().CheckInvariants(f.index(), none).ok());
    // A checkpoint recorded at the wrong depth.
    auto other = f.Chain(2);
    for (auto* n : other) f.Block(n, 1);
    f.Checkpoint(other[1], 2, 4);
    CHECK_THAT(message(f), Catch::Contains("U3: checkpoint of group state records depth 4"));
  }
  {  // U1: a component left on a slot whose node was erased.
    Fixture f(Pool({Full(), Swa(6)}));
    auto chain = f.Chain(1);
    f.Block(chain[0], 1);
    f.index().Erase(chain[0]);
    CHECK_THAT(message(f), Catch::Contains("U1: slot"));
  }
  {  // Referenced leaves may lack a checkpoint or a block (a request still extends them).
    struct All : SpineRefs {
      bool NodeReferenced(const CachedBlock&) const override { return true; }
      bool ComponentReferenced(BlockIndex) const override { return true; }
    } all;
    Fixture f(Pool({Full(), Swa(6), State(2)}));
    auto chain = f.Chain(3);
    f.Block(chain[0], 1);
    CHECK(f.spine().CheckInvariants(f.index(), all).ok());
    CHECK_FALSE(f.spine().CheckInvariants(f.index(), none).ok());
  }
}

TEST_CASE("Evicting a leaf takes its unit: ancestors without a checkpoint, windows no checkpoint reads",
          "[core][hybrid_spine]") {
  // bt = 4, W = 6 (2 blocks), k = 2: checkpoints at depths 2 and 6.
  Fixture f(Pool({Full(), Swa(6), State(2)}));
  auto chain = f.Chain(6);
  for (auto* n : chain) f.Block(n, 1);
  f.Checkpoint(chain[1], 2, 2);
  f.Checkpoint(chain[5], 2, 6);
  // U4: positions 2 and 3 are in no checkpoint's window.
  for (int j : {2, 3}) {
    CHECK_FALSE(f.spine().WindowBlockEarnsPlace(*chain[j], 1));
    f.Give(1, f.spine().Tombstone(*chain[j], 1));
  }
  CHECK(f.spine().WindowBlockEarnsPlace(*chain[4], 1));
  REQUIRE(f.spine().CheckInvariants(f.index(), NoSpineRefs()).ok());
  const BlockIndex ckpt6 = f.spine().checkpoint(*chain[5], 2);
  const BlockIndex swa5 = f.spine().block(*chain[5], 1), swa4 = f.spine().block(*chain[4], 1);

  EvictionPlan plan;
  f.spine().EvictLeaf(chain[5], NoSpineRefs(), &plan);
  CHECK(plan.nodes == std::vector<CachedBlock*>{chain[5], chain[4], chain[3], chain[2]});
  std::set<std::pair<int, BlockIndex>> got;
  for (const SpineDrop& d : plan.components) got.insert({d.group, d.index});
  CHECK(got == std::set<std::pair<int, BlockIndex>>{{2, ckpt6}, {1, swa5}, {1, swa4}});
  f.Apply(plan);
  REQUIRE(f.spine().CheckInvariants(f.index(), NoSpineRefs()).ok());
  HybridHit hit;
  f.spine().Lookup(Const({chain[0], chain[1]}), &hit);
  CHECK(hit.depth == 2);

  // Under state pressure the internal checkpoint at 2 goes; it is a leaf now, so the whole chain.
  plan.clear();
  f.spine().EvictCheckpoint(chain[1], 2, NoSpineRefs(), &plan);
  CHECK(plan.nodes == std::vector<CachedBlock*>{chain[1], chain[0]});
  f.Apply(plan);
  CHECK(f.index().num_blocks() == 0);
  CHECK(f.spine().CheckInvariants(f.index(), NoSpineRefs()).ok());
}

TEST_CASE("An internal checkpoint dropped under pressure takes the window only it read", "[core][hybrid_spine]") {
  Fixture f(Pool({Full(), Swa(6), State(2)}));
  auto chain = f.Chain(5);
  for (auto* n : chain) f.Block(n, 1);
  f.Checkpoint(chain[1], 2, 2);  // reads positions 0, 1
  f.Checkpoint(chain[3], 2, 4);  // reads 2, 3
  f.Checkpoint(chain[4], 2, 5, /*tail=*/true);  // reads 3, 4
  REQUIRE(f.spine().CheckInvariants(f.index(), NoSpineRefs()).ok());
  // The window block at 3 is read: it cannot go alone.
  EvictionPlan plan;
  CHECK_FALSE(f.spine().EvictWindowBlock(chain[3], 1, NoSpineRefs(), &plan));
  CHECK(plan.components.empty());
  const BlockIndex swa2 = f.spine().block(*chain[2], 1);
  f.spine().EvictCheckpoint(chain[3], 2, NoSpineRefs(), &plan);
  CHECK(plan.nodes.empty());
  REQUIRE(plan.components.size() == 2);  // the checkpoint, then position 2 (3 is still the tail's)
  CHECK(plan.components[1].group == 1);
  CHECK(plan.components[1].index == swa2);
  f.Apply(plan);
  CHECK(f.spine().CheckInvariants(f.index(), NoSpineRefs()).ok());
  CHECK(f.spine().window_cover(*chain[3], 1) == 1);
}

TEST_CASE("A leaf checkpoint at a chunk start stays without its chunk block (the hit reads none)",
          "[core][hybrid_spine]") {
  // bt = 4, C = 8 (2 blocks), k = 2: a checkpoint at depth 2 reads no chunk block, the tail at 3
  // reads position 2.
  Fixture f(Pool({Full(), Chunk(8), State(2)}));
  auto chain = f.Chain(3);
  for (auto* n : chain) f.Block(n, 1);
  f.Checkpoint(chain[1], 2, 2);
  f.Checkpoint(chain[2], 2, 3, /*tail=*/true);
  for (int j : {0, 1}) {
    CHECK(f.spine().window_cover(*chain[j], 1) == 0);
    f.Give(1, f.spine().Tombstone(*chain[j], 1));
  }
  REQUIRE(f.spine().CheckInvariants(f.index(), NoSpineRefs()).ok());
  EvictionPlan plan;
  f.spine().EvictLeaf(chain[2], NoSpineRefs(), &plan);
  CHECK(plan.nodes == std::vector<CachedBlock*>{chain[2]});
  f.Apply(plan);
  CHECK(f.spine().CheckInvariants(f.index(), NoSpineRefs()).ok());
  HybridHit hit;
  f.spine().Lookup(Const({chain[0], chain[1]}), &hit);
  CHECK(hit.depth == 2);
}

TEST_CASE("Without a state group a tombstone leaf goes, and tombstones above it with it", "[core][hybrid_spine]") {
  Fixture f(Pool({Full(), Swa(6)}));
  auto chain = f.Chain(4);
  auto branch = f.Chain(1, chain[1]);
  for (auto* n : chain) f.Block(n, 1);
  f.Block(branch[0], 1);
  EvictionPlan plan;
  REQUIRE(f.spine().EvictWindowBlock(chain[2], 1, NoSpineRefs(), &plan));  // internal: a tombstone
  CHECK(plan.nodes.empty());
  f.Apply(plan);
  plan.clear();
  REQUIRE(f.spine().EvictWindowBlock(chain[3], 1, NoSpineRefs(), &plan));  // a leaf: its unit
  CHECK(plan.nodes == std::vector<CachedBlock*>{chain[3], chain[2]});  // 1 has another child
  f.Apply(plan);
  CHECK(f.spine().CheckInvariants(f.index(), NoSpineRefs()).ok());
}

// References for the randomized test: a set of nodes (ancestor-closed, U5) and components.
struct SetRefs : SpineRefs {
  absl::flat_hash_set<const CachedBlock*> nodes;
  absl::flat_hash_set<BlockIndex> components;
  bool NodeReferenced(const CachedBlock& n) const override { return nodes.contains(&n); }
  bool ComponentReferenced(BlockIndex i) const override { return components.contains(i); }
};

void RandomEvictions(std::vector<KvGroup> groups, uint32_t seed) {
  std::mt19937 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Fixture f(Pool(groups, 4, 512));
  const int n = static_cast<int>(groups.size());
  auto& spine = f.spine();
  SetRefs refs;
  std::vector<CachedBlock*> live;  // nodes in the index
  std::map<const CachedBlock*, int64_t> depth;
  // Grow a tree: chains from the root or from a random node, every attention block, checkpoints
  // on the grid (some) and at every leaf (a tail).
  for (int c = 0; c < 12; ++c) {
    CachedBlock* parent = live.empty() || pick(0, 3) == 0 ? nullptr : live[pick(0, live.size() - 1)];
    const int64_t base = parent == nullptr ? 0 : depth[parent];
    auto chain = f.Chain(pick(1, 9), parent);
    std::vector<const CachedBlock*> full_chain;
    for (CachedBlock* p = chain.back(); p != nullptr; p = p->parent) full_chain.insert(full_chain.begin(), p);
    for (size_t j = 0; j < chain.size(); ++j) {
      live.push_back(chain[j]);
      depth[chain[j]] = base + static_cast<int64_t>(j) + 1;
      for (int g = 0; g < n; ++g) {
        if (g != f.spine_group() && groups[g].kind != KvGroupKind::kState) f.Block(chain[j], g);
      }
    }
    for (size_t j = 0; j < chain.size(); ++j) {
      const int64_t d = depth[chain[j]];
      const bool leaf = j + 1 == chain.size();
      for (int g = 0; g < n; ++g) {
        if (groups[g].kind != KvGroupKind::kState || (!leaf && pick(0, 2) == 0)) continue;
        if (spine.CanAcceptCheckpoint(g, full_chain, d, leaf) == CheckpointOutcome::kKept) {
          f.Checkpoint(chain[j], g, d, leaf && d % groups[g].checkpoint_every_blocks != 0);
        }
      }
    }
  }
  // A live request references one path (U5: ancestors too) and its window blocks.
  if (pick(0, 1) == 1) {
    for (CachedBlock* p = live[pick(0, live.size() - 1)]; p != nullptr; p = p->parent) {
      refs.nodes.insert(p);
      for (int g = 0; g < n; ++g) {
        if (g != f.spine_group() && groups[g].kind != KvGroupKind::kState && spine.block(*p, g) != kNone) {
          refs.components.insert(spine.block(*p, g));
        }
      }
    }
  }
  // What the rules say may not stay (an unreferenced leaf a state group has no checkpoint at, an
  // unreferenced window block no checkpoint reads) is evicted before the checks begin.
  auto settle = [&]() {
    EvictionPlan plan;
    for (int round = 0; round < 1000; ++round) {
      plan.clear();
      for (CachedBlock* node : live) {
        if (node->num_children == 0 && !refs.NodeReferenced(*node)) {
          for (int g = 0; g < n; ++g) {
            if (groups[g].kind == KvGroupKind::kState && spine.checkpoint(*node, g) == kNone) {
              spine.EvictLeaf(node, refs, &plan);
              break;
            }
          }
        }
        if (!plan.nodes.empty()) break;
        for (int g = 0; g < n && plan.components.empty() && plan.nodes.empty(); ++g) {
          const KvGroupKind k = groups[g].kind;
          if ((k == KvGroupKind::kSlidingWindow || k == KvGroupKind::kChunkedLocal) &&
              spine.block(*node, g) != kNone && !spine.WindowBlockEarnsPlace(*node, g) &&
              !refs.ComponentReferenced(spine.block(*node, g))) {
            REQUIRE(spine.EvictWindowBlock(node, g, refs, &plan));
          }
        }
        if (!plan.components.empty() || !plan.nodes.empty()) break;
      }
      if (plan.components.empty() && plan.nodes.empty()) return;
      for (CachedBlock* e : plan.nodes) live.erase(std::find(live.begin(), live.end(), e));
      f.Apply(plan);
    }
    FAIL("settling did not converge");
  };
  settle();
  INFO("seed " << seed);
  REQUIRE(spine.CheckInvariants(f.index(), refs).ok());

  EvictionPlan plan;
  for (int step = 0; step < 400 && !live.empty(); ++step) {
    plan.clear();
    CachedBlock* node = live[pick(0, live.size() - 1)];
    const int g = pick(0, n - 1);
    std::string what;
    if (g == f.spine_group()) {
      if (node->num_children != 0 || refs.NodeReferenced(*node)) continue;
      what = "leaf";
      spine.EvictLeaf(node, refs, &plan);
    } else if (groups[g].kind == KvGroupKind::kState) {
      if (spine.checkpoint(*node, g) == kNone) continue;
      what = "checkpoint";
      spine.EvictCheckpoint(node, g, refs, &plan);
    } else {
      if (groups[g].kind == KvGroupKind::kFull || spine.block(*node, g) == kNone ||
          refs.ComponentReferenced(spine.block(*node, g))) {
        continue;
      }
      what = "window block";
      if (!spine.EvictWindowBlock(node, g, refs, &plan)) {
        CHECK((spine.window_cover(*node, g) > 0 || refs.NodeReferenced(*node)));
        continue;
      }
    }
    for (CachedBlock* e : plan.nodes) {
      CHECK_FALSE(refs.NodeReferenced(*e));
      live.erase(std::find(live.begin(), live.end(), e));
    }
    for (const SpineDrop& d : plan.components) CHECK_FALSE(refs.ComponentReferenced(d.index));
    f.Apply(plan);
    INFO("step " << step << ": " << what << " of group " << g << " at node " << node->address.index);
    const absl::Status s = spine.CheckInvariants(f.index(), refs);
    INFO(s.message());
    REQUIRE(s.ok());
  }
  // Every unit is on a live node or free again: nothing leaked, nothing was freed twice.
  for (int g = 0; g < n; ++g) {
    size_t held = 0;
    for (CachedBlock* node : live) {
      held += g == f.spine_group() ? 1 : spine.block(*node, g) != kNone ? 1 : 0;
    }
    CHECK(held + f.num_free(g) == static_cast<size_t>(f.pool().groups[g].capacity));
  }
}

TEST_CASE("Random evictions keep U2-U4 after every step", "[core][hybrid_spine]") {
  for (uint32_t seed = 1; seed <= 40; ++seed) {
    RandomEvictions({Full(), Swa(6), State(2)}, seed);
    RandomEvictions({Full(), Swa(10), Chunk(12), State(3)}, 100 + seed);
    RandomEvictions({Swa(5), Full(), State(1, true, "a"), State(2, false, "b")}, 200 + seed);
    RandomEvictions({Full(), Swa(6), Chunk(8)}, 300 + seed);
  }
}

}  // namespace
}  // namespace kvd
