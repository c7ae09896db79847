// Drives long random sequences of operations against KvCache and a reference model of what each
// request holds and what bytes each block contains (a simulated data plane: each block slot holds
// the token id whose "KV" was written there). After every step the cache's own invariant check
// must pass, and every reused or resumed block must hold exactly the tokens the request expects:
// the cache may never serve wrong KV.
#include <map>
#include <random>
#include <utility>

#include <catch2/catch.hpp>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "server/core/kv_cache.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using namespace kvd::testing;

constexpr int kBt = 4;
constexpr Token kPoison = 0xFFFFFFFF;

struct ModelRequest {
  RequestSpec spec;
  bool acquired = false;
  std::vector<BlockIndex> table;
  int64_t num_tokens = 0;
  std::vector<Token> tokens;  // the request's full token sequence so far
  bool has_checkpoint = false;
  std::vector<Token> checkpoint_tokens;
  bool pulled = false;  // a pull (PinBlocks) writes its table now: the worker does not touch it
};

class Harness {
 public:
  explicit Harness(uint32_t seed) : rng_(seed) {
    auto o = SmallOptions(48);
    o.checkpoint_budget_bytes = 12 * 64;
    o.session_ttl = absl::Seconds(20);
    o.checkpoint_ttl = absl::Seconds(40);
    o.session_max_protected_blocks = 3;
    o.max_requests_per_worker = 6;
    o.boundary_high_watermark = 0.95;
    o.boundary_low_watermark = 0.85;
    // Seeds run LRU, SLRU and the horizon policy in turn: their invariants are the same. The
    // horizon policy's shadows see every key of the small pool, and its horizons are short, so
    // both of its orders and both overdue rules take turns.
    if (seed % 3 != 0) {
      o.eviction_policy = seed % 3 == 1 ? EvictionPolicy::kSlru : EvictionPolicy::kHorizon;
      o.slru_main_fraction = 0.5;
      o.slru_ghost_fraction = 4;
      o.horizon_sample_every = 1;
      o.horizon_probation = 0.5;
      o.horizon_main = 1;
    }
    cache_ = MakeCache(o, &clock_);
    memory_.assign(48, std::vector<Token>(kBt, kPoison));
  }

  void Step() {
    int op = Uniform(0, 99);
    if (op < 22) Admit();
    else if (op < 42) Acquire();
    else if (op < 55) Extend();
    else if (op < 67) Publish();
    else if (op < 75) Checkpoint();
    else if (op < 90) Release();
    else if (op < 91) cache_->Gc(absl::Seconds(Uniform(0, 5)));
    else if (op < 94) cache_->Boundary();
    else if (op < 95) Uniform(0, 3) == 0 ? cache_->ClearCache() : 0;
    else if (op < 96) KillWorker();
    else if (op < 98) Uniform(0, 1) == 0 ? Pull() : Unpin();
    else clock_.Advance(absl::Seconds(Uniform(1, 10)));
    RequireInvariants(*cache_);
    auto r = cache_->Report();
    const auto& p = r.pools[0];
    REQUIRE(p.free_blocks + p.owned_blocks + p.cached_blocks == p.capacity_blocks);
    REQUIRE(r.reserved_bytes <= r.budget_bytes);
    REQUIRE(r.live_requests == static_cast<int64_t>(live_.size()));
  }

 const KvCache& cache() const { return *cache_; }

 private:
  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  template <typename Map>
  typename Map::iterator Pick(Map& m) {
    auto it = m.begin();
    std::advance(it, Uniform(0, static_cast<int>(m.size()) - 1));
    return it;
  }

  // Prompts come from a few families so that prefixes are shared often.
  std::vector<Token> Prompt() {
    int family = Uniform(0, 3);
    int shared = Uniform(0, 16);
    std::vector<Token> p = Seq(family * 1000, shared);
    int extra = Uniform(shared == 0 ? 1 : 0, 12);
    for (int i = 0; i < extra; ++i) p.push_back(Uniform(0, 2) == 0 ? 7 : Uniform(0, 50000));
    return p;
  }

  Token Generated(const RequestSpec& spec, int64_t pos) {
    return static_cast<Token>(absl::HashOf(spec.id.value(), pos) % 100000);
  }

  void Admit() {
    RequestSpec spec = Spec("r" + std::to_string(next_id_++), Prompt(), Uniform(0, 12));
    if (Uniform(0, 3) == 0) spec.ns.cache_salt = "tenant";
    if (Uniform(0, 2) == 0) spec.session = SessionId("s" + std::to_string(Uniform(0, 3)));
    spec.owner = WorkerId("w" + std::to_string(Uniform(0, 2)));
    if (!orphans_.empty() && Uniform(0, 1) == 0) {
      auto it = Pick(orphans_);
      spec.resume_from = RequestId(it->first);
      spec.prompt = it->second.first.spec.prompt;
      spec.ns = it->second.first.spec.ns;
    }
    auto r = cache_->Admit(spec);
    if (!r.ok()) {
      // The per-worker limit, or a session id another tenant (salt) holds.
      REQUIRE((r.status().code() == absl::StatusCode::kResourceExhausted ||
               r.status().code() == absl::StatusCode::kPermissionDenied));
      return;
    }
    if (r->decision != AdmitDecision::kAdmitted) return;
    ModelRequest m;
    m.spec = spec;
    m.tokens = spec.prompt;
    live_.emplace(spec.id.value(), std::move(m));
  }

  void Acquire() {
    std::vector<std::string> waiting;
    for (auto& [id, m] : live_) {
      if (!m.acquired) waiting.push_back(id);
    }
    if (waiting.empty()) return;
    ModelRequest& m = live_[waiting[Uniform(0, static_cast<int>(waiting.size()) - 1)]];
    auto r = cache_->Acquire(m.spec.id);
    INFO(r.status().ToString());
    // Blocks a pull still pins after its request ended are held outside the budget.
    if (absl::IsResourceExhausted(r.status()) && !pulls_.empty()) return;
    REQUIRE(r.ok());
    m.acquired = true;
    m.table = r->blocks;
    m.num_tokens = r->num_tokens;
    if (r->resumed) {
      auto it = orphans_.find(m.spec.resume_from.value());
      REQUIRE(it != orphans_.end());
      const std::vector<Token>& ckpt = it->second.second;
      REQUIRE(r->resumed_tokens == (ckpt.size() >= m.spec.prompt.size() ? ckpt : m.spec.prompt));
      m.tokens = r->resumed_tokens;
      orphans_.erase(it);
    } else {
      REQUIRE(r->num_tokens == static_cast<int64_t>(m.spec.prompt.size()));
      REQUIRE(r->cached_tokens < r->num_tokens);  // at least one token left to compute
    }
    REQUIRE(static_cast<int64_t>(m.table.size()) == (m.num_tokens + kBt - 1) / kBt);
    // Reused (or resumed) KV must be exactly this request's tokens.
    for (int64_t p = 0; p < r->cached_tokens; ++p) {
      REQUIRE(memory_[m.table[p / kBt]][p % kBt] == m.tokens[p]);
    }
    Write(m, r->cached_tokens, m.num_tokens);
  }

  // The engine computes KV for positions [from, to) and writes it in place.
  void Write(const ModelRequest& m, int64_t from, int64_t to) {
    for (int64_t p = from; p < to; ++p) {
      const BlockIndex b = m.table[p / kBt];
      for (const auto& [id, other] : live_) {
        if (&other == &m) continue;
        for (BlockIndex ob : other.table) REQUIRE(ob != b);  // writable by exactly one request
      }
      memory_[b][p % kBt] = m.tokens[p];
    }
  }

  ModelRequest* PickAcquired() {
    std::vector<ModelRequest*> v;
    for (auto& [id, m] : live_) {
      if (m.acquired && !m.pulled) v.push_back(&m);
    }
    return v.empty() ? nullptr : v[Uniform(0, static_cast<int>(v.size()) - 1)];
  }

  void Extend() {
    ModelRequest* m = PickAcquired();
    if (m == nullptr) return;
    const int add = Uniform(1, 6);
    auto before = cache_->GetHandle(m->spec.id);
    auto r = cache_->Extend(m->spec.id, add);
    if (!r.ok()) {
      REQUIRE((r.status().code() == absl::StatusCode::kOutOfRange ||
               r.status().code() == absl::StatusCode::kResourceExhausted));
      REQUIRE(cache_->GetHandle(m->spec.id)->blocks == before->blocks);
      return;
    }
    m->table.insert(m->table.end(), r->begin(), r->end());
    const int64_t from = m->num_tokens;
    m->num_tokens += add;
    for (int64_t p = from; p < m->num_tokens; ++p) {
      if (p >= static_cast<int64_t>(m->tokens.size())) m->tokens.push_back(Generated(m->spec, p));
    }
    Write(*m, from, m->num_tokens);
  }

  void Publish() {
    ModelRequest* m = PickAcquired();
    if (m == nullptr) return;
    const int64_t full = m->num_tokens / kBt;
    const int64_t n = Uniform(0, static_cast<int>(full));
    std::vector<Token> tokens(m->tokens.begin(), m->tokens.begin() + m->num_tokens);
    std::vector<BlockIndex> blocks(m->table.begin(), m->table.begin() + n);
    auto keeps = cache_->Keeps(m->spec.id, tokens, blocks);
    REQUIRE(keeps.ok());
    auto r = cache_->Publish(m->spec.id, tokens, blocks);
    REQUIRE(r.ok());
    REQUIRE(r->outcomes == keeps->outcomes);
  }

  void Checkpoint() {
    ModelRequest* m = PickAcquired();
    if (m == nullptr) return;
    const int64_t n = Uniform(1, static_cast<int>(m->num_tokens));
    std::vector<Token> tokens(m->tokens.begin(), m->tokens.begin() + n);
    REQUIRE(cache_->Checkpoint(m->spec.id, tokens, "state").ok());
    m->has_checkpoint = true;
    m->checkpoint_tokens = tokens;
  }

  void Finish(ModelRequest& m, bool completed) {
    if (!completed && m.has_checkpoint) {
      orphans_[m.spec.id.value()] = {m, m.checkpoint_tokens};
    }
    // A resumed request that completes or dies consumed the checkpoint it came from.
    if (m.acquired && !m.spec.resume_from.empty()) orphans_.erase(m.spec.resume_from.value());
  }

  void Release() {
    if (live_.empty()) return;
    auto it = Pick(live_);
    const bool completed = Uniform(0, 2) != 0;
    const RequestId id = it->second.spec.id;
    REQUIRE(cache_->Release(id, completed).ok());
    Finish(it->second, completed);
    live_.erase(it);
    REQUIRE(cache_->Release(id, true).code() == absl::StatusCode::kNotFound);
  }

  // A pull pins a request's whole table and writes its owned blocks (a tier's promotion, a peer's
  // blocks); the request may end meanwhile. No other request is handed them until Unpin.
  void Pull() {
    ModelRequest* m = PickAcquired();
    if (m == nullptr) return;
    // It pins the table as kvd hands it: at a published duplicate's position that is the cached
    // block (the engine's own copy there is never written again), so what it pins is a chain.
    const std::vector<BlockIndex> table = cache_->GetHandle(m->spec.id)->blocks;
    REQUIRE(cache_->PinBlocks(m->spec.id, table).ok());
    // Another pull of the same blocks is refused while this one writes them.
    const absl::Status again = cache_->PinBlocks(m->spec.id, table);
    REQUIRE((again.ok() || absl::IsFailedPrecondition(again)));
    if (again.ok()) cache_->UnpinBlocks(0, table);  // the table had no owned block left
    m->pulled = true;
    pulls_.push_back(table);
    pulled_by_.push_back(m->spec.id.value());
  }

  void Unpin() {
    if (pulls_.empty()) return;
    const size_t i = static_cast<size_t>(Uniform(0, static_cast<int>(pulls_.size()) - 1));
    cache_->UnpinBlocks(0, pulls_[i]);
    if (auto it = live_.find(pulled_by_[i]); it != live_.end()) it->second.pulled = false;
    pulls_.erase(pulls_.begin() + static_cast<std::ptrdiff_t>(i));
    pulled_by_.erase(pulled_by_.begin() + static_cast<std::ptrdiff_t>(i));
  }

  void KillWorker() {
    WorkerId w("w" + std::to_string(Uniform(0, 2)));
    int64_t expected = 0;
    for (auto it = live_.begin(); it != live_.end();) {
      if (it->second.spec.owner == w) {
        Finish(it->second, false);
        it = live_.erase(it);
        ++expected;
      } else {
        ++it;
      }
    }
    REQUIRE(cache_->ReleaseWorker(w) == expected);
  }

  std::mt19937 rng_;
  FakeClock clock_;
  std::unique_ptr<KvCache> cache_;
  std::vector<std::vector<Token>> memory_;
  std::map<std::string, ModelRequest> live_;
  // Interrupted generations that may be resumed: id -> (request, checkpoint tokens). The cache may
  // have dropped some (budget, TTL); then a resume falls back to prefix reuse.
  std::map<std::string, std::pair<ModelRequest, std::vector<Token>>> orphans_;
  std::vector<std::vector<BlockIndex>> pulls_;  // the tables pulls pinned, and for which request
  std::vector<std::string> pulled_by_;
  int next_id_ = 0;
};

TEST_CASE("Random operation sequences keep every invariant and never serve wrong KV", "[core][randomized]") {
  for (uint32_t seed : {1u, 2u, 3u, 4u, 5u, 6u}) {
    INFO("seed " << seed);
    Harness h(seed);
    for (int step = 0; step < 2500; ++step) h.Step();
    // The run exercised what it claims to: reuse, resume, eviction, duplicates.
    CacheReport r = h.cache().Report();
    CHECK(r.hit_tokens > 0);
    CHECK(r.resumed > 0);
    CHECK(r.evictions[static_cast<int>(EvictReason::kCapacity)] > 0);
    CHECK(r.published_blocks > 0);
    CHECK(r.duplicate_blocks > 0);  // chains continued past them (the checker holds after each)
    CHECK(r.waited > 0);
  }
}

// Issue 40, items 1 and 5: several workers step with block credit the way the clients do. Each
// places credit into its requests in its own process and reports it later (placed, unreported);
// some steps' answers are lost (the client drops its credit and re-syncs); another worker's large
// requests push pressure to high and critical and back; a worker's stream breaks (its requests and
// credit fenced for that attachment, lifted when it re-attaches or by time). After every step the
// ownership ledger must agree with everything, and every block a worker may be writing through its
// credit (held or placed, unreported) must still be that worker's credit: kvd took none of it and
// handed none of it to anyone else.
class StepHarness {
 public:
  explicit StepHarness(uint32_t seed) : rng_(seed) {
    CacheOptions o = SmallOptions(96);
    o.step_credit_blocks = 12;
    cache_ = MakeCache(o, &clock_);
    for (int i = 0; i < 3; ++i) workers_.push_back(Worker{WorkerId(absl::StrCat("w", i))});
  }
  KvCache& cache() { return *cache_; }
  int64_t lost() const { return lost_; }
  int64_t fences() const { return fences_; }
  int64_t asked() const { return asked_; }

  void Step() {
    const int pick = static_cast<int>(rng_() % 16);
    if (pick == 0 || pick == 1) return Pressure();
    if (pick == 2) return LoseStream(workers_[rng_() % workers_.size()]);
    if (pick == 3) return Lift();
    Worker& w = workers_[rng_() % workers_.size()];
    // The engine's decode: covered growth placed at once, without a round trip.
    bool must_send = false;
    for (Live& r : w.live) {
      if (r.broken || rng_() % 3 == 0) continue;
      if (r.tokens + 1 > r.max_tokens) continue;
      const bool crosses = (r.tokens + 1 + kBt - 1) / kBt > r.table;
      if (crosses && w.credit.empty()) {
        must_send = true;
        continue;
      }
      ++r.tokens;
      ++r.held_tokens;
      if (crosses) {
        r.placed.push_back(w.credit.back());
        w.credit.pop_back();
        ++r.table;
      }
    }
    if (must_send || w.credit.size() < 4 || rng_() % 3 == 0) Sync(w);
    Check();
  }

  void Check() {
    RequireInvariants(*cache_);
    for (const Worker& w : workers_) {
      std::vector<BlockIndex> believed = w.credit;
      for (const Live& r : w.live) believed.insert(believed.end(), r.placed.begin(), r.placed.end());
      absl::Status s = cache_->CheckCreditForTesting(w.id, 0, believed);
      INFO(s.ToString());
      REQUIRE(s.ok());
    }
  }

 private:
  struct Live {
    RequestId id;
    int64_t tokens = 0;
    int64_t max_tokens = 0;
    int64_t table = 0;
    int64_t held_tokens = 0;          // grown here, not told yet
    std::vector<BlockIndex> placed;   // credit placed into it, not told yet
    bool broken = false;              // a step naming it lost its answer: only ended now
  };
  struct Worker {
    WorkerId id;
    std::vector<BlockIndex> credit;   // what the last answer listed, less what was placed since
    int64_t wanted = 0;               // what kvd asked back in its last answer
    std::vector<Live> live;
  };

  // A step that goes out: held growth, ends, and the credit (returning what kvd asked for).
  void Sync(Worker& w) {
    std::vector<StepOp> ops;
    std::vector<size_t> op_live;  // ops[k] is about w.live[op_live[k]]
    for (size_t i = 0; i < w.live.size(); ++i) {
      Live& r = w.live[i];
      StepOp op;
      op.id = r.id;
      if (r.broken) {
        op.kind = StepOpKind::kPreempt;  // only an end or preempt for a request that was named
      } else if (r.held_tokens > 0) {
        op.kind = StepOpKind::kGrow;
        op.tokens = r.held_tokens;
        op.credit_blocks = r.placed;
      } else if (rng_() % 6 == 0) {
        op.kind = StepOpKind::kEnd;
        op.completed = true;
      } else {
        continue;
      }
      ops.push_back(std::move(op));
      op_live.push_back(i);
    }
    CreditWant want{0, 12, {}};
    for (int64_t k = 0; k < w.wanted && !w.credit.empty(); ++k) {
      want.returned.push_back(w.credit.back());
      w.credit.pop_back();
    }
    std::vector<CreditHeld> held;
    std::vector<StepOpResult> results = cache_->Step(w.id, w.id, ops, {want}, &held);
    const bool answer_lost = rng_() % 10 == 0;
    std::vector<bool> gone(w.live.size(), false);
    for (size_t k = 0; k < ops.size(); ++k) {
      Live& r = w.live[op_live[k]];
      if (ops[k].kind != StepOpKind::kGrow) {
        REQUIRE(results[k].status.ok());
        gone[op_live[k]] = true;
      } else if (answer_lost) {
        // Unknown outcome: the request it named can no longer be trusted.
        r.broken = true;
        r.placed.clear();
        r.held_tokens = 0;
      } else {
        INFO(results[k].status.ToString());
        REQUIRE(results[k].status.ok());
        r.table += static_cast<int64_t>(results[k].blocks.size() - r.placed.size());
        r.placed.clear();
        r.held_tokens = 0;
      }
    }
    if (answer_lost) {
      // The credit list is dropped until an answer lists it again: nothing is placed meanwhile.
      ++lost_;
      w.credit.clear();
      w.wanted = 0;
    } else {
      w.credit = held.empty() ? std::vector<BlockIndex>{} : held[0].blocks;
      w.wanted = held.empty() ? 0 : held[0].wanted;
      asked_ += w.wanted > 0 ? 1 : 0;
    }
    std::vector<Live> keep;
    for (size_t i = 0; i < w.live.size(); ++i) {
      if (!gone[i]) keep.push_back(std::move(w.live[i]));
    }
    w.live = std::move(keep);
    // New requests, when they fit.
    while (w.live.size() < 4) {
      const int n = next_++;
      RequestSpec spec = Spec(absl::StrCat("r", n), Seq(static_cast<Token>(100 * n), 1 + rng_() % 9), 12);
      spec.owner = w.id;
      absl::StatusOr<AdmitResult> a = cache_->Admit(spec);
      if (!a.ok() || a->decision != AdmitDecision::kAdmitted) break;
      absl::StatusOr<AcquireResult> acq = cache_->Acquire(spec.id);
      REQUIRE(acq.ok());
      Live r;
      r.id = spec.id;
      r.tokens = static_cast<int64_t>(spec.prompt.size());
      r.max_tokens = r.tokens + 12;
      r.table = static_cast<int64_t>(acq->blocks.size());
      w.live.push_back(std::move(r));
    }
  }

  // The worker's attach stream breaks: kvd fences its requests and credit (KvCache::FenceWorker)
  // for its attachment, and it attaches again as a new one with nothing.
  void LoseStream(Worker& w) {
    const uint32_t pid = 1000 + static_cast<uint32_t>(fenced_.size());
    REQUIRE(cache_->FenceWorker(w.id, pid, absl::Seconds(10)) == static_cast<int64_t>(w.live.size()));
    fenced_.push_back({w.id, pid});
    ++fences_;
    w.id = WorkerId(absl::StrCat(w.id.value(), "+"));
    w.credit.clear();
    w.wanted = 0;
    w.live.clear();
    Check();
  }

  // A fenced attachment re-attaches quiesced (LiftFences), or time passes (ExpireFences).
  void Lift() {
    if (fenced_.empty()) return;
    if (rng_() % 2 == 0) {
      const size_t i = rng_() % fenced_.size();
      cache_->LiftFences(fenced_[i].first, fenced_[i].second);
      fenced_.erase(fenced_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      clock_.Advance(absl::Seconds(5));
      cache_->ExpireFences();
    }
    Check();
  }

  // Another worker's large requests come and go: pressure high, critical, then normal again.
  void Pressure() {
    if (!big_.empty()) {
      REQUIRE(cache_->Release(big_.back(), true).ok());
      big_.pop_back();
      return;
    }
    for (int i = 0; i < 3; ++i) {
      const int n = next_++;
      RequestSpec spec = Spec(absl::StrCat("big", n), Seq(static_cast<Token>(90000 + 1000 * n), 80), 0);
      spec.owner = WorkerId("hog");
      absl::StatusOr<AdmitResult> a = cache_->Admit(spec);
      if (!a.ok() || a->decision != AdmitDecision::kAdmitted) break;
      REQUIRE(cache_->Acquire(spec.id).ok());
      big_.push_back(spec.id);
    }
  }

  std::mt19937 rng_;
  FakeClock clock_;
  std::unique_ptr<KvCache> cache_;
  std::vector<Worker> workers_;
  std::vector<RequestId> big_;
  std::vector<std::pair<WorkerId, uint32_t>> fenced_;  // attachments whose fences may hold still
  int next_ = 0;
  int64_t fences_ = 0;
  int64_t lost_ = 0;
  int64_t asked_ = 0;
};

TEST_CASE("Random steps with credit under pressure, lost answers and lost streams keep one writer per block",
          "[core][randomized][step]") {
  for (uint32_t seed : {1u, 2u, 3u, 4u}) {
    INFO("seed " << seed);
    StepHarness h(seed);
    for (int step = 0; step < 1500; ++step) h.Step();
    CHECK(h.lost() > 0);
    CHECK(h.asked() > 0);
    CHECK(h.fences() > 0);
  }
}

}  // namespace
}  // namespace kvd
