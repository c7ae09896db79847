// Generation checkpoints, preempt and resume on hybrid pools, and their hot handoff
// (docs/hybrid.md §2.9, kvd-hybrid step 7): a checkpoint keeps the full blocks, the window blocks
// before its position and the slot holding the state there; a resume on another worker gets
// exactly those units back (the state as checkpoint_slot); bad input changes nothing; a worker
// lost mid-checkpoint leaks nothing and wedges nothing; a snapshot carries a hybrid pool's units
// and checkpoints to a successor that serves the same hits. The checker runs after every step.
#include <catch2/catch.hpp>

#include <map>
#include <random>

#include "absl/strings/match.h"
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

constexpr int kFull = 0, kSwa = 1, kRec = 2;

// full (layers 0, 3), sliding window W = 6 (layer 1), a state group every 2 blocks (layer 2);
// 4-token blocks, S = 8.
PoolGeometry Hybrid(const std::string& name = "h", int32_t window = 6) {
  PoolGeometry g;
  g.name = name;
  g.block_tokens = 4;
  g.bytes_per_token_per_layer = 8;
  g.max_model_len = 128;
  g.step_tokens = 8;
  g.num_layers = 4;
  g.groups.push_back(KvGroup{.name = "full", .kind = KvGroupKind::kFull, .layers = {0, 3}, .capacity = 64});
  g.groups.push_back(
      KvGroup{.name = "swa", .kind = KvGroupKind::kSlidingWindow, .layers = {1}, .window = window, .capacity = 64});
  g.groups.push_back(KvGroup{.name = "rec", .kind = KvGroupKind::kState, .layers = {2}, .bytes_per_state = 64,
                             .checkpoint_every_blocks = 2, .checkpoint_at_end = false, .capacity = 16});
  REQUIRE(g.ResolveGroups().ok());
  return g;
}

std::unique_ptr<KvCache> Cache(FakeClock* clock, bool with_plain_pool = false, int32_t window = 6) {
  CacheOptions o = testing::SmallOptions();
  o.pools = {Hybrid("h", window)};
  if (with_plain_pool) o.pools.push_back(testing::SmallOptions().pools[0]);
  return testing::MakeCache(o, clock);
}

RequestSpec HSpec(const std::string& id, std::vector<Token> prompt, const std::string& worker = "w0",
                  const std::string& resume_from = "") {
  RequestSpec s = Spec(id, std::move(prompt), 8, "h");
  s.owner = WorkerId(worker);
  s.resume_from = RequestId(resume_from);
  return s;
}

StepOpResult Preempt(KvCache& cache, const std::string& id, std::vector<Token> tokens,
                     std::vector<StateCheckpoint> state, const std::string& worker = "w0") {
  StepOp op;
  op.kind = StepOpKind::kPreempt;
  op.id = RequestId(id);
  op.token_ids = std::move(tokens);
  op.engine_state = "engine";
  op.state_checkpoints = std::move(state);
  std::vector<StepOp> ops;
  ops.push_back(std::move(op));
  return cache.Step(WorkerId(worker), WorkerId(worker), std::move(ops), {}, nullptr)[0];
}

StepOpResult GrowAs(KvCache& cache, const std::string& worker, const std::string& id, int64_t tokens,
                    int64_t computed) {
  StepOp op;
  op.kind = StepOpKind::kGrow;
  op.id = RequestId(id);
  op.tokens = tokens;
  op.computed_tokens = computed;
  std::vector<StepOp> ops;
  ops.push_back(std::move(op));
  return cache.Step(WorkerId(worker), WorkerId(worker), std::move(ops), {}, nullptr)[0];
}

const PoolReport::Group& G(const CacheReport& r, int g) { return r.pools[0].groups[g]; }

// A request of 10 prompt tokens computed to 10 (swa holds [0, 3)): what a checkpoint at 10 keeps.
struct Running {
  AcquireResult acq;
  testing::GroupView swa;
  BlockIndex running = 0, spare = 0;
};
Running StartComputed(KvCache& cache, const RequestSpec& spec) {
  Running r;
  r.acq = testing::Start(cache, spec);
  r.swa = {r.acq.group_tables[kSwa].first_block_position, r.acq.group_tables[kSwa].blocks};
  r.swa.Apply(testing::Grow(cache, spec.id.value(), 0, 8).group_tables[kSwa]);
  r.running = r.acq.group_tables[kRec].blocks[0];
  r.spare = r.acq.group_tables[kRec].blocks[1];
  RequireInvariants(cache);
  return r;
}

TEST_CASE("a hybrid generation checkpoint keeps the state slot and window; a resume elsewhere gets them back",
          "[core][hybrid_checkpoint]") {
  FakeClock clock;
  auto cache = Cache(&clock);
  const RequestSpec a = HSpec("a", Seq(1, 10));
  Running ra = StartComputed(*cache, a);
  REQUIRE(ra.swa.first == 0);
  REQUIRE(ra.swa.blocks.size() == 3);

  // Live: the running slot holds the state at 10; the record keeps it, the request gets a fresh one.
  std::vector<int64_t> fresh;
  REQUIRE(cache->Checkpoint(a.id, a.prompt, "es", std::vector<StateCheckpoint>{{kRec, 10, ra.running}}, &fresh).ok());
  REQUIRE(fresh.size() == 1);
  CHECK(fresh[0] >= 0);
  CHECK(static_cast<BlockIndex>(fresh[0]) != ra.running);
  CHECK(static_cast<BlockIndex>(fresh[0]) != ra.spare);
  RequireInvariants(*cache);
  CHECK(G(cache->Report(), kRec).owned == 3);  // running, spare and the record's
  // The request keeps growing, then ends interrupted: the record is orphaned, charged per group.
  testing::Grow(*cache, "a", 4, 10);
  RequireInvariants(*cache);
  REQUIRE(cache->Release(a.id, /*completed=*/false).ok());
  RequireInvariants(*cache);
  CacheReport r = cache->Report();
  CHECK(G(r, kFull).owned == 3);
  CHECK(G(r, kSwa).owned == 2);  // blocks [1, 3): a computation at 10 reads positions 5..9
  CHECK(G(r, kRec).owned == 1);

  // Another worker resumes it: the same units, the state as the checkpoint slot to copy.
  const AcquireResult rb = testing::Start(*cache, HSpec("b", Seq(1, 10), "w1", "a"));
  RequireInvariants(*cache);
  CHECK(rb.resumed);
  CHECK(rb.cached_tokens == 10);
  CHECK(rb.engine_state == "es");
  CHECK(rb.blocks == std::vector<BlockIndex>(ra.acq.blocks.begin(), ra.acq.blocks.begin() + 3));
  CHECK(rb.group_tables[kSwa].first_block_position == 1);
  CHECK(rb.group_tables[kSwa].blocks == std::vector<BlockIndex>{ra.swa.at(1), ra.swa.at(2)});
  REQUIRE(rb.group_tables[kRec].checkpoint_slot >= 0);
  CHECK(rb.group_tables[kRec].checkpoint_slot == static_cast<int64_t>(ra.running));
  REQUIRE(rb.group_tables[kRec].blocks.size() == 1);  // the running slot; the checkpoint stands for the spare
  CHECK(rb.group_tables[kRec].blocks[0] != ra.running);
  // The next grow lets the checkpoint go and hands out the spare.
  const StepOpResult g = GrowAs(*cache, "w1", "b", 4, 10);
  REQUIRE(g.status.ok());
  CHECK(g.group_tables[kRec].blocks.size() == 1);
  RequireInvariants(*cache);
  REQUIRE(cache->End(RequestId("b"), 0, {}, true).ok());
  RequireInvariants(*cache);
  r = cache->Report();
  for (int grp : {kFull, kSwa, kRec}) CHECK(G(r, grp).owned == 0);
  CHECK(r.pools[0].reserved_blocks == 0);
}

TEST_CASE("preempt on a hybrid pool hands the state slot to the record; resume re-admits per group",
          "[core][hybrid_checkpoint]") {
  FakeClock clock;
  auto cache = Cache(&clock);
  const RequestSpec a = HSpec("a", Seq(1, 10));
  Running ra = StartComputed(*cache, a);
  const StepOpResult p = Preempt(*cache, "a", a.prompt, {{kRec, 10, ra.spare}});
  INFO(p.status.ToString());
  REQUIRE(p.status.ok());
  CHECK(p.publish.fresh_slots == std::vector<int64_t>{-1});  // the request ended: no spare
  RequireInvariants(*cache);
  CHECK(cache->GetHandle(a.id).status().code() == absl::StatusCode::kNotFound);
  CHECK(G(cache->Report(), kRec).owned == 1);

  const AcquireResult rb = testing::Start(*cache, HSpec("b", Seq(1, 10), "w1", "a"));
  RequireInvariants(*cache);
  CHECK(rb.resumed);
  CHECK(rb.group_tables[kRec].checkpoint_slot == static_cast<int64_t>(ra.spare));
  CHECK(rb.group_tables[kSwa].blocks == std::vector<BlockIndex>{ra.swa.at(1), ra.swa.at(2)});
  // Preempted again (state in its running slot) and resumed once more: a round trip per group.
  const BlockIndex running_b = rb.group_tables[kRec].blocks[0];
  REQUIRE(GrowAs(*cache, "w1", "b", 2, 10).status.ok());  // the checkpoint was copied: the spare comes
  RequireInvariants(*cache);
  REQUIRE(Preempt(*cache, "b", Concat(Seq(1, 10), {11, 12}), {{kRec, 12, running_b}}, "w1").status.ok());
  RequireInvariants(*cache);
  const AcquireResult rc = testing::Start(*cache, HSpec("c", Seq(1, 10), "w0", "b"));
  RequireInvariants(*cache);
  CHECK(rc.cached_tokens == 12);
  CHECK(rc.resumed_tokens == Concat(Seq(1, 10), {11, 12}));
  CHECK(rc.group_tables[kRec].checkpoint_slot == static_cast<int64_t>(running_b));
  CHECK(rc.group_tables[kSwa].first_block_position == 1);  // (12 - 5) / 4
  REQUIRE(cache->Release(RequestId("c"), true).ok());
  RequireInvariants(*cache);
  for (int grp : {kFull, kSwa, kRec}) CHECK(G(cache->Report(), grp).owned == 0);
}

TEST_CASE("hybrid checkpoint refusals name the field and change nothing", "[core][hybrid_checkpoint]") {
  FakeClock clock;
  auto cache = Cache(&clock, /*with_plain_pool=*/true);
  const RequestSpec a = HSpec("a", Seq(1, 10));
  Running ra = StartComputed(*cache, a);
  const RequestSpec other = HSpec("other", Seq(500, 10));
  Running ro = StartComputed(*cache, other);
  const CacheReport before = cache->Report();
  auto refused = [&](std::vector<StateCheckpoint> state, absl::StatusCode code, const std::string& words) {
    const absl::Status s = cache->Checkpoint(a.id, a.prompt, "", state);
    INFO(s.ToString());
    CHECK(s.code() == code);
    CHECK(absl::StrContains(s.message(), words));
    RequireInvariants(*cache);
    const CacheReport now = cache->Report();
    for (int grp : {kFull, kSwa, kRec}) CHECK(G(now, grp).owned == G(before, grp).owned);
  };
  refused({}, absl::StatusCode::kInvalidArgument, "state_checkpoints");                      // no state
  refused({{kRec, 10, ro.running}}, absl::StatusCode::kInvalidArgument, "is not one of");     // another's slot
  refused({{kRec, 8, ra.running}}, absl::StatusCode::kInvalidArgument, "position_tokens");   // another position
  refused({{kSwa, 10, ra.running}}, absl::StatusCode::kInvalidArgument, "not a state group");
  refused({{kRec, 10, ra.running}, {kRec, 10, ra.spare}}, absl::StatusCode::kInvalidArgument, "twice");
  // A window released past the position: the checkpoint cannot keep what a computation there reads.
  testing::Grow(*cache, "a", 8, 16);
  const absl::Status released =
      cache->Checkpoint(a.id, Seq(1, 4), "", std::vector<StateCheckpoint>{{kRec, 4, ra.running}});
  CHECK(released.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(released.message(), "swa"));
  RequireInvariants(*cache);
  // A plain pool's checkpoint has no state to name.
  const RequestSpec plain = Spec("plain", Seq(1, 9), 4, "m");
  testing::Start(*cache, plain);
  const absl::Status stated =
      cache->Checkpoint(plain.id, Seq(1, 8), "", std::vector<StateCheckpoint>{{0, 8, 0}});
  CHECK(stated.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(stated.message(), "state_checkpoints"));

  // Resumes across groupings: refused naming the pool; both checkpoints stay resumable at home.
  REQUIRE(cache->Checkpoint(plain.id, Seq(1, 8), "p").ok());
  REQUIRE(cache->Release(plain.id, false).ok());
  REQUIRE(Preempt(*cache, "a", a.prompt, {{kRec, 10, ra.running}}).status.ok() == false);  // window gone (c = 16)
  REQUIRE(Preempt(*cache, "other", other.prompt, {{kRec, 10, ro.running}}).status.ok());
  RequireInvariants(*cache);
  RequestSpec cross = HSpec("cross", Seq(1, 9), "w1", "plain");
  REQUIRE(cache->Admit(cross).ok());
  absl::StatusOr<AcquireResult> x = cache->Acquire(cross.id);
  CHECK(x.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(x.status().message(), "another KV grouping"));
  RequireInvariants(*cache);
  RequestSpec back = Spec("back", Seq(500, 10), 4, "m");
  back.resume_from = RequestId("other");
  REQUIRE(cache->Admit(back).ok());
  x = cache->Acquire(back.id);
  CHECK(x.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(x.status().message(), "another KV grouping"));
  RequireInvariants(*cache);
  REQUIRE(cache->Release(cross.id, true).ok());
  REQUIRE(cache->Release(back.id, true).ok());
  CHECK(testing::Start(*cache, HSpec("home", Seq(500, 10), "w1", "other")).resumed);
  RequestSpec home = Spec("home2", Seq(1, 9), 4, "m");
  home.resume_from = RequestId("plain");
  CHECK(testing::Start(*cache, home).resumed);
  RequireInvariants(*cache);
}

TEST_CASE("a worker lost mid-checkpoint on a hybrid pool: fenced per group, nothing leaked, resumed once lifted",
          "[core][hybrid_checkpoint]") {
  FakeClock clock;
  auto cache = Cache(&clock);
  const RequestSpec a = HSpec("a", Seq(1, 10));
  Running ra = StartComputed(*cache, a);
  REQUIRE(cache->Checkpoint(a.id, a.prompt, "es", std::vector<StateCheckpoint>{{kRec, 10, ra.running}}).ok());
  // The stream breaks: the request ends interrupted, what its worker may write is fenced (charged
  // per group), the checkpoint is orphaned.
  REQUIRE(cache->FenceWorker(WorkerId("w0"), 1234, absl::Seconds(30)) == 1);
  RequireInvariants(*cache);
  // Its tail block (position 2 holds token 8, 9 and the next ones) may still be written: no exact
  // resume yet, and nothing changes.
  RequestSpec b = HSpec("b", Seq(1, 10), "w1", "a");
  REQUIRE(cache->Admit(b).ok());
  absl::StatusOr<AcquireResult> early = cache->Acquire(b.id);
  CHECK(early.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(early.status().message(), "cannot be resumed exactly"));
  RequireInvariants(*cache);
  REQUIRE(cache->Release(b.id, true).ok());
  // Lifted by time: the resume goes through with the same units.
  clock.Advance(absl::Seconds(31));
  cache->ExpireFences();
  RequireInvariants(*cache);
  const AcquireResult rc = testing::Start(*cache, HSpec("c", Seq(1, 10), "w1", "a"));
  CHECK(rc.resumed);
  CHECK(rc.group_tables[kRec].checkpoint_slot == static_cast<int64_t>(ra.running));
  CHECK(rc.group_tables[kSwa].blocks == std::vector<BlockIndex>{ra.swa.at(1), ra.swa.at(2)});
  RequireInvariants(*cache);
  REQUIRE(cache->Release(RequestId("c"), true).ok());
  RequireInvariants(*cache);
  const CacheReport r = cache->Report();
  for (int grp : {kFull, kSwa, kRec}) CHECK(G(r, grp).owned == 0);
  CHECK(r.pools[0].reserved_blocks == 0);
}

TEST_CASE("a hybrid pool's units, checkpoints and fences cross a handoff; the successor serves the same",
          "[core][hybrid_checkpoint][handoff]") {
  FakeClock clock;
  auto old_cache = Cache(&clock);
  // A published prompt with the state at 8 (a hit unit), as kv_cache_spine_test publishes it.
  const RequestSpec p = HSpec("p", Seq(1, 17));
  const AcquireResult rp = testing::Start(*old_cache, p);
  testing::Grow(*old_cache, "p", 0, 8);
  REQUIRE(old_cache->Publish(p.id, p.prompt, std::vector<BlockIndex>(rp.blocks.begin(), rp.blocks.begin() + 2),
                             std::vector<StateCheckpoint>{{kRec, 8, rp.group_tables[kRec].blocks[1]}})
              .ok());
  REQUIRE(old_cache->Release(p.id, true).ok());
  // A preempted generation, and a live one whose worker may still write (fenced across).
  const RequestSpec a = HSpec("a", Seq(100, 10));
  Running ra = StartComputed(*old_cache, a);
  REQUIRE(Preempt(*old_cache, "a", a.prompt, {{kRec, 10, ra.running}}).status.ok());
  testing::Start(*old_cache, HSpec("live", Seq(200, 10)));
  REQUIRE(old_cache->EndAllFenced(absl::Seconds(30), {}) == 1);
  RequireInvariants(*old_cache);
  const std::vector<Token> probe = Concat(Seq(1, 16), {99});
  const int64_t peek = *old_cache->PeekPrefixLen(Namespace{.pool = "h"}, probe);
  REQUIRE(peek == 8);

  const CacheSnapshot snap = old_cache->ExportSnapshot();
  REQUIRE(snap.checkpoints.size() == 1);
  REQUIRE(snap.checkpoints[0].groups.size() == 3);
  auto fresh = Cache(&clock);
  REQUIRE(fresh->ImportSnapshot(snap).ok());
  RequireInvariants(*fresh);
  CHECK(*fresh->PeekPrefixLen(Namespace{.pool = "h"}, probe) == peek);
  // The same hit, unit by unit, on both.
  const AcquireResult h_old = testing::Start(*old_cache, HSpec("q", probe));
  const AcquireResult h_new = testing::Start(*fresh, HSpec("q", probe));
  CHECK(h_new.cached_tokens == h_old.cached_tokens);
  CHECK(std::vector<BlockIndex>(h_new.blocks.begin(), h_new.blocks.begin() + 2) ==
        std::vector<BlockIndex>(h_old.blocks.begin(), h_old.blocks.begin() + 2));
  CHECK(h_new.group_tables[kSwa].first_block_position == h_old.group_tables[kSwa].first_block_position);
  CHECK(std::vector<BlockIndex>(h_new.group_tables[kSwa].blocks.begin(), h_new.group_tables[kSwa].blocks.begin() + 2) ==
        std::vector<BlockIndex>(h_old.group_tables[kSwa].blocks.begin(), h_old.group_tables[kSwa].blocks.begin() + 2));
  CHECK(h_new.group_tables[kRec].checkpoint_slot == h_old.group_tables[kRec].checkpoint_slot);
  RequireInvariants(*fresh);
  // The preempted generation resumes on the successor with the same units.
  const AcquireResult rb = testing::Start(*fresh, HSpec("b", Seq(100, 10), "w1", "a"));
  CHECK(rb.resumed);
  CHECK(rb.group_tables[kRec].checkpoint_slot == static_cast<int64_t>(ra.running));
  CHECK(rb.group_tables[kSwa].blocks == std::vector<BlockIndex>{ra.swa.at(1), ra.swa.at(2)});
  RequireInvariants(*fresh);
  // The live request's units stay fenced (charged per group) until their time.
  clock.Advance(absl::Seconds(31));
  fresh->ExpireFences();
  RequireInvariants(*fresh);

  // A successor whose pool has other groups refuses the snapshot, naming them, and changes nothing.
  auto other = Cache(&clock, false, /*window=*/10);
  CacheOptions o = testing::SmallOptions();
  PoolGeometry two = Hybrid();
  two.groups.pop_back();  // no state group
  two.groups[0].layers = {0, 2, 3};
  two.groups[0].capacity = 64;
  two.groups[1].capacity = 64;
  REQUIRE(two.ResolveGroups().ok());
  o.pools = {two};
  auto regrouped = testing::MakeCache(o, &clock);
  const absl::StatusOr<int64_t> refused = regrouped->ImportSnapshot(snap);
  INFO(refused.status().ToString());
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(refused.status().message(), "groups changed"));
  CHECK(regrouped->Report().pools[0].cached_blocks == 0);
  RequireInvariants(*regrouped);
}


// Random starts (some hitting published prefixes, some resuming), grows, live checkpoints,
// preempts, publishing ends, releases, lost workers and handoffs on a tight hybrid pool: every
// call answers a clear status, the checker passes after each, and a snapshot taken at any point
// imports into a fresh cache whose checker passes too.
TEST_CASE("randomized hybrid checkpoints, preempts, resumes, fences and handoffs keep every invariant",
          "[core][hybrid_checkpoint]") {
  int64_t checkpoints = 0, preempts = 0, resumes = 0, refused_resumes = 0, carried = 0, fenced = 0;
  int64_t successor_resumes = 0;
  for (uint32_t seed = 1; seed <= 6; ++seed) {
    INFO("seed " << seed);
    std::mt19937 rng(seed);
    auto pick = [&rng](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
    FakeClock clock;
    CacheOptions o = testing::SmallOptions();
    PoolGeometry g = Hybrid();
    g.max_model_len = 48;
    g.groups[0].capacity = 24;  // tight: evictions and refusals happen
    g.groups[1].capacity = 16;
    g.groups[2].capacity = 10;
    const absl::Status resolved = g.ResolveGroups();
    INFO(resolved.ToString());
    REQUIRE(resolved.ok());
    o.pools = {g};
    auto cache = testing::MakeCache(o, &clock);
    struct Live {
      std::string worker;
      int64_t n = 0, c = 0;
      std::vector<BlockIndex> slots;
      int64_t known = 0;  // tokens kvd knows for it (prompt or resumed, then checkpoints)
    };
    std::map<std::string, Live> live;
    std::vector<std::string> orphans;
    int next = 0;
    // Token at position i: the prompt's, then a generated one, the same for every request.
    auto token = [](int64_t i) { return static_cast<Token>(i < 6 ? 1 + i : 1000 + i); };
    auto tokens = [&](int64_t n) {
      std::vector<Token> t;
      for (int64_t i = 0; i < n; ++i) t.push_back(token(i));
      return t;
    };
    auto grown = [&](const std::string& id, const StepOpResult& r) {
      if (!r.status.ok() || r.group_tables.size() <= static_cast<size_t>(kRec)) return;
      for (BlockIndex b : r.group_tables[kRec].blocks) live[id].slots.push_back(b);
    };
    auto acquired = [&](const std::string& id, const std::string& worker, const AcquireResult& a) {
      Live l{worker, a.num_tokens, a.cached_tokens, a.group_tables[kRec].blocks, a.num_tokens};
      live[id] = l;
    };
    for (int op = 0; op < 300; ++op) {
      const int64_t what = pick(0, 9);
      const std::string worker = pick(0, 1) == 0 ? "w0" : "w1";
      if (what <= 1 || live.empty()) {  // a start, or a resume of an orphaned checkpoint
        const std::string id = absl::StrCat("r", next++);
        RequestSpec spec = HSpec(id, tokens(pick(5, 12)), worker);
        if (!orphans.empty() && pick(0, 1) == 0) {
          const size_t k = static_cast<size_t>(pick(0, static_cast<int64_t>(orphans.size()) - 1));
          spec.resume_from = RequestId(orphans[k]);
          spec.prompt = tokens(5);
        }
        const absl::StatusOr<AdmitResult> admitted = cache->Admit(spec);
        if (admitted.ok() && admitted->decision == AdmitDecision::kAdmitted) {
          const absl::StatusOr<AcquireResult> a = cache->Acquire(spec.id);
          if (a.ok()) {
            acquired(id, worker, *a);
            resumes += a->resumed ? 1 : 0;
            if (a->resumed) orphans.erase(std::find(orphans.begin(), orphans.end(), spec.resume_from.value()));
          } else {
            INFO(a.status().ToString());
            CHECK((absl::IsResourceExhausted(a.status()) || absl::IsFailedPrecondition(a.status())));
            ++refused_resumes;
            REQUIRE(cache->Release(spec.id, true).ok());
          }
        }
      } else {
        auto it = live.begin();
        std::advance(it, pick(0, static_cast<int64_t>(live.size()) - 1));
        const std::string id = it->first;
        Live& l = it->second;
        if (what <= 4) {  // a grow reporting computed tokens
          const int64_t more = std::min<int64_t>(pick(0, 4), 40 - l.n);
          const int64_t c = pick(l.c, std::min(l.n + more, l.c + 8));
          const StepOpResult r = GrowAs(*cache, l.worker, id, more, c);
          if (r.status.ok()) {
            l.n += more;
            l.c = c;
            grown(id, r);
          } else {
            CHECK(absl::IsResourceExhausted(r.status));
          }
        } else if (what <= 6 && l.c > 0 && !l.slots.empty()) {  // a live checkpoint or a preempt
          const BlockIndex slot = l.slots[static_cast<size_t>(pick(0, static_cast<int64_t>(l.slots.size()) - 1))];
          if (what == 5) {
            std::vector<int64_t> fresh;
            const absl::Status s =
                cache->Checkpoint(RequestId(id), tokens(l.c), "s", std::vector<StateCheckpoint>{{kRec, l.c, slot}}, &fresh);
            if (s.ok()) {
              REQUIRE(fresh.size() == 1);
              *std::find(l.slots.begin(), l.slots.end(), slot) = static_cast<BlockIndex>(fresh[0]);
              l.known = std::max(l.known, l.c);
              ++checkpoints;
            } else {
              INFO(s.ToString());
              CHECK(absl::IsResourceExhausted(s));
            }
          } else {
            const StepOpResult r = Preempt(*cache, id, tokens(l.c), {{kRec, l.c, slot}}, l.worker);
            INFO(r.status.ToString());
            REQUIRE((r.status.ok() || absl::IsResourceExhausted(r.status)));
            if (r.status.ok()) {
              ++preempts;
              REQUIRE_FALSE(cache->GetHandle(RequestId(id)).ok());
              orphans.push_back(id);
              live.erase(id);
            }
          }
        } else if (what == 7) {  // ends, publishing its computed blocks
          const absl::StatusOr<PublishResult> e = cache->End(RequestId(id), std::min(l.c, l.known) / 4, {}, pick(0, 1) == 0);
          INFO(e.status().ToString());
          REQUIRE(e.ok());
          live.erase(id);
        } else if (what == 8) {  // its worker is lost: every request of it ends fenced
          fenced += cache->FenceWorker(WorkerId(l.worker), 0, absl::Seconds(5));
          std::erase_if(live, [&](const auto& r) { return !cache->GetHandle(RequestId(r.first)).ok(); });
        } else {  // time passes; a handoff's snapshot imports into a fresh cache
          clock.Advance(absl::Seconds(pick(0, 6)));
          cache->ExpireFences();
          auto fresh = testing::MakeCache(o, &clock);
          const CacheSnapshot snap = cache->ExportSnapshot();
          carried += static_cast<int64_t>(snap.checkpoints.size());
          const absl::StatusOr<int64_t> imported = fresh->ImportSnapshot(snap);
          INFO(imported.status().ToString());
          REQUIRE(imported.ok());
          RequireInvariants(*fresh);
          if (!snap.checkpoints.empty()) {  // the successor resumes one, exactly or with a clear refusal
            RequestSpec spec = HSpec("successor", tokens(5), "w9", snap.checkpoints[0].id.value());
            REQUIRE(fresh->Admit(spec).ok());
            const absl::StatusOr<AcquireResult> a = fresh->Acquire(spec.id);
            INFO(a.status().ToString());
            CHECK((a.ok() ? a->resumed : (absl::IsResourceExhausted(a.status()) || absl::IsFailedPrecondition(a.status()))));
            successor_resumes += a.ok() ? 1 : 0;
            RequireInvariants(*fresh);
            REQUIRE(fresh->Release(spec.id, true).ok());
            RequireInvariants(*fresh);
          }
        }
      }
      RequireInvariants(*cache);
    }
  }
  INFO(checkpoints << " checkpoints, " << preempts << " preempts, " << resumes << " resumes (" << refused_resumes
                   << " refused), " << carried << " carried by snapshots, " << successor_resumes
                   << " resumed by successors, " << fenced << " fenced");
  CHECK(checkpoints > 10);
  CHECK(preempts > 10);
  CHECK(resumes > 5);
  CHECK(carried > 5);
  CHECK(successor_resumes > 5);
  CHECK(fenced > 0);
}

TEST_CASE("a hybrid checkpoint restored from G3 gets units of every group in record order and resumes exactly",
          "[core][hybrid_checkpoint]") {
  FakeClock clock;
  auto cache = Cache(&clock, /*with_plain_pool=*/true);
  const Namespace ns{.pool = "h"};
  // What a checkpoint at 10 tokens holds: full [0, 3), swa [1, 3) (positions 5..9), one state slot.
  const std::vector<int64_t> units = {3, 2, 1};
  const auto unchanged = [&] {
    RequireInvariants(*cache);
    const CacheReport r = cache->Report();
    for (int grp : {kFull, kSwa, kRec}) CHECK(G(r, grp).owned == 0);
    CHECK(r.pools[0].reserved_blocks == 0);
    CHECK(r.orphaned_checkpoints == 0);
  };
  // Refusals change nothing: no group counts for a hybrid pool, counts for a plain one, and
  // counts of another grouping (a record written under a 5- or 9-token window holds others).
  CHECK(cache->RestoreCheckpoint(RequestId("r"), ns, Seq(1, 10), "es", {}).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(cache->RestoreCheckpoint(RequestId("r"), Namespace{.pool = testing::SmallOptions().pools[0].name},
                                 Seq(1, 10), "es", units)
            .status()
            .code() == absl::StatusCode::kInvalidArgument);
  for (const std::vector<int64_t>& other : {std::vector<int64_t>{3, 3, 1}, std::vector<int64_t>{3, 2, 0},
                                            std::vector<int64_t>{3, 2}}) {
    const absl::Status s = cache->RestoreCheckpoint(RequestId("r"), ns, Seq(1, 10), "es", other).status();
    CHECK((s.code() == absl::StatusCode::kFailedPrecondition || s.code() == absl::StatusCode::kInvalidArgument));
    CHECK(absl::StrContains(s.message(), "group_units"));
  }
  unchanged();

  auto restored = cache->RestoreCheckpoint(RequestId("r"), ns, Seq(1, 10), "es", units);
  REQUIRE(restored.ok());
  REQUIRE(restored->size() == 6);
  RequireInvariants(*cache);
  CacheReport r = cache->Report();
  CHECK(G(r, kFull).owned == 3);
  CHECK(G(r, kSwa).owned == 2);
  CHECK(G(r, kRec).owned == 1);
  CHECK(r.orphaned_checkpoints == 1);
  CHECK(cache->checkpoints_not_durable() == 0);  // it came from G3
  const PoolGeometry& geo = cache->pools()[0];
  for (size_t i = 0; i < restored->size(); ++i) CHECK(geo.GroupOf((*restored)[i]) == (i < 3 ? kFull : i < 5 ? kSwa : kRec));
  CHECK(cache->RestoreCheckpoint(RequestId("r"), ns, Seq(1, 10), "es", units).status().code() ==
        absl::StatusCode::kAlreadyExists);

  const AcquireResult rb = testing::Start(*cache, HSpec("b", Seq(1, 10), "w1", "r"));
  RequireInvariants(*cache);
  CHECK(rb.resumed);
  CHECK(rb.cached_tokens == 10);
  CHECK(rb.engine_state == "es");
  CHECK(std::vector<BlockIndex>(rb.blocks.begin(), rb.blocks.begin() + 3) ==
        std::vector<BlockIndex>(restored->begin(), restored->begin() + 3));
  CHECK(rb.group_tables[kSwa].first_block_position == 1);
  CHECK(rb.group_tables[kSwa].blocks == std::vector<BlockIndex>{(*restored)[3], (*restored)[4]});
  CHECK(rb.group_tables[kRec].checkpoint_slot == static_cast<int64_t>((*restored)[5]));
  REQUIRE(cache->End(RequestId("b"), 0, {}, true).ok());
  unchanged();
}

}  // namespace
}  // namespace kvd
