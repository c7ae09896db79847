// Per-group allocation and admission on hybrid pools (docs/hybrid.md §2.4, §2.5, step 2): the
// bytes admission reserves per group, tables per group from each group's range, growth within
// the reservation, window release (published -> cached, unpublished -> free), refusals that
// change nothing, and the invariant checker's per-group counts after every operation.
#include <catch2/catch.hpp>

#include <random>

#include "proto/vocab/pool_geometry.h"
#include "proto/vocab/step_types.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using testing::RequireInvariants;
using testing::Seq;
using testing::Spec;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Groups: full (layers 0, 3), sliding window W (layer 1), chunked local C (layer 2, if C > 0),
// state (layer 4 or 3). 4-token blocks, 8 bytes per token per layer.
PoolGeometry Hybrid(int32_t window, int32_t chunk, int32_t step, int32_t shards = 1, int64_t cap = 256) {
  PoolGeometry g;
  g.name = "h";
  g.block_tokens = 4;
  g.bytes_per_token_per_layer = 8;
  g.max_model_len = 256;
  g.num_shards = shards;
  g.step_tokens = step;
  g.groups.push_back(KvGroup{.name = "full", .kind = KvGroupKind::kFull, .layers = {0, 3}, .capacity = cap});
  g.groups.push_back(KvGroup{.name = "swa", .kind = KvGroupKind::kSlidingWindow, .layers = {1}, .window = window,
                             .capacity = cap});
  int32_t next = 2;
  if (chunk > 0) {
    g.groups.push_back(KvGroup{.name = "chunk", .kind = KvGroupKind::kChunkedLocal, .layers = {2}, .chunk = chunk,
                               .capacity = cap});
    g.groups[0].layers = {0, 4};
    next = 3;
  }
  g.groups.push_back(KvGroup{.name = "rec", .kind = KvGroupKind::kState, .layers = {next}, .bytes_per_state = 1000,
                             .checkpoint_every_blocks = 2, .capacity = 16});
  g.num_layers = next + 2;
  if (chunk > 0) g.num_layers = 5;
  else g.groups[0].layers = {0, 3};
  REQUIRE(g.ResolveGroups().ok());
  return g;
}

const PoolReport::Group& GroupReport(const KvCache& cache, const std::string& name) {
  static CacheReport r;
  r = cache.Report();
  for (const PoolReport::Group& g : r.pools[0].groups) {
    if (g.name == name) return g;
  }
  FAIL("no group " << name);
  return r.pools[0].groups[0];
}

using testing::Grow;
using View = testing::GroupView;

TEST_CASE("hybrid admission reserves §2.5's units per group, each at its unit bytes on every shard", "[groups]") {
  struct Row {
    int32_t window, chunk, step, shards;
    int64_t prompt, max_new;
  };
  const Row rows[] = {
      {6, 0, 8, 1, 10, 0},    {6, 0, 8, 1, 100, 50},  {5, 0, 4, 2, 3, 0},     {128, 0, 16, 1, 200, 56},
      {6, 8, 8, 1, 60, 20},   {6, 16, 4, 2, 1, 255},  {9, 12, 12, 1, 129, 0}, {1, 4, 4, 1, 40, 0},
  };
  for (const Row& row : rows) {
    INFO("W " << row.window << " C " << row.chunk << " S " << row.step << " shards " << row.shards << " T "
              << row.prompt + row.max_new);
    FakeClock clock;
    const PoolGeometry g = Hybrid(row.window, row.chunk, row.step, row.shards);
    auto cache = testing::PoolCache(g, &clock);
    const int64_t t = row.prompt + row.max_new;
    const int64_t bt = 4, s = row.step;
    // §2.5, written out independently of the code under test.
    int64_t expected = 0;
    std::vector<std::pair<std::string, int64_t>> units;
    for (const KvGroup& k : g.groups) {
      int64_t u = 0;
      int64_t unit_bytes = 0;
      switch (k.kind) {
        case KvGroupKind::kFull: u = CeilDiv(t, bt); break;
        case KvGroupKind::kSlidingWindow: u = std::min(CeilDiv(t, bt), CeilDiv(k.window - 1 + s, bt) + 1); break;
        case KvGroupKind::kChunkedLocal: u = std::min(CeilDiv(t, bt), CeilDiv(k.chunk - 1 + s, bt)); break;
        case KvGroupKind::kState: u = 2; break;
      }
      unit_bytes = (k.attention() ? bt * 8 : 1000) * static_cast<int64_t>(k.layers.size()) * row.shards;
      expected += u * unit_bytes;
      units.emplace_back(k.name, u);
    }
    RequestSpec spec = Spec("r", Seq(1, static_cast<int>(row.prompt)), row.max_new, "h");
    const auto fits = cache->Fits(spec);
    REQUIRE(fits.ok());
    CHECK(fits->projected_bytes == expected);
    const AcquireResult acq = testing::Start(*cache, spec);
    CHECK(cache->Report().reserved_bytes == expected);
    for (const auto& [name, u] : units) CHECK(GroupReport(*cache, name).reserved == u);
    RequireInvariants(*cache);
    // One table per group, from the group's range; the flat table is the full group's.
    REQUIRE(acq.group_tables.size() == g.groups.size());
    CHECK(acq.blocks == acq.group_tables[0].blocks);
    for (size_t i = 0; i < g.groups.size(); ++i) {
      const GroupTable& tb = acq.group_tables[i];
      CHECK(tb.name == g.groups[i].name);
      CHECK(static_cast<int64_t>(tb.blocks.size()) <= units[i].second);
      for (BlockIndex b : tb.blocks) CHECK(g.GroupOf(b) == static_cast<int>(i));
    }
    CHECK(acq.group_tables[0].blocks.size() == static_cast<size_t>(CeilDiv(row.prompt, bt)));
    CHECK(acq.group_tables.back().blocks.size() == 2);
    REQUIRE(cache->Release(spec.id, true).ok());
    CHECK(cache->Report().reserved_bytes == 0);
    RequireInvariants(*cache);
  }
}

TEST_CASE("a pool without groups is charged byte for byte as before", "[groups]") {
  FakeClock clock;
  auto cache = testing::MakeCache(testing::SmallOptions(), &clock);
  const auto fits = cache->Fits(Spec("r", Seq(1, 10), 7));
  REQUIRE(fits.ok());
  CHECK(fits->projected_bytes == 5 * 64);  // ceil(17 / 4) blocks of 4 x 2 x 8 bytes
  CHECK(cache->Report().pools[0].groups.empty());
}

TEST_CASE("a hybrid request that cannot fit is OUT_OF_RANGE, naming the group or the budget", "[groups]") {
  FakeClock clock;
  PoolGeometry g = Hybrid(6, 0, 8);
  g.groups[0].capacity = 10;  // below rule 7's floor, so that a request can outgrow it
  g.capacity_blocks = 10 + 256 + 16;
  for (size_t i = 1; i < g.groups.size(); ++i) g.groups[i].first_block = g.groups[i - 1].first_block + g.groups[i - 1].capacity;
  auto created = KvCache::Create([&] {
    CacheOptions o = testing::SmallOptions();
    o.pools = {g};
    return o;
  }(), &clock);
  if (created.ok()) {
    const auto r = (*created)->Admit(Spec("big", Seq(1, 60), 0, "h"));
    REQUIRE(absl::IsOutOfRange(r.status()));
    CHECK_THAT(std::string(r.status().message()), Catch::Contains("group 'full'"));
    CHECK_THAT(std::string(r.status().message()), Catch::Contains("which holds 10"));
  }
  // The budget: a 64-token request needs 16 x 64 + 4 x 32 + 2 x 1000 bytes.
  auto cache = testing::PoolCache(Hybrid(6, 0, 8), &clock, /*budget=*/2000);
  const auto r = cache->Admit(Spec("r", Seq(1, 64), 0, "h"));
  REQUIRE(absl::IsOutOfRange(r.status()));
  CHECK_THAT(std::string(r.status().message()), Catch::Contains("whole budget"));
  RequireInvariants(*cache);
}

TEST_CASE("window release: published blocks stay cached, unpublished ones are freed", "[groups]") {
  FakeClock clock;
  // W = 6, bt = 4, S = 8: the window holds [floor((c - 5) / 4), ceil(min(n, c + 8) / 4)).
  const PoolGeometry g = Hybrid(6, 0, 8);
  auto cache = testing::PoolCache(g, &clock);
  RequestSpec spec = Spec("r", Seq(1, 16), 16, "h");
  const AcquireResult acq = testing::Start(*cache, spec);
  View swa{acq.group_tables[1].first_block_position, acq.group_tables[1].blocks};
  CHECK(swa.first == 0);
  CHECK(swa.blocks.size() == 2);  // positions [0, 8): the first step's
  // The engine computed 8 tokens: window [0.75 -> 0, ceil(16 / 4) = 4).
  StepOpResult r = Grow(*cache, "r", 0, 8);
  REQUIRE(r.status.ok());
  swa.Apply(r.group_tables[1]);
  CHECK(swa.first == 0);
  CHECK(swa.blocks.size() == 4);
  RequireInvariants(*cache);
  // Publish the prompt's 4 blocks with the state at 8 and 16 tokens (k = 2): the window blocks at
  // those positions become cached too, each read by a checkpoint (U4: in a pool with a state
  // group only those stay cached once the request lets them go).
  const std::vector<StateCheckpoint> states = {{2, 8, acq.group_tables[2].blocks[0]},
                                               {2, 16, acq.group_tables[2].blocks[1]}};
  const absl::StatusOr<PublishResult> pub = cache->Publish(spec.id, spec.prompt, acq.blocks, states);
  REQUIRE(pub.ok());
  CHECK(pub->checkpoint_outcomes ==
        std::vector<CheckpointOutcome>{CheckpointOutcome::kKept, CheckpointOutcome::kKept});
  CHECK(GroupReport(*cache, "swa").cached == 4);
  CHECK(GroupReport(*cache, "swa").evictable == 0);  // the request still reads them
  RequireInvariants(*cache);
  const std::vector<BlockIndex> published = swa.blocks;
  const int64_t swa_free = GroupReport(*cache, "swa").free;
  // Computed 16 (+4 tokens): positions below 16 - 5 = 11 are out, blocks [0, 2) wholly.
  r = Grow(*cache, "r", 4, 16);
  REQUIRE(r.status.ok());
  swa.Apply(r.group_tables[1]);
  CHECK(swa.first == 2);
  CHECK(swa.blocks.front() == published[2]);
  CHECK(GroupReport(*cache, "swa").cached == 4);
  CHECK(GroupReport(*cache, "swa").evictable == 2);  // published: cached, reclaimable
  CHECK(GroupReport(*cache, "swa").free == swa_free - 1);  // one appended for [16, 20)
  RequireInvariants(*cache);
  // Computed 20 (+8 tokens), nothing more published: [16, 20) was never published.
  r = Grow(*cache, "r", 8, 20);
  REQUIRE(r.status.ok());
  swa.Apply(r.group_tables[1]);
  RequireInvariants(*cache);
  // Computed 32: positions below 27 are out: block 4 ([16, 20)) is freed, not cached; 5 too.
  const BlockIndex unpublished = swa.blocks[2];  // position 4
  const int64_t cached_before = GroupReport(*cache, "swa").cached;
  r = Grow(*cache, "r", 0, 28);
  REQUIRE(r.status.ok());
  swa.Apply(r.group_tables[1]);
  CHECK(swa.first == (28 - 5) / 4);
  // Released unpublished blocks went back to the free list (the stack hands the last freed out
  // first, so `unpublished` may come back at a new position); the published ones stay cached.
  const auto pos = std::find(swa.blocks.begin(), swa.blocks.end(), unpublished);
  if (pos != swa.blocks.end()) CHECK(swa.first + (pos - swa.blocks.begin()) > 4);
  CHECK(GroupReport(*cache, "swa").cached == cached_before);
  CHECK(GroupReport(*cache, "swa").evictable == 4);
  CHECK(GroupReport(*cache, "swa").owned == static_cast<int64_t>(swa.blocks.size()));
  const auto handle = cache->GetHandle(spec.id);
  REQUIRE(handle.ok());
  RequireInvariants(*cache);
  // The full group kept every position.
  CHECK(GroupReport(*cache, "full").owned + GroupReport(*cache, "full").cached >= 7);
  REQUIRE(cache->Release(spec.id, true).ok());
  CHECK(GroupReport(*cache, "swa").owned == 0);
  CHECK(GroupReport(*cache, "rec").free == 14);  // the two checkpoints stay cached
  CHECK(GroupReport(*cache, "rec").cached == 2);
  RequireInvariants(*cache);
}

TEST_CASE("hybrid refusals change nothing", "[groups]") {
  FakeClock clock;
  const PoolGeometry g = Hybrid(6, 8, 8);
  auto cache = testing::PoolCache(g, &clock);
  RequestSpec spec = Spec("r", Seq(1, 12), 8, "h");
  testing::Start(*cache, spec);
  REQUIRE(Grow(*cache, "r", 4, 10).status.ok());
  const auto before = cache->GetHandle(spec.id);
  const CacheReport report = cache->Report();
  auto same = [&] {
    const auto after = cache->GetHandle(spec.id);
    CHECK(after->num_tokens == before->num_tokens);
    CHECK(after->blocks == before->blocks);
    CHECK(after->reserved_bytes == before->reserved_bytes);
    const CacheReport now = cache->Report();
    CHECK(now.reserved_bytes == report.reserved_bytes);
    for (size_t i = 0; i < now.pools[0].groups.size(); ++i) {
      CHECK(now.pools[0].groups[i].free == report.pools[0].groups[i].free);
      CHECK(now.pools[0].groups[i].owned == report.pools[0].groups[i].owned);
    }
    RequireInvariants(*cache);
  };
  StepOpResult r = Grow(*cache, "r", 0, 4);  // computed moves back
  CHECK(absl::IsInvalidArgument(r.status));
  same();
  r = Grow(*cache, "r", 0, 40);  // computed past the tokens
  CHECK(absl::IsInvalidArgument(r.status));
  same();
  r = Grow(*cache, "r", 1, 0, {0});  // credit without its group (kv_cache_group_credit_test.cc)
  CHECK(absl::IsInvalidArgument(r.status));
  CHECK_THAT(std::string(r.status.message()), Catch::Contains("credit_blocks"));
  same();
  r = Grow(*cache, "r", 1000, 0);  // past max_model_len
  CHECK(absl::IsOutOfRange(r.status));
  same();
  // A generation checkpoint on a pool with a state group must name the state's slot (step 7).
  const absl::Status unstated = cache->Checkpoint(spec.id, Seq(1, 12), "");
  CHECK(absl::IsInvalidArgument(unstated));
  CHECK_THAT(std::string(unstated.message()), Catch::Contains("state_checkpoints"));
  same();
  StepOp preempt;
  preempt.kind = StepOpKind::kPreempt;
  preempt.id = spec.id;
  preempt.token_ids = Seq(1, 12);
  std::vector<StepOp> ops;
  ops.push_back(preempt);
  r = cache->Step(WorkerId("w0"), WorkerId("w0"), std::move(ops), {}, nullptr)[0];
  CHECK(absl::IsInvalidArgument(r.status));
  same();
  // Growing past the reservation when the budget is full: RESOURCE_EXHAUSTED, nothing changed.
  FakeClock clock2;
  const PoolGeometry small = Hybrid(6, 0, 8);
  auto tight = testing::PoolCache(small, &clock2, /*budget=*/3 * 64 + 3 * 32 + 2000);
  RequestSpec t = Spec("t", Seq(1, 12), 0, "h");
  testing::Start(*tight, t);
  const CacheReport tr = tight->Report();
  r = Grow(*tight, "t", 4, 12);
  CHECK(absl::IsResourceExhausted(r.status));
  CHECK(tight->Report().reserved_bytes == tr.reserved_bytes);
  CHECK(tight->Report().pools[0].groups[0].free == tr.pools[0].groups[0].free);
  CHECK(tight->Report().pools[0].groups[1].free == tr.pools[0].groups[1].free);
  RequireInvariants(*tight);
}

TEST_CASE("randomized: growth within the reservation never fails, per group", "[groups]") {
  std::mt19937 rng(41);
  for (int round = 0; round < 40; ++round) {
    const int32_t window = 1 + static_cast<int32_t>(rng() % 20);
    const int32_t chunk = (rng() % 2) ? 4 * (1 + static_cast<int32_t>(rng() % 6)) : 0;
    const int32_t step = 4 + static_cast<int32_t>(rng() % 29);
    INFO("round " << round << " W " << window << " C " << chunk << " S " << step);
    FakeClock clock;
    const PoolGeometry g = Hybrid(window, chunk, step, 1, 160);
    auto cache = testing::PoolCache(g, &clock);
    struct Live {
      std::string id;
      int64_t n, computed, total;
      std::vector<View> views;
    };
    std::vector<Live> live;
    for (int op = 0; op < 200; ++op) {
      const int choice = static_cast<int>(rng() % 10);
      if (choice < 2 || live.empty()) {
        const int64_t prompt = 1 + rng() % 60, max_new = rng() % 80;
        RequestSpec spec = Spec("r" + std::to_string(op), Seq(1, static_cast<int>(prompt)), max_new, "h");
        auto admitted = cache->Admit(spec);
        REQUIRE(admitted.ok());
        if (admitted->decision != AdmitDecision::kAdmitted) continue;
        auto acq = cache->Acquire(spec.id);
        REQUIRE(acq.ok());  // never fails once admitted
        Live l{spec.id.value(), prompt, 0, prompt + max_new, {}};
        for (const GroupTable& t : acq->group_tables) l.views.push_back(View{t.first_block_position, t.blocks});
        live.push_back(std::move(l));
      } else if (choice < 3) {
        const size_t i = rng() % live.size();
        REQUIRE(cache->Release(RequestId(live[i].id), true).ok());
        live.erase(live.begin() + static_cast<long>(i));
      } else {
        Live& l = live[rng() % live.size()];
        const int64_t more = std::min<int64_t>(l.total - l.n, rng() % (step + 1));
        // The engine computes at most S tokens between reports, and reports what it computed.
        const int64_t computed = std::min(l.n + more, l.computed + static_cast<int64_t>(rng() % (step + 1)));
        StepOpResult r = Grow(*cache, l.id, more, computed);
        INFO(r.status.ToString());
        REQUIRE(r.status.ok());
        l.n += more;
        l.computed = std::max(l.computed, computed);
        for (size_t gi = 0; gi < r.group_tables.size(); ++gi) l.views[gi].Apply(r.group_tables[gi]);
        // The engine's view equals kvd's: every position it may compute next has its blocks.
        const auto handle = cache->GetHandle(RequestId(l.id));
        REQUIRE(handle.ok());
        CHECK(l.views[0].blocks == handle->blocks);
        CHECK(static_cast<int64_t>(l.views[0].blocks.size()) == CeilDiv(l.n, 4));
        for (size_t gi = 1; gi + 1 < l.views.size(); ++gi) {
          const View& v = l.views[gi];
          CHECK(v.first * 4 <= std::max<int64_t>(0, l.computed - (g.groups[gi].kind == KvGroupKind::kSlidingWindow
                                                                    ? window - 1
                                                                    : l.computed % chunk)));
          CHECK((v.first + static_cast<int64_t>(v.blocks.size())) * 4 >= std::min(l.n, l.computed + step));
          for (BlockIndex b : v.blocks) CHECK(g.GroupOf(b) == static_cast<int>(gi));
        }
      }
      RequireInvariants(*cache);
    }
  }
}

}  // namespace
}  // namespace kvd
