#include "tests/bench/decode_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include <grpcpp/grpcpp.h>
#include <unistd.h>
#include "server/core/clock.h"
#include "server/core/kv_cache.h"

namespace kvd::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kPromptTokens = 512;

double Micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

struct Stat {
  double p50 = 0, p99 = 0, mean = 0;
};
Stat Of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  Stat s;
  s.p50 = v[v.size() / 2];
  s.p99 = v[std::min(v.size() - 1, v.size() * 99 / 100)];
  s.mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  return s;
}

RequestSpec Spec(const std::string& id, uint32_t salt, int prompt_tokens, int max_new) {
  RequestSpec s;
  s.id = RequestId(id);
  s.ns.pool = "bench";
  for (int i = 0; i < prompt_tokens; ++i) s.prompt.push_back(salt * 100000u + static_cast<uint32_t>(i));
  s.max_new_tokens = max_new;
  return s;
}

double PingP50(client::Client& c) {
  std::vector<double> v;
  for (int i = 0; i < 200; ++i) {
    const auto t0 = Clock::now();
    (void)c.Ping();
    v.push_back(Micros(Clock::now() - t0));
  }
  return Of(v).p50;
}

// Per request, as README describes for one request at a time: Extend(1) per request per step.
bool PerRequest(client::Client& c, int batch, int steps, int round, std::vector<double>* out) {
  std::vector<std::unique_ptr<client::KvRequest>> reqs;
  for (int i = 0; i < batch; ++i) {
    auto r = c.Start(Spec(absl::StrCat("p", round, "-", i), 1000 + round * 5000 + i, kPromptTokens, steps + 16));
    if (!r.ok()) return std::fprintf(stderr, "start: %s\n", r.status().ToString().c_str()), false;
    reqs.push_back(std::move(*r));
  }
  for (int s = 0; s < steps; ++s) {
    const auto t0 = Clock::now();
    for (auto& r : reqs) {
      if (absl::Status st = r->Extend(1); !st.ok()) return std::fprintf(stderr, "extend: %s\n", st.ToString().c_str()), false;
    }
    out->push_back(Micros(Clock::now() - t0));
  }
  for (auto& r : reqs) (void)r->Release(true);
  return true;
}

// The step protocol: one Client::Step per step, every request growing by one (credit-covered
// growth makes no round trip).
bool Stepped(client::Client& c, int batch, int steps, int round, std::vector<double>* out, int64_t* trips,
             std::vector<double>* sent_us, int compute_us) {
  std::vector<client::StepRequest> reqs(batch);
  client::StepBatch start;
  for (int i = 0; i < batch; ++i) {
    start.Start(&reqs[i], Spec(absl::StrCat("s", round, "-", i), 2000 + round * 5000 + i, kPromptTokens, steps + 16));
  }
  auto a = c.Step(start);
  if (!a.ok()) return std::fprintf(stderr, "step start: %s\n", a.status().ToString().c_str()), false;
  for (const auto& item : a->items) {
    if (!item.status.ok() || item.waiting) return std::fprintf(stderr, "start item: %s\n", item.status.ToString().c_str()), false;
  }
  for (int s = 0; s < steps; ++s) {
    client::StepBatch b;
    for (auto& r : reqs) b.Grow(&r, 1);
    const auto t0 = Clock::now();
    auto g = c.Step(b);
    out->push_back(Micros(Clock::now() - t0));
    if (!g.ok()) return std::fprintf(stderr, "step: %s\n", g.status().ToString().c_str()), false;
    *trips += g->sent ? 1 : 0;
    if (g->sent) sent_us->push_back(out->back());
    if (compute_us > 0) absl::SleepFor(absl::Microseconds(compute_us));  // the engine's forward pass
  }
  client::StepBatch end;
  for (auto& r : reqs) end.End(&r, 0, {}, true);
  auto e = c.Step(end);
  return e.ok();
}

}  // namespace

// A round trip on a long-lived stream (the attach stream: heartbeat{seq} -> heartbeat_ack) against
// the unary Ping on the same connection kind: what a step stream would save per round trip.
void StreamVersusUnary(const std::string& target) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  auto stub = v1::Kvd::NewStub(channel);
  grpc::ClientContext ctx;
  auto stream = stub->Attach(&ctx);
  v1::AttachRequest hello;
  hello.mutable_hello()->set_pid(getpid());
  hello.mutable_hello()->set_worker_name("bench-stream");
  v1::AttachResponse resp;
  if (!stream->Write(hello) || !stream->Read(&resp)) return;
  std::vector<double> s, u;
  for (int i = 0; i < 2000; ++i) {
    v1::AttachRequest beat;
    beat.mutable_heartbeat()->set_seq(static_cast<uint64_t>(i + 1));
    auto t0 = Clock::now();
    if (!stream->Write(beat) || !stream->Read(&resp)) return;
    s.push_back(Micros(Clock::now() - t0));
    grpc::ClientContext pctx;
    v1::PingResponse pong;
    t0 = Clock::now();
    (void)stub->Ping(&pctx, v1::PingRequest(), &pong);
    u.push_back(Micros(Clock::now() - t0));
  }
  const Stat a = Of(s), b = Of(u);
  std::printf("\n| round trip (interleaved, 2,000 each) | p50 (us) | p99 (us) |\n|---|---|---|\n");
  std::printf("| unary (Ping) | %.1f | %.1f |\n| on a stream (attach heartbeat -> ack) | %.1f | %.1f |\n", b.p50, b.p99,
              a.p50, a.p99);
  stream->WritesDone();
  ctx.TryCancel();
}

bool RunDecodeBench(client::Client& c, const std::vector<int>& batches, int steps, int compute_us,
                    const std::string& target) {
  StreamVersusUnary(target);
  std::printf("\n| batch | protocol | steps | p50 per step (us) | p99 (us) | mean (us) | mean / Ping p50 | "
              "p99 / Ping p50 | round trips |\n|---|---|---|---|---|---|---|---|---|\n");
  int round = 0;
  for (int batch : batches) {
    const double ping = PingP50(c);
    // Extend(1) per request costs batch round trips per step: fewer steps at large batches.
    const int per_request_steps = std::max(8, std::min(steps, 8192 / batch));
    std::vector<double> per, stepped, sent;
    int64_t trips = 0;
    if (!PerRequest(c, batch, per_request_steps, round, &per)) return false;
    if (!Stepped(c, batch, steps, round, &stepped, &trips, &sent, compute_us)) return false;
    ++round;
    const Stat p = Of(per), s = Of(stepped);
    std::printf("| %d | Extend(1) per request | %d | %.1f | %.1f | %.1f | %.2f | %.2f | %d |\n", batch, per_request_steps,
                p.p50, p.p99, p.mean, p.mean / ping, p.p99 / ping, batch * per_request_steps);
    std::printf("| %d | Step, credit on, %d us compute | %d | %.1f | %.1f | %.1f | %.2f | %.2f | %lld |\n", batch, compute_us, steps, s.p50,
                s.p99, s.mean, s.mean / ping, s.p99 / ping, static_cast<long long>(trips));
    if (!sent.empty()) {
      const Stat t = Of(sent);
      std::printf("| %d | Step: the steps that went out | %zu | %.1f | %.1f | %.1f | %.2f | %.2f | |\n", batch, sent.size(),
                  t.p50, t.p99, t.mean, t.mean / ping, t.p99 / ping);
    }
    std::printf("| %d | Ping | | %.1f | | | 1.00 | | |\n", batch, ping);
  }

  // One step admitting 64 new 2,048-token prompts, half of them prefix hits, against Ping + the
  // engine in-process (a KvCache of the same geometry doing Admit + Acquire for the same 64).
  absl::StatusOr<const client::PoolView*> bench_pool = c.FindPool("bench");
  if (!bench_pool.ok()) return std::fprintf(stderr, "%s\n", bench_pool.status().ToString().c_str()), false;
  const PoolGeometry pool_geometry = (*bench_pool)->geometry;
  constexpr int kNew = 64;
  const int kRounds = std::getenv("KVD_BENCH_ADMIT_ROUNDS") ? std::atoi(std::getenv("KVD_BENCH_ADMIT_ROUNDS")) : 20;
  const int kTokens = std::getenv("KVD_BENCH_ADMIT_TOKENS") ? std::atoi(std::getenv("KVD_BENCH_ADMIT_TOKENS")) : 2048;
  std::vector<double> step_us, local_us, ping_us;
  SystemClock clock;
  for (int r = 0; r < kRounds; ++r) {
    std::vector<RequestSpec> specs;
    for (int i = 0; i < kNew; ++i) {
      // Even ones share a cached prompt (primed below); odd ones are new.
      specs.push_back(Spec(absl::StrCat("n", r, "-", i), i % 2 == 0 ? 7u : 100000u + r * 100 + i, kTokens, 16));
      specs.back().prompt.back() = static_cast<Token>(3'000'000 + r * 100 + i);  // the last block differs
    }
    if (r == 0) {  // prime the shared prefix in kvd
      client::StepRequest prime;
      client::StepBatch b;
      RequestSpec p = specs[0];
      p.id = RequestId("prime");
      b.Start(&prime, p);
      (void)c.Step(b);
      client::StepBatch e;
      e.End(&prime, kTokens / 16 - 1, {}, true);
      (void)c.Step(e);
    }
    ping_us.push_back(PingP50(c));
    std::vector<client::StepRequest> reqs(kNew);
    client::StepBatch b;
    for (int i = 0; i < kNew; ++i) b.Start(&reqs[i], specs[i]);
    const auto t0 = Clock::now();
    auto a = c.Step(b);
    step_us.push_back(Micros(Clock::now() - t0));
    if (!a.ok()) return std::fprintf(stderr, "admit step: %s\n", a.status().ToString().c_str()), false;
    client::StepBatch e;
    for (auto& q : reqs) e.End(&q, 0, {}, true);
    (void)c.Step(e);

    // In-process: a fresh cache with the shared prefix cached, then the same 64 Admit + Acquire.
    CacheOptions o;
    o.pools.push_back(pool_geometry);  // the daemon's pool, as ListPools described it
    auto cache = KvCache::Create(o, &clock);
    if (!cache.ok()) return false;
    RequestSpec p = specs[0];
    p.id = RequestId("prime");
    (void)(*cache)->Admit(p);
    auto got = (*cache)->Acquire(p.id);
    (void)(*cache)->End(p.id, kTokens / 16 - 1, {}, true);
    const auto t1 = Clock::now();
    for (const RequestSpec& s : specs) {
      (void)(*cache)->Admit(s);
      (void)(*cache)->Acquire(s.id);
    }
    local_us.push_back(Micros(Clock::now() - t1));
  }
  const Stat st = Of(step_us), lo = Of(local_us), pi = Of(ping_us);
  std::printf("\n| one step admitting 64 x 2,048-token prompts, half hits | p50 (us) |\n|---|---|\n");
  std::printf("| Step (64 starts) | %.1f |\n| in-process Admit + Acquire x 64 | %.1f |\n| Ping | %.1f |\n", st.p50, lo.p50,
              pi.p50);
  std::printf("| Step / (Ping + in-process) | %.2f |\n", st.p50 / (pi.p50 + lo.p50));
  return true;
}

}  // namespace kvd::bench
