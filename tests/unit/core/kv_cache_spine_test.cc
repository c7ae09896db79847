// KvCache on hybrid pools with a spine (docs/hybrid.md §2.6-2.8, step 3): hits every group serves,
// each kind limiting; state checkpoints through publish with each outcome; eviction as one unit
// with the checker after every operation; a randomized run of publish / acquire / grow / evict
// whose every hit is checked unit by unit against what its publisher wrote.
#include <catch2/catch.hpp>

#include <map>
#include <random>

#include "absl/strings/str_cat.h"
#include "proto/vocab/pool_geometry.h"
#include "proto/vocab/step_types.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using testing::Concat;
using testing::RequireInvariants;
using testing::Seq;
using testing::Spec;

constexpr int kFull = 0, kSwa = 1;

// full (layers 0, 3), sliding window W (layer 1), optionally chunked local C (layer 2), optionally
// a state group every k blocks. 4-token blocks, S = 8.
PoolGeometry Geometry(int32_t window, int32_t chunk, int32_t every, int64_t cap = 64, int64_t slots = 16) {
  PoolGeometry g;
  g.name = "h";
  g.block_tokens = 4;
  g.bytes_per_token_per_layer = 8;
  g.max_model_len = static_cast<int32_t>(std::min<int64_t>(256, cap * 4));
  g.step_tokens = 8;
  g.groups.push_back(KvGroup{.name = "full", .kind = KvGroupKind::kFull, .layers = {0}, .capacity = cap});
  g.groups.push_back(
      KvGroup{.name = "swa", .kind = KvGroupKind::kSlidingWindow, .layers = {1}, .window = window, .capacity = cap});
  int32_t layer = 2;
  if (chunk > 0) {
    g.groups.push_back(
        KvGroup{.name = "chunk", .kind = KvGroupKind::kChunkedLocal, .layers = {layer++}, .chunk = chunk, .capacity = cap});
  }
  if (every > 0) {
    g.groups.push_back(KvGroup{.name = "rec", .kind = KvGroupKind::kState, .layers = {layer++}, .bytes_per_state = 64,
                               .checkpoint_every_blocks = every, .checkpoint_at_end = false, .capacity = slots});
  }
  g.groups[0].layers = {0, layer};
  g.num_layers = layer + 1;
  const absl::Status resolved = g.ResolveGroups();
  INFO(resolved.ToString());
  REQUIRE(resolved.ok());
  return g;
}

// A grow that only reports the engine's computed tokens.
StepOpResult Grow(KvCache& cache, const std::string& id, int64_t computed) {
  return testing::Grow(cache, id, 0, computed);
}

using View = testing::GroupView;

const PoolReport::Group& GroupReport(const KvCache& cache, const std::string& name) {
  static CacheReport r;
  r = cache.Report();
  for (const PoolReport::Group& g : r.pools[0].groups) {
    if (g.name == name) return g;
  }
  FAIL("no group " << name);
  return r.pools[0].groups[0];
}

std::vector<BlockIndex> First(const std::vector<BlockIndex>& v, size_t n) { return {v.begin(), v.begin() + n}; }

TEST_CASE("a hit on a hybrid pool is limited by a sliding window's tombstones", "[spine]") {
  FakeClock clock;
  auto cache = testing::PoolCache(Geometry(6, 0, 0), &clock);
  const RequestSpec a = Spec("a", Seq(1, 17), 0, "h");
  const AcquireResult ra = testing::Start(*cache, a);
  View swa{ra.group_tables[kSwa].first_block_position, ra.group_tables[kSwa].blocks};
  swa.Apply(Grow(*cache, "a", 8).group_tables[kSwa]);
  // Computed 16: positions below 11 left the window; blocks 0 and 1 were never published: freed.
  swa.Apply(Grow(*cache, "a", 16).group_tables[kSwa]);
  REQUIRE(swa.first == 2);
  const BlockIndex w2 = swa.at(2), w3 = swa.at(3);
  REQUIRE(cache->Publish(a.id, a.prompt, First(ra.blocks, 4)).ok());
  RequireInvariants(*cache);
  REQUIRE(cache->Release(a.id, true).ok());
  RequireInvariants(*cache);
  // d = 4 reads blocks [2, 4): held. d = 2 (a 9-token prompt) reads [0, 2): tombstones.
  CHECK(*cache->PeekPrefixLen(Namespace{.pool = "h"}, Concat(Seq(1, 16), {99})) == 16);
  CHECK(*cache->PeekPrefixLen(Namespace{.pool = "h"}, Seq(1, 9)) == 0);
  const AcquireResult short_hit = testing::Start(*cache, Spec("b", Seq(1, 9), 0, "h"));
  CHECK(short_hit.cached_tokens == 0);
  CHECK(short_hit.full_hit_tokens == 8);
  CHECK(short_hit.limited_by == kSwa);
  const AcquireResult hit = testing::Start(*cache, Spec("c", Concat(Seq(1, 16), {99}), 0, "h"));
  CHECK(hit.cached_tokens == 16);
  CHECK(hit.full_hit_tokens == 16);
  CHECK(hit.limited_by == -1);
  CHECK(First(hit.blocks, 4) == First(ra.blocks, 4));
  CHECK(hit.group_tables[kSwa].first_block_position == 2);
  CHECK(First(hit.group_tables[kSwa].blocks, 2) == std::vector<BlockIndex>{w2, w3});
  CHECK(GroupReport(*cache, "swa").evictable == 0);  // the hit references them
  RequireInvariants(*cache);
  REQUIRE(cache->Release(RequestId("b"), true).ok());
  REQUIRE(cache->Release(RequestId("c"), true).ok());
  CHECK(GroupReport(*cache, "swa").evictable == 2);
  RequireInvariants(*cache);
}

TEST_CASE("a hit on a hybrid pool is limited by a chunked group's blocks", "[spine]") {
  FakeClock clock;
  // C = 8 (2 blocks): a hit of depth d reads the chunk's blocks before d: (4d mod 8) / 4. W = 1:
  // the window group reads nothing before d, so only the chunked group limits.
  auto cache = testing::PoolCache(Geometry(1, 8, 0), &clock);
  const int kChunk = 2;
  const RequestSpec a = Spec("a", Seq(1, 17), 0, "h");
  const AcquireResult ra = testing::Start(*cache, a);
  View chunk{ra.group_tables[kChunk].first_block_position, ra.group_tables[kChunk].blocks};
  chunk.Apply(Grow(*cache, "a", 8).group_tables[kChunk]);
  // Computed 11: the chunk [8, 16) is current, blocks [0, 2) are released unpublished (freed),
  // of both groups; block 2 stays (a leaf holds every attention group's block, U2).
  chunk.Apply(Grow(*cache, "a", 11).group_tables[kChunk]);
  REQUIRE(chunk.first == 2);
  REQUIRE(cache->Publish(a.id, a.prompt, First(ra.blocks, 3)).ok());
  REQUIRE(cache->Release(a.id, true).ok());
  RequireInvariants(*cache);
  // d = 3 reads chunk block 2 (held); d = 2 reads none (a chunk start); d = 1 reads block 0: gone.
  CHECK(*cache->PeekPrefixLen(Namespace{.pool = "h"}, Seq(1, 13)) == 12);
  CHECK(*cache->PeekPrefixLen(Namespace{.pool = "h"}, Seq(1, 9)) == 8);
  const AcquireResult one = testing::Start(*cache, Spec("b", Seq(1, 5), 0, "h"));
  CHECK(one.cached_tokens == 0);
  CHECK(one.limited_by == kChunk);
  REQUIRE(cache->Release(RequestId("b"), true).ok());
  RequireInvariants(*cache);
}

TEST_CASE("a hit on a hybrid pool with a state group ends at a checkpoint", "[spine]") {
  FakeClock clock;
  auto cache = testing::PoolCache(Geometry(6, 0, 2), &clock);
  const int kRec = 2;
  const RequestSpec a = Spec("a", Seq(1, 17), 0, "h");
  const AcquireResult ra = testing::Start(*cache, a);
  View swa{ra.group_tables[kSwa].first_block_position, ra.group_tables[kSwa].blocks};
  swa.Apply(Grow(*cache, "a", 8).group_tables[kSwa]);
  const BlockIndex slot = ra.group_tables[kRec].blocks[1];  // the spare holds the state at 8
  const absl::StatusOr<PublishResult> p =
      cache->Publish(a.id, a.prompt, First(ra.blocks, 2), std::vector<StateCheckpoint>{{kRec, 8, slot}});
  REQUIRE(p.ok());
  REQUIRE(p->checkpoint_outcomes == std::vector<CheckpointOutcome>{CheckpointOutcome::kKept});
  REQUIRE(p->fresh_slots.size() == 1);
  CHECK(p->fresh_slots[0] >= 0);
  CHECK(p->fresh_slots[0] != slot);
  RequireInvariants(*cache);
  swa.Apply(Grow(*cache, "a", 16).group_tables[kSwa]);  // [0, 2) leave the table, read by the checkpoint
  REQUIRE(cache->Publish(a.id, a.prompt, First(ra.blocks, 4)).ok());
  RequireInvariants(*cache);
  // While a holds the chain: F = 4, the hit ends at the checkpoint at 2 blocks.
  const AcquireResult hit = testing::Start(*cache, Spec("b", Concat(Seq(1, 16), {99}), 0, "h"));
  CHECK(hit.cached_tokens == 8);
  CHECK(hit.full_hit_tokens == 16);
  CHECK(hit.limited_by == kRec);
  CHECK(hit.group_tables[kRec].checkpoint_slot == slot);
  CHECK(hit.group_tables[kSwa].first_block_position == 0);
  CHECK(First(hit.group_tables[kSwa].blocks, 2) == First(ra.group_tables[kSwa].blocks, 2));
  RequireInvariants(*cache);
  // a ends: its nodes past the checkpoint hold no state and nobody reads them (U2): they go with
  // their window blocks; the checkpoint's unit stays while b reads it.
  REQUIRE(cache->Release(a.id, true).ok());
  RequireInvariants(*cache);
  CHECK(GroupReport(*cache, "full").cached == 2);
  CHECK(GroupReport(*cache, "swa").cached == 2);
  CHECK(GroupReport(*cache, "rec").cached == 1);
  CHECK(GroupReport(*cache, "rec").evictable == 0);
  REQUIRE(cache->Release(RequestId("b"), true).ok());
  CHECK(GroupReport(*cache, "rec").evictable == 1);
  RequireInvariants(*cache);
}

TEST_CASE("state checkpoints through publish: each outcome, refusals change nothing", "[spine]") {
  FakeClock clock;
  auto cache = testing::PoolCache(Geometry(6, 0, 2), &clock);
  const int kRec = 2;
  const RequestSpec a = Spec("a", Seq(1, 17), 0, "h");
  const AcquireResult ra = testing::Start(*cache, a);
  Grow(*cache, "a", 8);
  const BlockIndex s0 = ra.group_tables[kRec].blocks[0], s1 = ra.group_tables[kRec].blocks[1];
  const std::vector<BlockIndex> two = First(ra.blocks, 2);
  // Refused before anything changes: a slot not the request's, a group that is not a state group.
  const CacheReport before = cache->Report();
  CHECK(absl::IsInvalidArgument(
      cache->Publish(a.id, a.prompt, two, std::vector<StateCheckpoint>{{kRec, 8, ra.blocks[0]}}).status()));
  CHECK(absl::IsInvalidArgument(cache->Publish(a.id, a.prompt, two, std::vector<StateCheckpoint>{{kFull, 8, s1}}).status()));
  CHECK(absl::IsInvalidArgument(
      cache->Publish(a.id, a.prompt, two, std::vector<StateCheckpoint>{{kRec, 8, s1}, {kRec, 8, s1}}).status()));
  CHECK(cache->Report().pools[0].groups[kRec].cached == before.pools[0].groups[kRec].cached);
  CHECK(cache->Report().pools[0].groups[kFull].cached == 0);
  RequireInvariants(*cache);
  // 4 tokens: depth 1, off the k = 2 grid; 6: not a block end; 16: past the chain (2 blocks).
  absl::StatusOr<PublishResult> p =
      cache->Publish(a.id, a.prompt, two, std::vector<StateCheckpoint>{{kRec, 4, s0}, {kRec, 6, s1}});
  REQUIRE(p.ok());
  CHECK(p->checkpoint_outcomes ==
        std::vector<CheckpointOutcome>{CheckpointOutcome::kNotAligned, CheckpointOutcome::kNotAligned});
  CHECK(GroupReport(*cache, "rec").cached == 0);
  p = cache->Publish(a.id, a.prompt, two, std::vector<StateCheckpoint>{{kRec, 16, s0}, {kRec, 8, s1}});
  REQUIRE(p.ok());
  CHECK(p->checkpoint_outcomes ==
        std::vector<CheckpointOutcome>{CheckpointOutcome::kNoChain, CheckpointOutcome::kKept});
  CHECK(p->fresh_slots[0] == -1);
  CHECK(p->fresh_slots[1] >= 0);
  CHECK(GroupReport(*cache, "rec").cached == 1);
  CHECK(GroupReport(*cache, "rec").owned == 2);  // the running slot and a fresh spare
  RequireInvariants(*cache);
  // Another request at the same point: already cached, its slot stays its own.
  const RequestSpec b = Spec("b", Seq(1, 9), 0, "h");
  const AcquireResult rb = testing::Start(*cache, b);
  REQUIRE(rb.cached_tokens == 8);  // a 9-token prompt: cap 2 blocks; d = 2 is at the checkpoint
  CHECK(rb.group_tables[kRec].checkpoint_slot == s1);
  // On a hit the checkpoint stands for the spare until the next grow: one slot of its own.
  REQUIRE(rb.group_tables[kRec].blocks.size() == 1);
  p = cache->Publish(b.id, b.prompt, First(rb.blocks, 2),
                     std::vector<StateCheckpoint>{{kRec, 8, rb.group_tables[kRec].blocks[0]}});
  REQUIRE(p.ok());
  CHECK(p->checkpoint_outcomes == std::vector<CheckpointOutcome>{CheckpointOutcome::kAlreadyCached});
  RequireInvariants(*cache);
  // Its next grow hands it the spare and lets the checkpoint go.
  const StepOpResult grown = Grow(*cache, "b", 9);
  REQUIRE(grown.status.ok());
  CHECK(grown.group_tables[kRec].blocks.size() == 1);
  CHECK(GroupReport(*cache, "rec").evictable == 1);
  RequireInvariants(*cache);
  // A request whose window blocks [0, 2) left unpublished: no window for a checkpoint at 8.
  const RequestSpec c = Spec("c", Seq(100, 17), 0, "h");
  const AcquireResult rc = testing::Start(*cache, c);
  Grow(*cache, "c", 8);
  Grow(*cache, "c", 16);
  p = cache->Publish(c.id, c.prompt, First(rc.blocks, 4),
                     std::vector<StateCheckpoint>{{kRec, 8, rc.group_tables[kRec].blocks[0]},
                                                  {kRec, 16, rc.group_tables[kRec].blocks[1]}});
  REQUIRE(p.ok());
  CHECK(p->checkpoint_outcomes ==
        std::vector<CheckpointOutcome>{CheckpointOutcome::kNoWindow, CheckpointOutcome::kKept});
  RequireInvariants(*cache);
  for (const char* id : {"a", "b", "c"}) REQUIRE(cache->Release(RequestId(id), true).ok());
  RequireInvariants(*cache);
}

TEST_CASE("a spine leaf is evicted as one unit with its window blocks and checkpoint", "[spine]") {
  FakeClock clock;
  // 8 full blocks: a 32-token prompt needs them all.
  auto cache = testing::PoolCache(Geometry(6, 0, 2, /*cap=*/8, /*slots=*/4), &clock);
  const int kRec = 2;
  const RequestSpec a = Spec("a", Seq(1, 17), 0, "h");
  const AcquireResult ra = testing::Start(*cache, a);
  Grow(*cache, "a", 8);
  REQUIRE(cache->Publish(a.id, a.prompt, First(ra.blocks, 2),
                         std::vector<StateCheckpoint>{{kRec, 8, ra.group_tables[kRec].blocks[1]}})
              .ok());
  REQUIRE(cache->End(a.id, 2, {}, true).ok());
  RequireInvariants(*cache);
  CHECK(GroupReport(*cache, "full").cached == 2);
  CHECK(GroupReport(*cache, "swa").cached == 2);
  CHECK(GroupReport(*cache, "rec").cached == 1);
  // A request needing every full block evicts the unit: the leaf, its parent (left a leaf with no
  // state), their window blocks and the checkpoint, under one lock.
  const AcquireResult rb = testing::Start(*cache, Spec("b", Seq(500, 32), 0, "h"));
  CHECK(rb.cached_tokens == 0);
  RequireInvariants(*cache);
  CHECK(GroupReport(*cache, "full").cached == 0);
  CHECK(GroupReport(*cache, "swa").cached == 0);
  CHECK(GroupReport(*cache, "rec").cached == 0);
  CHECK(*cache->PeekPrefixLen(Namespace{.pool = "h"}, Seq(1, 17)) == 0);
  REQUIRE(cache->Release(RequestId("b"), true).ok());
  RequireInvariants(*cache);
}

// The randomized run: every unit an engine writes gets a content word (group, prefix it ends);
// every hit's units must hold the words of the hit's prompt, so a hit that reads a block another
// chain's request wrote, a freed block, or a state not at exactly cached_tokens fails.
class Engine {
 public:
  Engine(KvCache& cache, const PoolGeometry& geo, uint64_t seed) : cache_(cache), geo_(geo), rng_(seed) {}

  void Run(int ops) {
    for (int i = 0; i < ops; ++i) {
      const int what = Pick(0, 9);
      if (what < 5 || live_.empty()) Begin();
      else End(Pick(0, static_cast<int>(live_.size()) - 1));
      RequireInvariants(cache_);
    }
    while (!live_.empty()) {
      End(0);
      RequireInvariants(cache_);
    }
    INFO("hits " << hits_ << " checkpoints kept " << kept_);
    CHECK(hits_ > 0);
    CHECK(kept_ > 0);
  }

 private:
  struct Live {
    RequestSpec spec;
    std::vector<BlockIndex> full;
    std::vector<View> groups;
  };
  static constexpr int kRec = 2;
  int Pick(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  uint64_t Word(int g, const std::vector<Token>& prompt, int64_t end_tokens) const {
    uint64_t h = 1469598103934665603ull ^ static_cast<uint64_t>(g + 1);
    for (int64_t i = 0; i < end_tokens; ++i) h = (h ^ prompt[i]) * 1099511628211ull;
    return h;
  }
  void Write(BlockIndex b, uint64_t word) { content_[b] = word; }

  void Begin() {
    if (live_.size() >= 3) return;
    const int base = Pick(0, 2);
    const int len = Pick(5, 40);
    std::vector<Token> prompt;
    for (int i = 0; i < len; ++i) prompt.push_back(static_cast<Token>(1000 * (base + 1) + i));
    if (Pick(0, 2) == 0) prompt[Pick(0, len - 1)] = static_cast<Token>(900000 + Pick(0, 1 << 20));
    Live l{Spec(absl::StrCat("r", next_++), prompt, 0, "h"), {}, {}};
    const absl::StatusOr<AdmitResult> admitted = cache_.Admit(l.spec);
    REQUIRE(admitted.ok());
    if (admitted->decision != AdmitDecision::kAdmitted) {
      (void)cache_.Release(l.spec.id, true);
      return;
    }
    const absl::StatusOr<AcquireResult> acq = cache_.Acquire(l.spec.id);
    INFO(acq.status().ToString());
    REQUIRE(acq.ok());
    const int32_t bt = geo_.block_tokens;
    const int64_t n = len, d = acq->cached_tokens / bt;
    REQUIRE(acq->cached_tokens % bt == 0);
    REQUIRE(acq->cached_tokens < n);
    // The hit, unit by unit.
    for (int64_t i = 0; i < d; ++i) CHECK(content_[acq->blocks[i]] == Word(kFull, prompt, (i + 1) * bt));
    const GroupTable& swa = acq->group_tables[kSwa];
    for (int64_t p = swa.first_block_position; p < d; ++p) {
      CHECK(content_[swa.blocks[p - swa.first_block_position]] == Word(kSwa, prompt, (p + 1) * bt));
    }
    const int64_t need = std::min<int64_t>(d, 2);  // W = 6, bt = 4
    CHECK(swa.first_block_position <= d - need);
    if (d > 0) {
      ++hits_;
      REQUIRE(acq->group_tables[kRec].checkpoint_slot >= 0);
      CHECK(content_[static_cast<BlockIndex>(acq->group_tables[kRec].checkpoint_slot)] == Word(kRec, prompt, d * bt));
    } else {
      CHECK(acq->group_tables[kRec].checkpoint_slot == -1);
    }
    l.full = acq->blocks;
    for (const GroupTable& t : acq->group_tables) l.groups.push_back(View{t.first_block_position, t.blocks});
    // Compute step by step (S = 8): write what is computed, sometimes publish with the state at a
    // grid point of this step, then report.
    int64_t c = d * bt;
    while (c < n) {
      const int64_t c2 = std::min<int64_t>(n, c + 8);
      for (int64_t p = c / bt; p < c2 / bt; ++p) {
        Write(l.full[p], Word(kFull, prompt, (p + 1) * bt));
        Write(l.groups[kSwa].at(p), Word(kSwa, prompt, (p + 1) * bt));
      }
      const int64_t grid = 2 * bt;
      const int64_t point = c2 / grid * grid;
      if (point > c && point > 0 && l.groups[kRec].blocks.size() == 2 && Pick(0, 2) > 0) {
        const BlockIndex spare = l.groups[kRec].blocks[1];
        Write(spare, Word(kRec, prompt, point));
        const absl::StatusOr<PublishResult> p = cache_.Publish(
            l.spec.id, prompt, First(l.full, point / bt), std::vector<StateCheckpoint>{{kRec, point, spare}});
        REQUIRE(p.ok());
        if (p->checkpoint_outcomes[0] == CheckpointOutcome::kKept) {
          ++kept_;
          if (p->fresh_slots[0] >= 0) l.groups[kRec].blocks[1] = static_cast<BlockIndex>(p->fresh_slots[0]);
          else l.groups[kRec].blocks.pop_back();
        }
      }
      const StepOpResult r = Grow(cache_, l.spec.id.value(), c2);
      REQUIRE(r.status.ok());
      for (size_t g = 1; g < r.group_tables.size(); ++g) l.groups[g].Apply(r.group_tables[g]);
      c = c2;
    }
    live_.push_back(std::move(l));
  }

  void End(int i) {
    Live& l = live_[i];
    const int64_t blocks = static_cast<int64_t>(l.spec.prompt.size()) / geo_.block_tokens;
    REQUIRE(cache_.End(l.spec.id, Pick(0, 1) == 0 ? blocks : 0, {}, true).ok());
    live_.erase(live_.begin() + i);
  }

  KvCache& cache_;
  PoolGeometry geo_;
  std::mt19937_64 rng_;
  std::vector<Live> live_;
  std::map<BlockIndex, uint64_t> content_;
  int next_ = 0;
  int hits_ = 0;
  int kept_ = 0;
};

TEST_CASE("randomized publish / acquire / evict on a hybrid pool: every hit exact, invariants hold", "[spine]") {
  // Roomy (evictions for room now and then) and tight (a unit goes at almost every start).
  for (const auto& [cap, slots] : {std::pair<int64_t, int64_t>{40, 10}, {24, 6}}) {
    for (uint64_t seed : {1u, 2u, 3u, 4u}) {
      INFO("capacity " << cap << " seed " << seed);
      FakeClock clock;
      const PoolGeometry geo = Geometry(6, 0, 2, cap, slots);
      auto cache = testing::PoolCache(geo, &clock);
      Engine(*cache, geo, seed).Run(300);
      const CacheReport r = cache->Report();
      CHECK(r.evictions[static_cast<int>(EvictReason::kCapacity)] > 0);
      // Requests recompute prefixes they did not hit (the hit ends at a checkpoint, or a window
      // was evicted): their chains continue past the duplicates. Only where a publish before End
      // finds no room for its own copies (the tight pool) does a chain stop there until End.
      CHECK(r.duplicate_blocks > 0);
      if (cap == 40) CHECK(r.no_parent_blocks == 0);
    }
  }
}

}  // namespace
}  // namespace kvd
