// Block credit per (pool, group) on hybrid pools (kv_cache_step.cc, kv_cache_groups.cc;
// docs/hybrid.md §2.4): granted per group from that group's range and charged as its units,
// placed by a grow naming {group, block} entries (at most what the group appends: a window group
// up to computed + step_tokens), asked back under pressure per group and returned by name. A
// randomized decode driven through steps with credit keeps the ledger (CheckCreditForTesting)
// and the invariant checker exact after every operation; every hostile grow changes nothing.
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <random>

#include "proto/vocab/pool_geometry.h"
#include "proto/vocab/step_types.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using testing::RequireInvariants;
using testing::Seq;
using testing::Spec;

const WorkerId kW("w0");
constexpr int kFull = 0, kSwa = 1, kRec = 2;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// full (layers 0, 2), sliding window W (layer 1), state (layer 3); 4-token blocks.
PoolGeometry Hybrid(int32_t window, int32_t step, int64_t cap = 128) {
  PoolGeometry g;
  g.name = "h";
  g.block_tokens = 4;
  g.bytes_per_token_per_layer = 8;
  g.max_model_len = 256;
  g.num_layers = 4;
  g.step_tokens = step;
  g.groups.push_back(KvGroup{.name = "full", .kind = KvGroupKind::kFull, .layers = {0, 2}, .capacity = cap});
  g.groups.push_back(KvGroup{.name = "swa", .kind = KvGroupKind::kSlidingWindow, .layers = {1}, .window = window,
                             .capacity = cap});
  g.groups.push_back(KvGroup{.name = "rec", .kind = KvGroupKind::kState, .layers = {3}, .bytes_per_state = 1000,
                             .checkpoint_every_blocks = 2, .capacity = 32});
  REQUIRE(g.ResolveGroups().ok());
  return g;
}

std::unique_ptr<KvCache> HybridCache(const PoolGeometry& g, FakeClock* clock, int64_t budget = 0) {
  CacheOptions o = testing::PoolOptions(g, budget);
  o.step_credit_blocks = 6;
  return testing::MakeCache(o, clock);
}

// The worker's view of its credit: per group, the blocks it holds and what kvd asks back.
struct Held {
  std::map<int, std::vector<BlockIndex>> blocks;
  std::map<int, int64_t> wanted;
  std::vector<BlockIndex> all() const {
    std::vector<BlockIndex> out;
    for (const auto& [g, b] : blocks) out.insert(out.end(), b.begin(), b.end());
    return out;
  }
};

Held AskCredit(KvCache& cache, std::vector<CreditWant> wants, std::vector<StepOp> ops = {},
               std::vector<StepOpResult>* results = nullptr) {
  std::vector<CreditHeld> held;
  std::vector<StepOpResult> r = cache.Step(kW, kW, std::move(ops), wants, &held);
  if (results != nullptr) *results = std::move(r);
  Held out;
  for (const CreditHeld& c : held) {
    REQUIRE(c.pool == 0);
    out.blocks[c.group] = c.blocks;
    out.wanted[c.group] = c.wanted;
  }
  return out;
}

StepOp GrowOp(const std::string& id, int64_t tokens, int64_t computed,
              std::vector<std::pair<int, BlockIndex>> credit) {
  StepOp op;
  op.kind = StepOpKind::kGrow;
  op.id = RequestId(id);
  op.tokens = tokens;
  op.computed_tokens = computed;
  for (const auto& [g, b] : credit) {
    op.credit_groups.push_back(g);
    op.credit_blocks.push_back(b);
  }
  return op;
}

StepOpResult GrowWith(KvCache& cache, const std::string& id, int64_t tokens, int64_t computed,
                      std::vector<std::pair<int, BlockIndex>> credit) {
  std::vector<StepOp> ops;
  ops.push_back(GrowOp(id, tokens, computed, std::move(credit)));
  return cache.Step(kW, kW, std::move(ops), {}, nullptr)[0];
}

// What a grow appends to each group, by the clients' rule (docs/hybrid.md §2.4; the same rule as
// KvCache::HeldRange): the full group every new block, the window group up to computed + S.
std::vector<int64_t> Adds(const PoolGeometry& g, const std::vector<testing::GroupView>& views, int64_t n,
                          int64_t c) {
  const int64_t bt = g.block_tokens;
  std::vector<int64_t> adds(views.size(), 0);
  adds[kFull] = std::max<int64_t>(0, CeilDiv(n, bt) - static_cast<int64_t>(views[kFull].blocks.size()));
  const int64_t horizon = CeilDiv(std::min<int64_t>(n, c + g.step_tokens), bt);
  const int64_t lo = std::max<int64_t>(std::min<int64_t>(std::max<int64_t>(0, c - (g.groups[kSwa].window - 1)) / bt,
                                                         horizon),
                                       views[kSwa].first);
  const int64_t end = views[kSwa].first + static_cast<int64_t>(views[kSwa].blocks.size());
  adds[kSwa] = std::max<int64_t>(0, horizon - std::max(end, lo));
  return adds;
}

TEST_CASE("hybrid credit: per group, of its range, charged as its units, placed by {group, block}",
          "[groups][credit]") {
  FakeClock clock;
  const PoolGeometry g = Hybrid(6, 8);
  auto cache = HybridCache(g, &clock);
  RequestSpec spec = Spec("r", Seq(1, 12), 40, "h");
  const AcquireResult acquired = testing::Start(*cache, spec);
  const int64_t before = cache->Report().reserved_bytes;
  Held held = AskCredit(*cache, {CreditWant{0, 3, {}, kFull}, CreditWant{0, 3, {}, kSwa}, CreditWant{0, 100, {}, kRec}});
  REQUIRE(held.blocks[kFull].size() == 3);
  REQUIRE(held.blocks[kSwa].size() == 3);
  REQUIRE(held.blocks[kRec].size() == 4);  // an eighth of the group's 32 slots
  for (const auto& [grp, blocks] : held.blocks) {
    for (BlockIndex b : blocks) REQUIRE(g.GroupOf(b) == grp);
  }
  // Full: 2 layers x 4 tokens x 8 bytes; window: 1 layer; a state slot 1000 bytes.
  REQUIRE(cache->Report().reserved_bytes == before + 3 * 64 + 3 * 32 + 4 * 1000);
  REQUIRE(cache->CheckCreditForTesting(kW, 0, held.all()).ok());
  RequireInvariants(*cache);

  // A decode past a block boundary: 12 -> 16 positions, computed 12. The full group appends one
  // block, the window group up to computed + S = 16 (positions [8, 16): blocks 2, 3).
  std::vector<testing::GroupView> views;
  for (const GroupTable& t : acquired.group_tables) views.push_back({t.first_block_position, t.blocks});
  const std::vector<int64_t> adds = Adds(g, views, 16, 12);
  REQUIRE(adds[kFull] == 1);
  REQUIRE(adds[kSwa] >= 1);
  std::vector<std::pair<int, BlockIndex>> named = {{kFull, held.blocks[kFull][0]}};
  for (int64_t i = 0; i < adds[kSwa]; ++i) named.push_back({kSwa, held.blocks[kSwa][static_cast<size_t>(i)]});
  const int64_t reserved = cache->Report().reserved_bytes;
  StepOpResult r = GrowWith(*cache, "r", 4, 12, named);
  INFO(r.status.ToString());
  REQUIRE(r.status.ok());
  REQUIRE(r.group_tables[kFull].blocks == std::vector<BlockIndex>{held.blocks[kFull][0]});
  REQUIRE(r.group_tables[kSwa].blocks ==
          std::vector<BlockIndex>(held.blocks[kSwa].begin(), held.blocks[kSwa].begin() + adds[kSwa]));
  // Within the request's reservation: the credit's charge goes; the request's stays.
  REQUIRE(cache->Report().reserved_bytes == reserved - 64 - adds[kSwa] * 32);
  Held after = AskCredit(*cache, {CreditWant{0, 3, {}, kFull}, CreditWant{0, 3, {}, kSwa}, CreditWant{0, 4, {}, kRec}});
  for (const auto& [grp, blocks] : after.blocks) {
    for (const auto& [n, b] : named) REQUIRE(std::find(blocks.begin(), blocks.end(), b) == blocks.end());
  }
  REQUIRE(cache->CheckCreditForTesting(kW, 0, after.all()).ok());
  RequireInvariants(*cache);

  // Given back by name per group: a block named under another group is skipped.
  Held back = AskCredit(*cache, {CreditWant{0, 0, after.blocks[kSwa], kFull}, CreditWant{0, 0, after.blocks[kFull], kFull},
                                 CreditWant{0, 0, after.blocks[kRec], kRec}});
  REQUIRE(back.blocks.count(kFull) == 0);
  REQUIRE(back.blocks.count(kRec) == 0);
  REQUIRE(back.blocks[kSwa] == after.blocks[kSwa]);
  RequireInvariants(*cache);
  REQUIRE(cache->DropCredit(kW) == static_cast<int64_t>(after.blocks[kSwa].size()));
  REQUIRE(cache->Release(spec.id, true).ok());
  REQUIRE(cache->Report().reserved_bytes == 0);
  RequireInvariants(*cache);
}

TEST_CASE("hybrid credit: a hostile grow is INVALID_ARGUMENT naming the group and changes nothing",
          "[groups][credit]") {
  FakeClock clock;
  const PoolGeometry g = Hybrid(6, 8);
  auto cache = HybridCache(g, &clock);
  RequestSpec spec = Spec("r", Seq(1, 12), 40, "h");
  testing::Start(*cache, spec);
  Held held = AskCredit(*cache, {CreditWant{0, 4, {}, kFull}, CreditWant{0, 4, {}, kSwa}, CreditWant{0, 2, {}, kRec}});
  REQUIRE(held.blocks[kRec].size() == 2);
  const auto handle = cache->GetHandle(spec.id);
  const CacheReport report = cache->Report();
  auto same = [&] {
    const auto now = cache->GetHandle(spec.id);
    CHECK(now->num_tokens == handle->num_tokens);
    CHECK(now->blocks == handle->blocks);
    CHECK(now->reserved_bytes == handle->reserved_bytes);
    const CacheReport r = cache->Report();
    CHECK(r.reserved_bytes == report.reserved_bytes);
    for (size_t i = 0; i < r.pools[0].groups.size(); ++i) {
      CHECK(r.pools[0].groups[i].free == report.pools[0].groups[i].free);
      CHECK(r.pools[0].groups[i].owned == report.pools[0].groups[i].owned);
    }
    REQUIRE(cache->CheckCreditForTesting(kW, 0, held.all()).ok());
    RequireInvariants(*cache);
  };
  struct Case {
    const char* what;
    std::vector<std::pair<int, BlockIndex>> credit;
    const char* names;
  };
  BlockIndex foreign = 0;  // a window-group block nobody granted this worker
  while (std::find(held.blocks[kSwa].begin(), held.blocks[kSwa].end(), g.groups[kSwa].first_block + foreign) !=
         held.blocks[kSwa].end()) {
    ++foreign;
  }
  foreign += g.groups[kSwa].first_block;
  const Case cases[] = {
      {"a window block named as the full group's", {{kFull, held.blocks[kSwa][0]}}, "group 'full'"},
      {"a full block named as the window's", {{kSwa, held.blocks[kFull][0]}}, "group 'swa'"},
      {"a block it does not hold", {{kSwa, foreign}}, "credit of group 'swa'"},
      {"a block named twice", {{kFull, held.blocks[kFull][0]}, {kFull, held.blocks[kFull][0]}}, "group 'full'"},
      {"a group the pool lacks", {{7, held.blocks[kFull][0]}}, "group 7"},
      {"credit past the window horizon",
       {{kSwa, held.blocks[kSwa][0]}, {kSwa, held.blocks[kSwa][1]}, {kSwa, held.blocks[kSwa][2]},
        {kSwa, held.blocks[kSwa][3]}},
       "group 'swa'"},
      {"more full blocks than the grow takes", {{kFull, held.blocks[kFull][0]}, {kFull, held.blocks[kFull][1]}},
       "group 'full'"},
      {"credit for the state group, whose slots are all held", {{kSwa, held.blocks[kSwa][0]}, {kRec, held.blocks[kRec][0]}},
       "group 'rec'"},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    const StepOpResult r = GrowWith(*cache, "r", 4, 12, c.credit);
    INFO(r.status.ToString());
    CHECK(absl::IsInvalidArgument(r.status));
    CHECK_THAT(std::string(r.status.message()), Catch::Contains(c.names));
    same();
  }
  // credit_blocks without groups on a hybrid pool: refused naming the field.
  const StepOpResult flat = testing::Grow(*cache, "r", 4, 12, {held.blocks[kFull][0]});
  CHECK(absl::IsInvalidArgument(flat.status));
  CHECK_THAT(std::string(flat.status.message()), Catch::Contains("credit_blocks"));
  same();
}

TEST_CASE("hybrid credit: pressure asks it back per group, never takes it", "[groups][credit]") {
  FakeClock clock;
  const PoolGeometry g = Hybrid(6, 8, 64);
  // Budget for ~64 full + 64 window blocks + 8 slots.
  auto cache = HybridCache(g, &clock, 64 * 64 + 64 * 32 + 8 * 1000);
  Held held = AskCredit(*cache, {CreditWant{0, 6, {}, kFull}, CreditWant{0, 6, {}, kSwa}});
  REQUIRE(held.blocks[kFull].size() == 6);
  REQUIRE(held.blocks[kSwa].size() == 6);
  const std::vector<BlockIndex> believed = held.all();
  // Another worker fills the budget until pressure is high.
  int i = 0;
  while (cache->pressure_level() < PressureLevel::kHigh && i < 64) {
    RequestSpec big = Spec("big" + std::to_string(i), Seq(1000 + 100 * i, 16), 0, "h");
    big.owner = WorkerId("w1");
    auto admitted = cache->Admit(big);
    REQUIRE(admitted.ok());
    if (admitted->decision != AdmitDecision::kAdmitted) break;
    REQUIRE(cache->Acquire(big.id).ok());
    ++i;
  }
  REQUIRE(cache->pressure_level() >= PressureLevel::kHigh);
  Held asked = AskCredit(*cache, {CreditWant{0, 6, {}, kFull}, CreditWant{0, 6, {}, kSwa}});
  REQUIRE(asked.blocks[kFull] == held.blocks[kFull]);  // nothing taken
  REQUIRE(asked.blocks[kSwa] == held.blocks[kSwa]);
  REQUIRE(asked.wanted[kFull] > 0);
  REQUIRE(asked.wanted[kSwa] > 0);
  REQUIRE(cache->CheckCreditForTesting(kW, 0, believed).ok());
  RequireInvariants(*cache);
  // Returned by name, group by group: exactly what was asked back goes.
  std::vector<BlockIndex> full_back(held.blocks[kFull].begin(), held.blocks[kFull].begin() + asked.wanted[kFull]);
  std::vector<BlockIndex> swa_back(held.blocks[kSwa].begin(), held.blocks[kSwa].begin() + asked.wanted[kSwa]);
  Held now = AskCredit(*cache, {CreditWant{0, 6, full_back, kFull}, CreditWant{0, 6, swa_back, kSwa}});
  REQUIRE(static_cast<int64_t>(now.blocks[kFull].size()) == 6 - asked.wanted[kFull]);
  REQUIRE(static_cast<int64_t>(now.blocks[kSwa].size()) == 6 - asked.wanted[kSwa]);
  REQUIRE(now.wanted[kFull] == 0);
  REQUIRE(now.wanted[kSwa] == 0);
  REQUIRE(cache->CheckCreditForTesting(kW, 0, now.all()).ok());
  RequireInvariants(*cache);
}

TEST_CASE("hybrid credit of a lost worker is fenced per group's units, and lifted", "[groups][credit][fences]") {
  FakeClock clock;
  const PoolGeometry g = Hybrid(6, 8);
  auto cache = HybridCache(g, &clock);
  RequestSpec spec = Spec("r", Seq(1, 12), 40, "h");
  testing::Start(*cache, spec);
  Held held = AskCredit(*cache, {CreditWant{0, 3, {}, kFull}, CreditWant{0, 2, {}, kSwa}, CreditWant{0, 2, {}, kRec}});
  REQUIRE(held.all().size() == 7);
  RequireInvariants(*cache);
  REQUIRE(cache->FenceWorker(kW, 4242, absl::Seconds(10)) == 1);
  REQUIRE(cache->CreditBlocks(kW, 0) == 0);
  RequireInvariants(*cache);  // the fence is charged each unit at its group's bytes
  REQUIRE(cache->Report().reserved_bytes > 0);
  REQUIRE(cache->LiftFences(kW, 4242) > 0);
  RequireInvariants(*cache);
  REQUIRE(cache->Report().reserved_bytes == 0);
}

TEST_CASE("randomized: hybrid decode on credit keeps the ledger and every invariant exact", "[groups][credit]") {
  std::mt19937 rng(4109);
  for (int round = 0; round < 12; ++round) {
    const int32_t window = 1 + static_cast<int32_t>(rng() % 16);
    const int32_t step = 4 + static_cast<int32_t>(rng() % 12);  // at least block_tokens
    INFO("round " << round << " W " << window << " S " << step);
    FakeClock clock;
    const PoolGeometry g = Hybrid(window, step, 96);
    auto cache = HybridCache(g, &clock);
    struct Live {
      std::string id;
      int64_t n, computed, total;
      std::vector<testing::GroupView> views;
    };
    std::vector<Live> live;
    Held credit;
    for (int op = 0; op < 150; ++op) {
      const int choice = static_cast<int>(rng() % 10);
      if (choice < 2 || live.empty()) {
        const int64_t prompt = 1 + rng() % 30, max_new = rng() % 40;
        RequestSpec spec = Spec("r" + std::to_string(op), Seq(1, static_cast<int>(prompt)), max_new, "h");
        spec.owner = kW;
        auto admitted = cache->Admit(spec);
        REQUIRE(admitted.ok());
        if (admitted->decision != AdmitDecision::kAdmitted) continue;
        auto acq = cache->Acquire(spec.id);
        REQUIRE(acq.ok());
        Live l{spec.id.value(), prompt, 0, prompt + max_new, {}};
        for (const GroupTable& t : acq->group_tables) l.views.push_back({t.first_block_position, t.blocks});
        live.push_back(std::move(l));
      } else if (choice < 3) {
        const size_t i = rng() % live.size();
        REQUIRE(cache->Release(RequestId(live[i].id), true).ok());
        live.erase(live.begin() + static_cast<long>(i));
      } else if (choice < 5) {
        // Top up or give back, per group; sometimes name a block of another group (skipped).
        std::vector<CreditWant> wants;
        for (int grp : {kFull, kSwa, kRec}) {
          std::vector<BlockIndex> back;
          for (BlockIndex b : credit.blocks[grp]) {
            if (rng() % 3 == 0) back.push_back(b);
          }
          if (rng() % 5 == 0 && !credit.blocks[(grp + 1) % 3].empty()) back.push_back(credit.blocks[(grp + 1) % 3][0]);
          wants.push_back(CreditWant{0, static_cast<int64_t>(rng() % 7), back, grp});
        }
        credit = AskCredit(*cache, wants);
      } else {
        Live& l = live[rng() % live.size()];
        const int64_t more = std::min<int64_t>(l.total - l.n, rng() % (step + 1));
        const int64_t computed = std::min(l.n + more, l.computed + static_cast<int64_t>(rng() % (step + 1)));
        const std::vector<int64_t> adds = Adds(g, l.views, l.n + more, computed);
        // Place what credit covers, as the client does with no round trip.
        std::vector<std::pair<int, BlockIndex>> named;
        std::map<int, std::vector<BlockIndex>> placed;
        for (int grp : {kFull, kSwa}) {
          std::vector<BlockIndex>& mine = credit.blocks[grp];
          const int64_t take = std::min<int64_t>(adds[grp], static_cast<int64_t>(mine.size()));
          for (int64_t k = 0; k < take; ++k) {
            named.push_back({grp, mine.back()});
            placed[grp].push_back(mine.back());
            mine.pop_back();
          }
        }
        // The worker's own view of its credit is exact even before kvd hears of the grow.
        REQUIRE(cache->CheckCreditForTesting(kW, 0, credit.all()).ok());
        StepOpResult r = GrowWith(*cache, l.id, more, computed, named);
        INFO(r.status.ToString());
        REQUIRE(r.status.ok());
        l.n += more;
        l.computed = std::max(l.computed, computed);
        for (int grp : {kFull, kSwa}) {
          REQUIRE(static_cast<int64_t>(r.group_tables[grp].blocks.size()) == adds[grp]);
          REQUIRE(std::equal(placed[grp].begin(), placed[grp].end(), r.group_tables[grp].blocks.begin()));
        }
        for (size_t gi = 0; gi < r.group_tables.size(); ++gi) l.views[gi].Apply(r.group_tables[gi]);
        const auto handle = cache->GetHandle(RequestId(l.id));
        REQUIRE(handle.ok());
        CHECK(l.views[kFull].blocks == handle->blocks);
      }
      REQUIRE(cache->CheckCreditForTesting(kW, 0, credit.all()).ok());
      RequireInvariants(*cache);
    }
    cache->DropCredit(kW);
    for (const Live& l : live) REQUIRE(cache->Release(RequestId(l.id), true).ok());
    REQUIRE(cache->Report().reserved_bytes == 0);
    RequireInvariants(*cache);
  }
}

}  // namespace
}  // namespace kvd
