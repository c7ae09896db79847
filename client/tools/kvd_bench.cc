// kvd-bench: replays a Mooncake-format trace against a running kvd with N worker processes,
// through the real client, and reports what the cache saved and what it cost.
//
//   kvd-bench --trace=PATH [--target=ADDR (default: $KVD_TARGET, else kvd's default socket)] [--workers=4]
//             [--speedup=F | (default) as fast as possible] [--decode-tps=0]
//             [--max-decode-tokens=32] [--checkpoint-every=16] [--limit=N] [--pool=NAME]
//             [--json=FILE] [--no-bounds] [--seed=N] [--as-fast-as-possible]
//             [--prefill-tps=F [--prefill-shared]] [--wait-in-flight-ms=MS]
//             [--fanout=N --fanout-context=S --fanout-own=T]
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
//
// Overlap (kvd-reuse-2): --prefill-tps puts a prefill delay of (prompt - hit) / F seconds between
// a request's start and its publish (client/tools/bench_overlap.h; --prefill-shared makes F the
// node's rate, every worker's prefill queued on one engine), so that requests overlap as in
// serving. Requests then start with the Start RPC; --wait-in-flight-ms asks kvd to wait that long
// for prompt blocks another request is computing (docs/api.md, "Prefixes in flight"). --fanout=N
// replaces the trace with an agent fan-out: N workers start together, each one request of a new
// shared context of S tokens plus T tokens of its own. The report adds prompt tokens computed,
// publish outcomes (duplicates, no_parent), what starts saw in flight and how their waits ended,
// time to first token and, for the fan-out, the time to the last first token.
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
#include "client/tools/bench_overlap.h"
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
  double prefill_tps = 0;       // 0: publish right after the start
  bool prefill_shared = false;  // the rate is the node's (workers queue on one lock file)
  std::string prefill_lock;     // internal: the lock file the parent made
  int64_t wait_in_flight_ms = 0;
  int fanout = 0;               // N > 0: the fan-out workload instead of the trace
  int64_t fanout_context = 4096, fanout_own = 64;
  int64_t start_at_us = 0;      // internal: the common start, system clock (microseconds since epoch)
  // Overlap mode: Start instead of Admit + Acquire, a prefill delay, the fan-out.
  bool overlap() const { return prefill_tps > 0 || wait_in_flight_ms > 0 || fanout > 0; }
};

// What overlapping requests did, per worker and summed (the OVERLAP line).
struct Overlap {
  int64_t duplicates = 0, no_parent = 0;   // publish outcomes, once per position
  int64_t in_flight_seen = 0;              // starts that found their next blocks in flight
  int64_t waits[4] = {0, 0, 0, 0};         // v1::InFlightWait: none, published, released, timed out
  int64_t last_first_token_us = 0;         // the latest first token, from the common start

  void Add(const Overlap& o) {
    duplicates += o.duplicates, no_parent += o.no_parent, in_flight_seen += o.in_flight_seen;
    for (int i = 0; i < 4; ++i) waits[i] += o.waits[i];
    last_first_token_us = std::max(last_first_token_us, o.last_first_token_us);
  }
};

struct Totals {
  int64_t requests = 0, prompt_tokens = 0, hit_tokens = 0, waits = 0, failures = 0;
  double prompt_flops = 0, saved_flops = 0;  // prefill compute (prefill_cost.h, Llama-3-8B shape)
  Overlap overlap;
  std::map<std::string, std::vector<double>> latency_us;
};

template <typename Fn>
auto Timed(Totals& t, const char* method, Fn&& fn) {
  const auto start = Clock::now();
  auto result = fn();
  t.latency_us[method].push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
  return result;
}

// One request a worker runs: its prompt, tokens to generate, when it arrives (ms after the start).
struct Work {
  std::string id;
  std::vector<kvd::Token> prompt;
  int64_t decode = 0;
  double arrival_ms = -1;  // < 0: as soon as the worker is free
};

std::vector<Work> WorkOf(const Flags& f, const std::vector<kvd::bench::TraceRequest>& trace) {
  std::vector<Work> out;
  if (f.fanout > 0) {
    out.push_back({absl::StrCat("fanout-", f.seed, "-", f.child),
                   kvd::bench::FanoutPrompt(f.seed, f.child, f.fanout_context, f.fanout_own),
                   f.max_decode_tokens, 0});
    return out;
  }
  for (size_t i = f.child; i < trace.size(); i += f.workers) {
    const kvd::bench::TraceRequest& r = trace[i];
    out.push_back({absl::StrCat("bench-", i), kvd::bench::TraceTokens(r, f.seed),
                   std::min(r.output_length, f.max_decode_tokens),
                   f.speedup > 0 ? r.timestamp_ms / f.speedup : -1});
  }
  return out;
}

void CountOutcomes(const kvd::PublishResult& r, Overlap& o) {
  for (kvd::PublishOutcome x : r.outcomes) {
    o.duplicates += x == kvd::PublishOutcome::kDuplicate;
    o.no_parent += x == kvd::PublishOutcome::kNoParent;
  }
}

int Child(const Flags& f, const std::vector<kvd::bench::TraceRequest>& trace) {
  auto client = kvd::client::Client::Connect(
      {.target = f.target, .worker_name = absl::StrCat("kvd-bench-", f.child), .map_slabs = false});
  if (!client.ok()) {
    std::cerr << "kvd-bench worker: " << client.status() << "\n";
    return 1;
  }
  kvd::client::Client& c = **client;
  kvd::bench::PrefillClock prefill(f.prefill_tps, f.prefill_lock);
  if (absl::Status s = prefill.Open(); !s.ok()) {
    std::cerr << "kvd-bench worker: " << s << "\n";
    return 1;
  }
  Totals t;
  auto start = Clock::now();
  if (f.start_at_us > 0) {  // the parent's common start, so that a fan-out starts together
    const int64_t now_us = std::chrono::duration_cast<std::chrono::microseconds>(
                               std::chrono::system_clock::now().time_since_epoch()).count();
    start += std::chrono::microseconds(f.start_at_us - now_us);
    std::this_thread::sleep_until(start);
  }
  for (Work& w : WorkOf(f, trace)) {
    if (w.prompt.empty()) continue;
    const auto arrival = w.arrival_ms >= 0 ? start + std::chrono::duration_cast<Clock::duration>(
                                                         std::chrono::duration<double, std::milli>(w.arrival_ms))
                                           : Clock::now();
    std::this_thread::sleep_until(arrival);
    kvd::RequestSpec spec;
    spec.id = kvd::RequestId(w.id);
    spec.ns.pool = f.pool;
    spec.prompt = w.prompt;
    spec.max_new_tokens = w.decode;
    std::vector<kvd::Token> tokens = spec.prompt;
    int32_t bt = 0;
    int64_t cached = 0;
    // The calls after the start, through the request handle (overlap mode) or by id.
    std::unique_ptr<kvd::client::KvRequest> req;
    std::vector<kvd::BlockIndex> blocks;
    if (f.overlap()) {
      auto started = Timed(t, "Start", [&] {
        return c.Start(spec, absl::Seconds(60), "", absl::Milliseconds(f.wait_in_flight_ms));
      });
      if (!started.ok()) {  // e.g. a request larger than the whole pool
        ++t.failures;
        continue;
      }
      req = std::move(*started);
      bt = c.pools()[req->pool()].geometry.block_tokens;
      cached = req->cached_tokens();
      t.overlap.in_flight_seen += req->in_flight_seen().has_value() || req->in_flight().has_value();
      t.overlap.waits[std::clamp(req->in_flight_wait(), 0, 3)]++;
    } else {
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
      blocks = acquired->blocks;
      bt = c.pools()[acquired->pool].geometry.block_tokens;
      cached = acquired->cached_tokens;
    }
    auto publish = [&] {
      absl::StatusOr<kvd::PublishResult> r;
      if (req) {
        r = Timed(t, "Publish", [&] { return req->Publish(tokens); });
      } else {
        const size_t full = std::min(tokens.size() / bt, blocks.size());
        std::vector<kvd::BlockIndex> prefix(blocks.begin(), blocks.begin() + full);
        r = Timed(t, "Publish", [&] { return c.Publish(spec.id, tokens, prefix); });
      }
      if (r.ok()) CountOutcomes(*r, t.overlap);
      return r.ok();
    };
    prefill.Compute(static_cast<int64_t>(spec.prompt.size()) - cached);
    if (!publish()) return 1;
    const auto first_token = Clock::now();  // the prompt's KV is computed and published
    t.latency_us["TTFT"].push_back(std::chrono::duration<double, std::micro>(first_token - arrival).count());
    t.overlap.last_first_token_us = std::max<int64_t>(
        t.overlap.last_first_token_us,
        std::chrono::duration_cast<std::chrono::microseconds>(first_token - start).count());
    for (int64_t done = 0; done < w.decode;) {
      const int64_t step = std::min<int64_t>(16, w.decode - done);
      if (req) {
        if (!Timed(t, "Extend", [&] { return req->Extend(step); }).ok()) return 1;
      } else {
        auto added = Timed(t, "Extend", [&] { return c.Extend(spec.id, step); });
        if (!added.ok()) return 1;
        blocks.insert(blocks.end(), added->begin(), added->end());
      }
      for (int64_t k = 0; k < step; ++k) tokens.push_back(static_cast<kvd::Token>((tokens.back() * 31 + 7) % 100000));
      done += step;
      if (f.checkpoint_every > 0 && done % f.checkpoint_every == 0) {
        auto ok = Timed(t, "Checkpoint", [&] {
          return req ? req->Checkpoint(tokens, "bench") : c.Checkpoint(spec.id, tokens, "bench");
        });
        if (!ok.ok()) return 1;
      }
      if (f.decode_tps > 0) std::this_thread::sleep_for(std::chrono::duration<double>(step / f.decode_tps));
    }
    if (w.decode > 0 && !publish()) return 1;
    if (!Timed(t, "Release", [&] { return req ? req->Release(true) : c.Release(spec.id, true); }).ok()) return 1;
    ++t.requests;
    t.prompt_tokens += static_cast<int64_t>(spec.prompt.size());
    t.hit_tokens += cached;
    const kvd::bench::PrefillCost cost;
    t.prompt_flops += cost.Flops(0, static_cast<int64_t>(spec.prompt.size()));
    t.saved_flops += cost.Flops(0, cached);
  }
  std::cout << "STATS " << t.requests << " " << t.prompt_tokens << " " << t.hit_tokens << " " << t.waits
            << " " << t.failures << " " << absl::StrFormat("%.6e %.6e", t.prompt_flops, t.saved_flops) << "\n";
  const Overlap& o = t.overlap;
  std::cout << "OVERLAP " << o.duplicates << " " << o.no_parent << " " << o.in_flight_seen << " " << o.waits[0]
            << " " << o.waits[1] << " " << o.waits[2] << " " << o.waits[3] << " "
            << o.last_first_token_us << "\n";
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
  app.add_option("--trace", f.trace, "Mooncake JSONL trace (not with --fanout)");
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
  app.add_option("--prefill-tps", f.prefill_tps,
                 "prefill delay between start and publish: (prompt - hit) tokens at this rate (0: none)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--prefill-shared", f.prefill_shared, "--prefill-tps is the node's rate: prefills queue on one engine");
  app.add_option("--wait-in-flight-ms", f.wait_in_flight_ms,
                 "Start waits up to this long for prompt blocks another request computes (0: never)")
      ->check(CLI::Range(0, 30000));
  app.add_option("--fanout", f.fanout, "agent fan-out: N workers start together on a new shared context")
      ->check(CLI::Range(0, 256));
  app.add_option("--fanout-context", f.fanout_context, "the fan-out's shared context, tokens")->check(CLI::Range(1, 1 << 20));
  app.add_option("--fanout-own", f.fanout_own, "each fan-out request's own tokens after the context")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--child", f.child)->group("");  // internal: run as worker k
  app.add_option("--prefill-lock", f.prefill_lock)->group("");
  app.add_option("--start-at-us", f.start_at_us)->group("");
  CLI11_PARSE(app, argc, argv);
  f.bounds = !no_bounds;
  if (asap) f.speedup = 0;
  if (f.fanout > 0) {
    f.workers = f.fanout;  // one request per worker, all started together
    f.bounds = false;
  } else if (f.trace.empty()) {
    std::cerr << "kvd-bench: --trace is required (or --fanout)\n";
    return 2;
  }

  absl::StatusOr<std::vector<kvd::bench::TraceRequest>> trace = std::vector<kvd::bench::TraceRequest>();
  if (f.fanout == 0) trace = kvd::bench::LoadTrace(f.trace);
  if (!trace.ok()) {
    std::cerr << "kvd-bench: " << trace.status() << "\n";
    return 2;
  }
  if (f.fanout > 0) trace->resize(f.fanout);  // one (unused) entry per request, for the progress count
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
  if (f.prefill_shared && f.prefill_tps > 0) {
    f.prefill_lock = absl::StrCat("/tmp/kvd-bench-prefill-", getpid(), ".lock");
  }
  // With arrivals or overlap, every worker starts its clock at the same instant: after they all
  // had time to connect (as fast as possible without overlap, each starts when it is ready).
  if (f.overlap() || f.speedup > 0) {
    f.start_at_us = std::chrono::duration_cast<std::chrono::microseconds>(
                        std::chrono::system_clock::now().time_since_epoch()).count() +
                    300'000 + 20'000 * f.workers;
  }
  const auto start = Clock::now();
  for (int k = 0; k < f.workers; ++k) {
    std::vector<std::string> args = {
        "--target=" + f.target, absl::StrCat("--workers=", f.workers), absl::StrCat("--speedup=", f.speedup),
        absl::StrCat("--decode-tps=", f.decode_tps), absl::StrCat("--max-decode-tokens=", f.max_decode_tokens),
        absl::StrCat("--checkpoint-every=", f.checkpoint_every), absl::StrCat("--limit=", trace->size()),
        "--pool=" + f.pool, absl::StrCat("--seed=", f.seed), absl::StrCat("--child=", k),
        absl::StrCat("--prefill-tps=", f.prefill_tps), absl::StrCat("--wait-in-flight-ms=", f.wait_in_flight_ms),
        absl::StrCat("--fanout=", f.fanout), absl::StrCat("--fanout-context=", f.fanout_context),
        absl::StrCat("--fanout-own=", f.fanout_own), absl::StrCat("--start-at-us=", f.start_at_us)};
    if (!f.trace.empty()) args.push_back("--trace=" + f.trace);
    if (!f.prefill_lock.empty()) args.push_back("--prefill-lock=" + f.prefill_lock);
    auto kid = kvd::tools::SpawnSelf(argv[0], args);
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
      } else if (w[0] == "OVERLAP" && w.size() == 9) {
        int64_t v[8];
        for (int i = 0; i < 8; ++i) (void)absl::SimpleAtoi(w[i + 1], &v[i]);
        Overlap o;
        o.duplicates = v[0], o.no_parent = v[1], o.in_flight_seen = v[2];
        for (int i = 0; i < 4; ++i) o.waits[i] = v[3 + i];
        o.last_first_token_us = v[7];
        all.overlap.Add(o);
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
  if (!f.prefill_lock.empty()) unlink(f.prefill_lock.c_str());
  const int64_t daemon_hits = static_cast<int64_t>(after->hit_tokens - before->hit_tokens);
  const int64_t daemon_duplicates = static_cast<int64_t>(after->duplicate_blocks - before->duplicate_blocks);
  const int64_t computed = all.prompt_tokens - all.hit_tokens;
  const Overlap& o = all.overlap;
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
  std::printf("prompt tokens computed: %lld of %lld   publish outcomes: %lld duplicates, %lld no_parent "
              "(daemon-counted duplicates: %lld)\n", static_cast<long long>(computed),
              static_cast<long long>(all.prompt_tokens), static_cast<long long>(o.duplicates),
              static_cast<long long>(o.no_parent), static_cast<long long>(daemon_duplicates));
  if (f.overlap()) {
    std::printf("prefill %.0f tokens/s%s, in-flight wait %lld ms: %lld starts found their next blocks in flight; "
                "waits answered published %lld, released %lld, timed out %lld\n", f.prefill_tps,
                f.prefill_shared ? " (the node's, shared)" : " (per request)", static_cast<long long>(f.wait_in_flight_ms),
                static_cast<long long>(o.in_flight_seen), static_cast<long long>(o.waits[1]),
                static_cast<long long>(o.waits[2]), static_cast<long long>(o.waits[3]));
  }
  if (f.fanout > 0) {
    std::printf("fan-out %d x (%lld shared + %lld own tokens): time to the last first token %.1f ms\n", f.fanout,
                static_cast<long long>(f.fanout_context), static_cast<long long>(f.fanout_own),
                o.last_first_token_us / 1000.0);
  }
  std::printf("(TTFT: start to the prompt's publish, prefill delay included)\n");
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
        "\"refused\": %d, \"computed_tokens\": %d, \"duplicates\": %d, \"no_parent\": %d, "
        "\"daemon_duplicates\": %d, \"in_flight_seen\": %d, \"in_flight_published\": %d, "
        "\"in_flight_released\": %d, \"in_flight_timed_out\": %d, \"last_first_token_ms\": %.3f, "
        "\"prefill_tps\": %.1f, \"prefill_shared\": %d, \"wait_in_flight_ms\": %d, \"fanout\": %d, "
        "\"latency\": {%s}}\n",
        all.requests, f.workers, seconds, all.requests / seconds, all.prompt_tokens, all.hit_tokens, daemon_hits,
        hit_rate, saved, f.bounds ? unlimited.all.hit_rate() : -1, f.bounds ? unlimited.all.saved_fraction() : -1,
        f.bounds ? belady.all.hit_rate() : -1, f.bounds ? belady.all.saved_fraction() : -1, all.waits, all.failures,
        computed, o.duplicates, o.no_parent, daemon_duplicates, o.in_flight_seen, o.waits[1], o.waits[2], o.waits[3],
        o.last_first_token_us / 1000.0, f.prefill_tps, f.prefill_shared ? 1 : 0, f.wait_in_flight_ms, f.fanout,
        json_lat.str());
  }
  return 0;
}
