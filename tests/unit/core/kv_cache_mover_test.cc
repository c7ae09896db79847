// The data mover never reads a block a request can write: several threads drive random requests
// against one cache with an eviction sink, over a simulated data plane (each block slot holds the
// token whose "KV" was written there; a request writes its slots only after the call that gave
// it the block has returned, as a worker does). The sink runs without the engine's lock, while
// those threads keep writing; every block it is handed must still hold exactly the tokens of the
// view it is given (a block given to a writer before its copy ends would show the writer's
// tokens), and must be in no live request's table but that of the call still evicting it. The
// events those threads cause reach a listener in sequence order.
#include <atomic>
#include <random>
#include <thread>

#include <catch2/catch.hpp>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/core/demotion_mover.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using namespace kvd::testing;

constexpr int kBt = 4;
constexpr int kBlocks = 64;

// Simulated slab: one atomic token per slot, written by request threads, read by the sink.
struct Memory {
  std::atomic<Token> slots[kBlocks][kBt];
  Memory() {
    for (auto& b : slots) {
      for (auto& t : b) t.store(0);
    }
  }
};

// The request id whose call is running on this thread (the only table a held block may be in).
thread_local std::string t_current;

class CheckingSink final : public EvictionSink {
 public:
  CheckingSink(Memory* memory, KvCache** cache) : memory_(memory), cache_(cache) {}
  void OnEvict(const CachedBlockView& block, EvictReason) override {
    for (int s = 0; s < kBt; ++s) {
      const Token have = memory_->slots[block.index][s].load();
      if (have != block.tokens[s]) Fail(absl::StrCat("block ", block.index, " slot ", s, " holds ", have,
                                                     " while its copy runs, not ", block.tokens[s]));
    }
    // Test-only call back into the engine (no lock is held now): who holds this block?
    for (const HandleInfo& h : (*cache_)->ListHandles()) {
      if (h.id.value() == t_current) continue;
      for (BlockIndex b : h.blocks) {
        if (b == block.index) Fail(absl::StrCat("block ", block.index, " is in ", h.id.value(), "'s table while copied"));
      }
    }
    copies_.fetch_add(1);
  }
  void Fail(std::string what) {
    absl::MutexLock lock(&mu_);
    if (failures_.size() < 10) failures_.push_back(std::move(what));
  }
  std::vector<std::string> failures() const {
    absl::MutexLock lock(&mu_);
    return failures_;
  }
  int64_t copies() const { return copies_.load(); }

 private:
  Memory* memory_;
  KvCache** cache_;
  mutable absl::Mutex mu_;
  std::vector<std::string> failures_;
  std::atomic<int64_t> copies_{0};
};

// One worker thread: random prompts from a small vocabulary of prefixes, so blocks are shared,
// evicted, demoted and reused all along.
void Drive(KvCache& cache, Memory& memory, int worker, int steps, std::atomic<int>* errors) {
  std::mt19937 rng(1000 + worker);
  for (int i = 0; i < steps; ++i) {
    const std::string id = absl::StrCat("w", worker, "-", i);
    std::vector<Token> prompt;
    const int prefix = static_cast<int>(rng() % 6);
    const int len = 5 + static_cast<int>(rng() % 20);
    for (int p = 0; p < len; ++p) prompt.push_back(p < 12 ? 1000 * (prefix + 1) + p : 50000 + 100 * worker + i * 7 + p);
    RequestSpec spec = Spec(id, prompt, /*max_new=*/4);
    spec.owner = WorkerId(absl::StrCat("w", worker));
    t_current = id;
    absl::StatusOr<AdmitResult> admitted = cache.Admit(spec);
    if (!admitted.ok() || admitted->decision != AdmitDecision::kAdmitted) {
      if (admitted.ok()) (void)cache.Release(spec.id, false);
      continue;
    }
    absl::StatusOr<AcquireResult> got = cache.Acquire(spec.id);
    if (!got.ok()) {
      (void)cache.Release(spec.id, false);
      continue;
    }
    // The worker now writes the positions past the cached prefix into its own blocks.
    std::vector<BlockIndex> table = got->blocks;
    for (int64_t p = got->cached_tokens; p < static_cast<int64_t>(prompt.size()); ++p) {
      memory.slots[table[p / kBt]][p % kBt].store(prompt[p]);
    }
    if (rng() % 3 == 0) {  // decode a block's worth, then publish it too
      absl::StatusOr<std::vector<BlockIndex>> more = cache.Extend(spec.id, 4);
      if (more.ok()) {
        table.insert(table.end(), more->begin(), more->end());
        for (int g = 0; g < 4; ++g) {
          const int64_t p = static_cast<int64_t>(prompt.size());
          prompt.push_back(70000 + i * 11 + g);
          memory.slots[table[p / kBt]][p % kBt].store(prompt.back());
        }
      }
    }
    const size_t full = std::min(table.size(), prompt.size() / kBt);
    if (!cache.Publish(spec.id, prompt, absl::MakeConstSpan(table).subspan(0, full)).ok()) errors->fetch_add(1);
    if (!cache.Release(spec.id, true).ok()) errors->fetch_add(1);
    if (rng() % 16 == 0) cache.Gc();
    t_current.clear();
  }
}

TEST_CASE("The mover never reads a block a request can write (randomized, 4 threads)", "[core][demotion][mover]") {
  // Without the data mover every copy runs on the evicting request's thread; with it (a quarter
  // of the pool kept free) most run on the mover's, whose blocks must be in no live table at all.
  const bool with_mover = GENERATE(false, true);
  INFO("data mover: " << with_mover);
  FakeClock clock;
  auto options = SmallOptions(kBlocks);
  options.eviction_policy = EvictionPolicy::kSlru;
  options.max_requests_per_worker = 0;
  options.demote_reserve = with_mover ? 0.25 : 0.0;
  std::unique_ptr<KvCache> cache = MakeCache(options, &clock);
  KvCache* raw = cache.get();
  Memory memory;
  CheckingSink sink(&memory, &raw);
  cache->SetEvictionSink(&sink);
  // Effects run after the lock, from whichever thread caused them; listeners must still see them
  // in sequence order, each once, and a block's removal after its storing.
  absl::Mutex seen_mu;
  uint64_t last_sequence = 0;
  absl::flat_hash_map<BlockKey, bool> stored;  // key -> stored now, as the events tell it
  std::vector<std::string> order_failures;
  const int listener = cache->AddEventListener([&](const CacheEvent& e) {
    absl::MutexLock lock(&seen_mu);
    auto fail = [&](std::string what) {
      if (order_failures.size() < 10) order_failures.push_back(std::move(what));
    };
    if (e.sequence != last_sequence + 1) fail(absl::StrCat("event ", e.sequence, " after ", last_sequence));
    last_sequence = e.sequence;
    if (e.kind == CacheEventKind::kStored || e.kind == CacheEventKind::kRemoved) {
      const bool storing = e.kind == CacheEventKind::kStored;
      bool& now = stored[e.key];
      if (now == storing) fail(absl::StrCat("event ", e.sequence, ": ", CacheEventKindName(e.kind), " twice in a row"));
      now = storing;
    }
  });
  std::unique_ptr<DemotionMover> mover;
  if (with_mover) mover = std::make_unique<DemotionMover>(cache.get(), /*batch_blocks=*/4);

  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w) threads.emplace_back([&, w] { Drive(*cache, memory, w, 1500, &errors); });
  for (std::thread& t : threads) t.join();
  if (with_mover) {
    // How much the mover did depends on the scheduler (requests evict themselves when it lags);
    // its contract does not: once things settle, the reserve is free again (or nothing is left
    // that it may demote).
    const int64_t reserve = kBlocks / 4;
    bool settled = false;
    for (int i = 0; i < 10000 && !settled; ++i) {
      const PoolReport p = cache->Report().pools[0];
      settled = p.free_blocks >= reserve || p.evictable_blocks == p.protected_blocks;
      if (!settled) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    INFO("demoted ahead: " << mover->demoted());
    CHECK(settled);
    mover.reset();
  }

  cache->RemoveListenerAndWait(listener);  // before the state it writes goes
  {
    absl::MutexLock lock(&seen_mu);
    for (const std::string& f : order_failures) FAIL_CHECK(f);
    CHECK(last_sequence > 1000);
  }
  for (const std::string& f : sink.failures()) FAIL_CHECK(f);
  CHECK(sink.failures().empty());
  CHECK(errors.load() == 0);
  CHECK(sink.copies() > 1000);  // the sink did run, a lot, concurrently with the writers
  REQUIRE(cache->CheckInvariantsForTesting().ok());
  CHECK(cache->Report().live_requests == 0);
  cache->SetEvictionSink(nullptr);
}

}  // namespace
}  // namespace kvd
