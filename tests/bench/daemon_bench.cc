// kvd_daemon_bench: control-plane latency and throughput of a live daemon over its Unix socket.
//
// Starts kvd in-process (host backend) on a temporary socket, then measures, in the same run:
//   - Ping (an empty RPC: the transport floor),
//   - Acquire of a 4,096-token prompt whose prefix is cached (255 of 256 blocks hit),
//   - a full request cycle step by step: Admit, Acquire, Publish, Release (4 round trips),
//   - the same cycle on the fast path: Start, End publishing the prompt's blocks (2 round trips),
//     on a hit (all but the last block cached) and cold (nothing cached),
// as p50/p99 over --iterations calls from one client; then fast-path cycles per second with 1, 4
// and 16 concurrent worker processes (this binary re-executed with --child), each its own
// attachment.
//
// With --demote, then: Ping and the hit cycle, p50/p99, without and with a second client that
// keeps a pool of 2 MiB blocks full, so that each of its Starts evicts 8 blocks that the host
// tier copies down (16 MiB per call) — the copies run outside the engine's lock; with
// --demote-reserve=F the data mover keeps that share of each pool free and does the copies on its
// own thread instead of that client's.
//
//   kvd_daemon_bench [--iterations=2000] [--workers=1,4,16] [--seconds=3] [--prompt-tokens=4096]
//                    [--demote [--demote-reserve=0.25]]
//   kvd_daemon_bench --decode [--batches=1,64,256] [--decode-steps=256] [--step-compute-us=0]  (decode_bench.h)
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "client/tools/self_spawn.h"
#include "tests/bench/decode_bench.h"
#include "server/daemon.h"
#include "spdlog/spdlog.h"

namespace {

using Clock = std::chrono::steady_clock;
int kPromptTokens = 4096;  // --prompt-tokens, a multiple of 16

// The shared prompt with a last token of its own; `cold` changes the first token too, so that
// nothing of it is cached.
std::vector<kvd::Token> Prompt(uint32_t tail, bool cold = false) {
  std::vector<kvd::Token> p(kPromptTokens);
  for (int i = 0; i < kPromptTokens; ++i) p[i] = static_cast<kvd::Token>(i * 7 + 3);
  p.back() = 1'000'000 + tail;  // the last block differs, so every cycle publishes one new block
  if (cold) p.front() = 2'000'000'000u + tail;
  return p;
}

kvd::RequestSpec Spec(const std::string& id, uint32_t tail, bool cold = false) {
  kvd::RequestSpec s;
  s.id = kvd::RequestId(id);
  s.ns.pool = "bench";
  s.prompt = Prompt(tail, cold);
  s.max_new_tokens = 16;
  return s;
}

struct Percentiles {
  double p50_us, p99_us;
};

Percentiles Summarize(std::vector<double>& us) {
  std::sort(us.begin(), us.end());
  return {us[us.size() / 2], us[std::min(us.size() - 1, us.size() * 99 / 100)]};
}

double Micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

// One full cycle on the fast path (Start, End publishing every full block); false on error.
bool Cycle(kvd::client::Client& c, const std::string& id, uint32_t tail, bool cold = false) {
  kvd::RequestSpec s = Spec(id, tail, cold);
  auto req = c.Start(s);
  if (!req.ok()) {
    std::fprintf(stderr, "cycle: %s\n", req.status().ToString().c_str());
    return false;
  }
  return (*req)->End(kPromptTokens / 16, {}, /*completed=*/true).ok();
}

// The same cycle step by step: Admit, Acquire, Publish, Release.
bool StepCycle(kvd::client::Client& c, const std::string& id, uint32_t tail) {
  kvd::RequestSpec s = Spec(id, tail);
  auto admitted = c.Admit(s);
  if (!admitted.ok() || admitted->decision != kvd::AdmitDecision::kAdmitted) return false;
  auto got = c.Acquire(s.id);
  if (!got.ok()) return false;
  return c.Publish(s.id, s.prompt, absl::MakeConstSpan(got->blocks).subspan(0, kPromptTokens / 16)).ok() &&
         c.Release(s.id, true).ok();
}

int Child(const std::string& target, int index, double seconds) {
  auto c = kvd::client::Client::Connect({.target = target, .worker_name = "bench", .map_slabs = false});
  if (!c.ok()) return 1;
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  int64_t n = 0;
  while (Clock::now() < end) {
    if (!Cycle(**c, absl::StrCat("c", index, "-", n), static_cast<uint32_t>(index * 1'000'000 + n))) return 1;
    ++n;
  }
  std::printf("%lld\n", static_cast<long long>(n));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  int iterations = 2000;
  double seconds = 3;
  std::vector<int> workers = {1, 4, 16};
  std::string child_target;
  int child_index = -1;
  bool demote = false;
  bool decode = false;  // --decode: only the decode-step comparison (decode_bench.h)
  int decode_steps = 256;
  int compute_us = 0;
  std::vector<int> batches = {1, 64, 256};
  double demote_reserve = 0;  // the data mover's share of each pool kept free (0: off)
  for (int i = 1; i < argc; ++i) {
    std::vector<std::string> kv = absl::StrSplit(argv[i], absl::MaxSplits('=', 1));
    const std::string v = kv.size() > 1 ? kv[1] : "";
    if (kv[0] == "--iterations") (void)absl::SimpleAtoi(v, &iterations);
    else if (kv[0] == "--seconds") (void)absl::SimpleAtod(v, &seconds);
    else if (kv[0] == "--prompt-tokens") (void)absl::SimpleAtoi(v, &kPromptTokens);
    else if (kv[0] == "--demote") demote = true;
    else if (kv[0] == "--decode") decode = true;
    else if (kv[0] == "--decode-steps") (void)absl::SimpleAtoi(v, &decode_steps);
    else if (kv[0] == "--step-compute-us") (void)absl::SimpleAtoi(v, &compute_us);
    else if (kv[0] == "--batches") {
      batches.clear();
      for (absl::string_view b : absl::StrSplit(v, ',')) {
        int n = 0;
        if (absl::SimpleAtoi(b, &n) && n > 0) batches.push_back(n);
      }
    }
    else if (kv[0] == "--demote-reserve" && kv.size() == 2) demote_reserve = std::stod(std::string(kv[1]));
    else if (kv[0] == "--child-target") child_target = v;
    else if (kv[0] == "--child-index") (void)absl::SimpleAtoi(v, &child_index);
    else if (kv[0] == "--workers") {
      workers.clear();
      for (absl::string_view w : absl::StrSplit(v, ',')) {
        int n = 0;
        if (absl::SimpleAtoi(w, &n)) workers.push_back(n);
      }
    }
  }
  if (kPromptTokens < 32 || kPromptTokens % 16 != 0 || kPromptTokens > 65536) {
    std::fprintf(stderr, "--prompt-tokens must be a multiple of 16 in [32, 65536]\n");
    return 2;
  }
  if (!child_target.empty()) return Child(child_target, child_index, seconds);

  spdlog::set_level(spdlog::level::warn);
  char dir_template[] = "/tmp/kvd-bench-XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  kvd::Options options;
  options.server.listen = "unix://" + dir + "/kvd.sock";
  options.server.metrics_listen = "";
  kvd::PoolGeometry g;
  g.name = "bench";
  g.block_tokens = 16;
  g.num_layers = 32;
  g.bytes_per_token_per_layer = 64;  // 32 KiB blocks: the control plane does not touch bytes
  g.capacity_blocks = 16384;
  g.max_model_len = 65536 + 16;
  options.cache.pools.push_back(g);
  if (demote) {
    kvd::PoolGeometry big;
    big.name = "big";
    big.block_tokens = 16;
    big.num_layers = 32;
    big.bytes_per_token_per_layer = 4096;  // 2 MiB blocks
    big.capacity_blocks = 64;
    big.max_model_len = 4096;
    options.cache.pools.push_back(big);
    options.tiers.host_bytes = int64_t{512} << 20;
    options.cache.demote_reserve = demote_reserve;
  }
  auto daemon = kvd::Daemon::Start(options);
  if (!daemon.ok()) {
    std::fprintf(stderr, "%s\n", daemon.status().ToString().c_str());
    return 1;
  }
  const std::string target = (*daemon)->grpc_address();
  auto client = kvd::client::Client::Connect({.target = target, .worker_name = "bench"});
  if (!client.ok()) return 1;
  kvd::client::Client& c = **client;

  if (decode) {
    const bool ok = kvd::bench::RunDecodeBench(c, batches, decode_steps, compute_us, target);
    client->reset();
    daemon->reset();
    return ok ? 0 : 1;
  }

  // Prime: the shared 4,095-token prefix is cached.
  if (!Cycle(c, "prime", 0)) return 1;

  std::vector<double> ping, acquire, step, cycle, cold;
  for (int i = 0; i < iterations; ++i) {
    auto t0 = Clock::now();
    if (!c.Ping().ok()) return 1;
    ping.push_back(Micros(Clock::now() - t0));

    kvd::RequestSpec s = Spec(absl::StrCat("a", i), 1 + i);
    if (!c.Admit(s).ok()) return 1;
    t0 = Clock::now();
    auto got = c.Acquire(s.id);
    acquire.push_back(Micros(Clock::now() - t0));
    if (!got.ok() || got->cached_tokens != kPromptTokens - 16) return 1;
    if (!c.Release(s.id, true).ok()) return 1;

    t0 = Clock::now();
    if (!StepCycle(c, absl::StrCat("s", i), 2'000'000 + i)) return 1;
    step.push_back(Micros(Clock::now() - t0));

    t0 = Clock::now();
    if (!Cycle(c, absl::StrCat("f", i), 1'000'000 + i)) return 1;
    cycle.push_back(Micros(Clock::now() - t0));

    t0 = Clock::now();
    if (!Cycle(c, absl::StrCat("k", i), 3'000'000 + i, /*cold=*/true)) return 1;
    cold.push_back(Micros(Clock::now() - t0));
  }
  Percentiles pp = Summarize(ping), pa = Summarize(acquire), ps = Summarize(step), pc = Summarize(cycle),
              pk = Summarize(cold);
  std::printf("| call | p50 (us) | p99 (us) | p50 / Ping p50 |\n|---|---|---|---|\n");
  std::printf("| Ping (empty RPC) | %.1f | %.1f | 1.0 |\n", pp.p50_us, pp.p99_us);
  std::printf("| Acquire, %d-token prompt, %d tokens hit | %.1f | %.1f | %.1f |\n", kPromptTokens,
              kPromptTokens - 16, pa.p50_us, pa.p99_us, pa.p50_us / pp.p50_us);
  std::printf("| hit cycle step by step: Admit+Acquire+Publish+Release | %.1f | %.1f | %.1f |\n", ps.p50_us,
              ps.p99_us, ps.p50_us / pp.p50_us);
  std::printf("| hit cycle, fast path: Start+End | %.1f | %.1f | %.1f |\n", pc.p50_us, pc.p99_us,
              pc.p50_us / pp.p50_us);
  std::printf("| cold cycle, fast path: Start+End | %.1f | %.1f | %.1f |\n", pk.p50_us, pk.p99_us,
              pk.p50_us / pp.p50_us);

  if (demote) {
    // Ping and the hit cycle, without and then with a client that demotes 2 MiB blocks nonstop.
    auto measure = [&](const char* label) -> bool {
      std::vector<double> p, cy;
      for (int i = 0; i < iterations; ++i) {
        auto t0 = Clock::now();
        if (!c.Ping().ok()) return false;
        p.push_back(Micros(Clock::now() - t0));
        t0 = Clock::now();
        if (!Cycle(c, absl::StrCat(label, i), 5'000'000 + i + (label[0] == 'w' ? 500'000 : 0))) return false;
        cy.push_back(Micros(Clock::now() - t0));
      }
      Percentiles pp2 = Summarize(p), pc2 = Summarize(cy);
      std::printf("| %s | %.1f | %.1f | %.1f | %.1f |\n", label, pp2.p50_us, pp2.p99_us, pc2.p50_us, pc2.p99_us);
      return true;
    };
    std::printf("\n| 2 MiB demotions | Ping p50 | Ping p99 | hit cycle p50 | hit cycle p99 |\n|---|---|---|---|---|\n");
    if (!measure("none")) return 1;
    std::atomic<bool> stop{false};
    std::atomic<int64_t> demoting_calls{0};
    std::vector<double> demoting_starts;  // that client's Start latencies (its thread only until joined)
    std::thread mover([&] {
      auto m = kvd::client::Client::Connect({.target = target, .worker_name = "mover", .map_slabs = false});
      if (!m.ok()) return;
      for (int64_t n = 0; !stop.load(); ++n) {
        kvd::RequestSpec s;
        s.id = kvd::RequestId(absl::StrCat("m", n));
        s.ns.pool = "big";
        for (int t = 0; t < 128; ++t) s.prompt.push_back(static_cast<kvd::Token>(n * 1000 + t));
        const auto t0 = Clock::now();
        auto r = (*m)->Start(s);
        demoting_starts.push_back(Micros(Clock::now() - t0));
        if (!r.ok() || !(*r)->End(8, {}, true).ok()) return;
        demoting_calls.fetch_add(1);
      }
    });
    while (demoting_calls.load() < 16) absl::SleepFor(absl::Milliseconds(10));  // the pool is full
    const int64_t before = demoting_calls.load();
    const bool ok = measure("while demoting");
    const int64_t during = demoting_calls.load() - before;
    stop = true;
    mover.join();
    if (!ok) return 1;
    std::printf("(%lld mover calls during the second run, each evicting and demoting 8 x 2 MiB)\n",
                static_cast<long long>(during));
    const Percentiles ds = Summarize(demoting_starts);
    std::printf("(the demoting client's Start, 8 x 2 MiB blocks: p50 %.1f us, p99 %.1f us; demote_reserve %.2f)\n",
                ds.p50_us, ds.p99_us, demote_reserve);
  }

  std::printf("\n| worker processes | cycles/s | per worker |\n|---|---|---|\n");
  for (int n : workers) {
    std::vector<kvd::tools::SpawnedChild> kids;
    for (int k = 0; k < n; ++k) {
      auto kid = kvd::tools::SpawnSelf(argv[0], {"--child-target=" + target, absl::StrCat("--child-index=", k),
                                                 absl::StrCat("--seconds=", seconds)});
      if (!kid.ok()) return 1;
      kids.push_back(*kid);
    }
    int64_t total = 0;
    for (auto& kid : kids) {
      kvd::tools::ChildResult r = kvd::tools::Collect(kid);
      int64_t count = 0;
      if (r.ok && absl::SimpleAtoi(absl::StripAsciiWhitespace(r.out), &count)) total += count;
    }
    std::printf("| %d | %.0f | %.0f |\n", n, total / seconds, total / seconds / n);
  }
  client->reset();
  daemon->reset();
  rmdir(dir.c_str());
  return 0;
}
