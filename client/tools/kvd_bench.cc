// kvd-bench: replays a Mooncake-format trace against a running kvd with N worker processes,
// through the real client, and reports what the cache saved and what it cost.
//
//   kvd-bench --trace=PATH [--target=ADDR (default: $KVD_TARGET, else kvd's default socket)] [--workers=4]
//             [--speedup=F | (default) as fast as possible] [--decode-tps=0]
//             [--max-decode-tokens=32] [--checkpoint-every=16] [--limit=N] [--pool=NAME]
//             [--json=FILE] [--no-bounds] [--seed=N] [--as-fast-as-possible]
//
// Tokens come from the trace's hash ids (client/tools/trace.h), so shared hash-id prefixes are
// shared token prefixes. Each request: Admit (waits counted) -> Acquire -> Publish of the
// prompt's full blocks -> generation simulated by Extend in 16-token steps (paced at
// --decode-tps tokens/s when set) with a Checkpoint every --checkpoint-every tokens -> Publish
// -> Release. Worker k takes requests k, k+N, ...; with --speedup each request starts at its
// trace timestamp / speedup. The report: token-weighted hit rate and prefill tokens saved (as
// the workers saw them and as the daemon's Report counted them), admissions that waited,
// client-side latency p50/p99/p999 per RPC, requests per second, and the reference bounds of an
// unlimited cache and of offline farthest-next-use at the pool's capacity.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "client/tools/self_spawn.h"
#include "client/tools/prefill_cost.h"
#include "client/tools/trace.h"
#include "client/tools/trace_bounds.h"
#include "proto/vocab/default_paths.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  std::string trace, target, pool, json;
  int workers = 4;
  double speedup = 0;  // 0: as fast as possible
  double decode_tps = 0;
  int64_t max_decode_tokens = 32;
  int64_t checkpoint_every = 16;
  int64_t limit = 0;
  bool bounds = true;
  uint64_t seed = 0;
  int child = -1;
};

struct Totals {
  int64_t requests = 0, prompt_tokens = 0, hit_tokens = 0, waits = 0, failures = 0;
  double prompt_flops = 0, saved_flops = 0;  // prefill compute (prefill_cost.h, Llama-3-8B shape)
  std::map<std::string, std::vector<double>> latency_us;
};

template <typename Fn>
auto Timed(Totals& t, const char* method, Fn&& fn) {
  const auto start = Clock::now();
  auto result = fn();
  t.latency_us[method].push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
  return result;
}

int Child(const Flags& f, const std::vector<kvd::bench::TraceRequest>& trace) {
  auto client = kvd::client::Client::Connect(
      {.target = f.target, .worker_name = absl::StrCat("kvd-bench-", f.child), .map_slabs = false});
  if (!client.ok()) {
    std::cerr << "kvd-bench worker: " << client.status() << "\n";
    return 1;
  }
  kvd::client::Client& c = **client;
  Totals t;
  const auto start = Clock::now();
  for (size_t i = f.child; i < trace.size(); i += f.workers) {
    const kvd::bench::TraceRequest& r = trace[i];
    if (f.speedup > 0) {
      std::this_thread::sleep_until(start + std::chrono::duration<double, std::milli>(r.timestamp_ms / f.speedup));
    }
    kvd::RequestSpec spec;
    spec.id = kvd::RequestId(absl::StrCat("bench-", i));
    spec.ns.pool = f.pool;
    spec.prompt = kvd::bench::TraceTokens(r, f.seed);
    const int64_t decode = std::min(r.output_length, f.max_decode_tokens);
    spec.max_new_tokens = decode;
    if (spec.prompt.empty()) continue;
    absl::Status failed;
    for (absl::Duration backoff = absl::Milliseconds(1);;) {
      auto a = Timed(t, "Admit", [&] { return c.Admit(spec); });
      if (!a.ok()) {
        failed = a.status();
        break;
      }
      if (a->decision == kvd::AdmitDecision::kAdmitted) break;
      ++t.waits;
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, absl::Milliseconds(50));
    }
    if (!failed.ok()) {  // e.g. a request larger than the whole pool
      ++t.failures;
      continue;
    }
    auto acquired = Timed(t, "Acquire", [&] { return c.Acquire(spec.id); });
    if (!acquired.ok()) return 1;
    std::vector<kvd::BlockIndex> blocks = acquired->blocks;
    std::vector<kvd::Token> tokens = spec.prompt;
    const int32_t bt = c.pools()[acquired->pool].geometry.block_tokens;
    auto publish = [&] {
      const size_t full = std::min(tokens.size() / bt, blocks.size());
      std::vector<kvd::BlockIndex> prefix(blocks.begin(), blocks.begin() + full);
      return Timed(t, "Publish", [&] { return c.Publish(spec.id, tokens, prefix); }).ok();
    };
    if (!publish()) return 1;
    for (int64_t done = 0; done < decode;) {
      const int64_t step = std::min<int64_t>(16, decode - done);
      auto added = Timed(t, "Extend", [&] { return c.Extend(spec.id, step); });
      if (!added.ok()) return 1;
      blocks.insert(blocks.end(), added->begin(), added->end());
      for (int64_t k = 0; k < step; ++k) tokens.push_back(static_cast<kvd::Token>((tokens.back() * 31 + 7) % 100000));
      done += step;
      if (f.checkpoint_every > 0 && done % f.checkpoint_every == 0) {
        if (!Timed(t, "Checkpoint", [&] { return c.Checkpoint(spec.id, tokens, "bench"); }).ok()) return 1;
      }
      if (f.decode_tps > 0) std::this_thread::sleep_for(std::chrono::duration<double>(step / f.decode_tps));
    }
    if (decode > 0 && !publish()) return 1;
    if (!Timed(t, "Release", [&] { return c.Release(spec.id, true); }).ok()) return 1;
    ++t.requests;
    t.prompt_tokens += static_cast<int64_t>(spec.prompt.size());
    t.hit_tokens += acquired->cached_tokens;
    const kvd::bench::PrefillCost cost;
    t.prompt_flops += cost.Flops(0, static_cast<int64_t>(spec.prompt.size()));
    t.saved_flops += cost.Flops(0, acquired->cached_tokens);
  }
  std::cout << "STATS " << t.requests << " " << t.prompt_tokens << " " << t.hit_tokens << " " << t.waits
            << " " << t.failures << " " << absl::StrFormat("%.6e %.6e", t.prompt_flops, t.saved_flops) << "\n";
  for (const auto& [method, v] : t.latency_us) {
    std::cout << "LAT " << method;
    for (double x : v) std::cout << " " << absl::StrFormat("%.1f", x);
    std::cout << "\n";
  }
  return 0;
}

double Quantile(std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  f.target = kvd::DefaultTarget();
  CLI::App app{"kvd-bench: replay a Mooncake trace against a running kvd"};
  app.add_option("--trace", f.trace, "Mooncake JSONL trace")->required();
  app.add_option("--target", f.target, "kvd address (env KVD_TARGET)");
  app.add_option("--workers", f.workers, "worker processes")->check(CLI::Range(1, 256));
  app.add_option("--speedup", f.speedup, "replay arrival times sped up by this factor (0: as fast as possible)");
  bool asap = false;
  app.add_flag("--as-fast-as-possible", asap, "ignore arrival times (the default; same as --speedup=0)");
  app.add_option("--seed", f.seed, "token mapping seed (same sharing, different tokens)");
  app.add_option("--decode-tps", f.decode_tps, "simulated generation speed per request, tokens/s (0: no pacing)");
  app.add_option("--max-decode-tokens", f.max_decode_tokens, "generated tokens simulated per request at most");
  app.add_option("--checkpoint-every", f.checkpoint_every, "checkpoint every N generated tokens (0: never)");
  app.add_option("--limit", f.limit, "replay only the first N requests");
  app.add_option("--pool", f.pool, "pool to use (default: the first)");
  app.add_option("--json", f.json, "also write the report as JSON to this file");
  bool no_bounds = false;
  app.add_flag("--no-bounds", no_bounds, "skip the reference bounds (they take seconds on big traces)");
  app.add_option("--child", f.child)->group("");  // internal: run as worker k
  CLI11_PARSE(app, argc, argv);
  f.bounds = !no_bounds;
  if (asap) f.speedup = 0;

  auto trace = kvd::bench::LoadTrace(f.trace);
  if (!trace.ok()) {
    std::cerr << "kvd-bench: " << trace.status() << "\n";
    return 2;
  }
  if (f.limit > 0 && static_cast<size_t>(f.limit) < trace->size()) trace->resize(f.limit);
  auto control = kvd::client::Client::Connect({.target = f.target, .worker_name = "kvd-bench", .map_slabs = false});
  if (!control.ok()) {
    std::cerr << "kvd-bench: " << control.status() << "\n";
    return 1;
  }
  if (f.pool.empty()) f.pool = (*control)->pools()[0].geometry.name;
  auto pool = (*control)->FindPool(f.pool);
  if (!pool.ok()) {
    std::cerr << "kvd-bench: " << pool.status() << "\n";
    return 2;
  }
  if (f.child >= 0) return Child(f, *trace);

  const kvd::PoolGeometry& g = (*pool)->geometry;
  const auto before = (*control)->Report();
  if (!before.ok()) return 1;
  std::vector<kvd::tools::SpawnedChild> kids;
  const auto start = Clock::now();
  for (int k = 0; k < f.workers; ++k) {
    auto kid = kvd::tools::SpawnSelf(
        argv[0], {"--trace=" + f.trace, "--target=" + f.target, absl::StrCat("--workers=", f.workers),
                  absl::StrCat("--speedup=", f.speedup), absl::StrCat("--decode-tps=", f.decode_tps),
                  absl::StrCat("--max-decode-tokens=", f.max_decode_tokens),
                  absl::StrCat("--checkpoint-every=", f.checkpoint_every),
                  absl::StrCat("--limit=", trace->size()), "--pool=" + f.pool,
                  absl::StrCat("--seed=", f.seed), absl::StrCat("--child=", k)});
    if (!kid.ok()) return 1;
    kids.push_back(*kid);
  }
  // Progress from the daemon's own counter while the workers run.
  std::thread progress([&] {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::seconds(1));
      auto r = (*control)->Report();
      if (!r.ok()) return;
      const int64_t done = static_cast<int64_t>(r->lookups - before->lookups);
      std::cerr << "\rkvd-bench: " << done << "/" << trace->size() << " requests" << std::flush;
      if (done >= static_cast<int64_t>(trace->size())) return;
      bool any_alive = false;
      for (const auto& kid : kids) any_alive |= kill(kid.pid, 0) == 0;
      if (!any_alive) return;
    }
  });
  Totals all;
  bool ok = true;
  for (auto& kid : kids) {
    kvd::tools::ChildResult child = kvd::tools::Collect(kid);
    ok &= child.ok;
    const std::string& out = child.out;
    for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
      std::vector<std::string> w = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (w[0] == "STATS" && w.size() == 8) {
        int64_t v[5];
        for (int i = 0; i < 5; ++i) (void)absl::SimpleAtoi(w[i + 1], &v[i]);
        all.requests += v[0], all.prompt_tokens += v[1], all.hit_tokens += v[2], all.waits += v[3], all.failures += v[4];
        double flops[2] = {0, 0};
        for (int i = 0; i < 2; ++i) (void)absl::SimpleAtod(w[i + 6], &flops[i]);
        all.prompt_flops += flops[0], all.saved_flops += flops[1];
      } else if (w[0] == "LAT" && w.size() >= 2) {
        auto& dst = all.latency_us[w[1]];
        for (size_t i = 2; i < w.size(); ++i) {
          double x;
          if (absl::SimpleAtod(w[i], &x)) dst.push_back(x);
        }
      }
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  progress.join();
  std::cerr << "\n";
  const auto after = (*control)->Report();
  if (!after.ok() || !ok) {
    std::cerr << "kvd-bench: a worker failed\n";
    return 1;
  }
  const int64_t daemon_hits = static_cast<int64_t>(after->hit_tokens - before->hit_tokens);
  const double hit_rate = all.prompt_tokens ? double(all.hit_tokens) / all.prompt_tokens : 0;
  const double saved = all.prompt_flops > 0 ? all.saved_flops / all.prompt_flops : 0;
  const kvd::bench::PrefillCost cost;
  kvd::bench::TraceTally unlimited, belady;
  if (f.bounds) {
    unlimited = kvd::bench::UnlimitedBound(*trace, g.block_tokens, cost, trace->size());
    belady = kvd::bench::FarthestNextUseBound(*trace, g.block_tokens, g.capacity_blocks, cost, trace->size());
  }

  std::printf("trace %s: %lld requests by %d workers in %.1f s (%.1f requests/s)\n", f.trace.c_str(),
              static_cast<long long>(all.requests), f.workers, seconds, all.requests / seconds);
  std::printf("pool %s: %lld blocks of %d tokens\n", f.pool.c_str(), static_cast<long long>(g.capacity_blocks), g.block_tokens);
  std::printf("hit rate (tokens): %.2f%%   prefill tokens saved: %lld   daemon-counted hit tokens: %lld\n",
              100 * hit_rate, static_cast<long long>(all.hit_tokens), static_cast<long long>(daemon_hits));
  std::printf("prefill compute saved (Llama-3-8B shape, docs/performance.md): %.2f%% (%.3g of %.3g FLOPs)\n",
              100 * saved, all.saved_flops, all.prompt_flops);
  if (f.bounds) {
    std::printf("bounds: unlimited cache %.2f%% hit, %.2f%% saved; farthest-next-use at this capacity %.2f%% hit, "
                "%.2f%% saved\n", 100 * unlimited.all.hit_rate(), 100 * unlimited.all.saved_fraction(),
                100 * belady.all.hit_rate(), 100 * belady.all.saved_fraction());
  }
  std::printf("admissions that waited: %lld   requests refused: %lld\n", static_cast<long long>(all.waits),
              static_cast<long long>(all.failures));
  std::printf("| RPC | calls | p50 (us) | p99 (us) | p999 (us) |\n|---|---|---|---|---|\n");
  std::ostringstream json_lat;
  for (auto& [method, v] : all.latency_us) {
    const double p50 = Quantile(v, 0.5), p99 = Quantile(v, 0.99), p999 = Quantile(v, 0.999);
    std::printf("| %s | %zu | %.1f | %.1f | %.1f |\n", method.c_str(), v.size(), p50, p99, p999);
    json_lat << (json_lat.tellp() > 0 ? ", " : "")
             << absl::StrFormat("\"%s\": {\"calls\": %d, \"p50_us\": %.1f, \"p99_us\": %.1f, \"p999_us\": %.1f}",
                                method, v.size(), p50, p99, p999);
  }
  if (!f.json.empty()) {
    std::ofstream(f.json) << absl::StrFormat(
        "{\"requests\": %d, \"workers\": %d, \"seconds\": %.3f, \"requests_per_second\": %.2f, "
        "\"prompt_tokens\": %d, \"hit_tokens\": %d, \"daemon_hit_tokens\": %d, \"hit_rate\": %.6f, "
        "\"compute_saved\": %.6f, \"unlimited_bound\": %.6f, \"unlimited_compute_saved\": %.6f, "
        "\"farthest_next_use_bound\": %.6f, \"farthest_next_use_compute_saved\": %.6f, \"waits\": %d, "
        "\"refused\": %d, \"latency\": {%s}}\n",
        all.requests, f.workers, seconds, all.requests / seconds, all.prompt_tokens, all.hit_tokens, daemon_hits,
        hit_rate, saved, f.bounds ? unlimited.all.hit_rate() : -1, f.bounds ? unlimited.all.saved_fraction() : -1,
        f.bounds ? belady.all.hit_rate() : -1, f.bounds ? belady.all.saved_fraction() : -1, all.waits, all.failures,
        json_lat.str());
  }
  return 0;
}
