// kvd_step_worker: plays an engine that runs a batch per step (continuous batching) against a live
// kvd, through the step protocol (client/step.h).
//
// It starts --batch requests in one step (prompts share their first --shared tokens), verifies
// every reused byte, writes the rest of each prompt (the example pattern, kv_pattern.h) and
// publishes it, then decodes: every step grows each running request by one position (from the
// worker's block credit: most steps make no round trip) and writes that position, for --gen
// steps; the last step publishes every request's full blocks and ends it. With --preempt-at=N the
// first request is preempted at decode step N (checkpoint + release) and resumed (resume_from),
// its KV verified. It prints one JSON line:
//   {"requests": ..., "steps": ..., "round_trips": ..., "cached_tokens": ..., "verified_bytes": ...,
//    "written_bytes": ..., "mismatches": ..., "resumed": ..., "kept_blocks": ...}
// and exits 0, or 3 when a reused byte did not match (wrong KV served).
//
//   kvd_step_worker --target=unix:///run/kvd/kvd.sock --batch=8 --prompt-len=40 --shared=16 --gen=24
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/client.h"
#include "proto/vocab/default_paths.h"
#include "client/examples/kv_pattern.h"
#include "proto/vocab/status_macros.h"

namespace {

using kvd::Token;

struct Stats {
  int64_t verified_bytes = 0, written_bytes = 0, mismatches = 0;
};

struct Generation {
  kvd::client::StepRequest req;
  kvd::RequestSpec spec;
  std::vector<Token> tokens;
  bool done = false;
};

// Writes (or, with verify, checks) the KV of positions [from, to) of `g`.
absl::Status TouchKv(kvd::client::Client& client, const Generation& g, int64_t from, int64_t to, bool verify,
                     Stats* stats) {
  const kvd::client::PoolView& pool = client.pools()[g.req.pool];
  const kvd::PoolGeometry& geo = pool.geometry;
  std::vector<uint8_t> want(geo.bytes_per_token_per_layer), got(want.size());
  for (int64_t pos = from; pos < to; ++pos) {
    const kvd::BlockIndex block = g.req.blocks[pos / geo.block_tokens];
    const int64_t slot = (pos % geo.block_tokens) * geo.bytes_per_token_per_layer;
    for (int32_t layer = 0; layer < geo.num_layers; ++layer) {
      for (int64_t j = 0; j < geo.bytes_per_token_per_layer; ++j) want[j] = kvd::example::KvByte(g.tokens[pos], pos, layer, j);
      if (verify) {
        KVD_RETURN_IF_ERROR(client.ReadLayer(g.req.pool, block, layer, slot, got.data(), got.size()));
        for (size_t j = 0; j < got.size(); ++j) stats->mismatches += got[j] != want[j];
        stats->verified_bytes += geo.bytes_per_token_per_layer;
      } else {
        // A request of an earlier attachment is never written again, even once the new lease holds.
        if (!client.MayWrite(g.req.epoch)) return absl::AbortedError("the lease is lost: writing stopped");
        KVD_RETURN_IF_ERROR(client.WriteLayer(g.req.pool, block, layer, slot, want.data(), want.size()));
        stats->written_bytes += geo.bytes_per_token_per_layer;
      }
    }
  }
  return absl::OkStatus();
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvd_step_worker: %s\n", s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvd_step_worker: a batch per step on kvd's memory"};
  std::string target = kvd::DefaultTarget(), pool = "default", id = "s", salt;
  int64_t batch = 4, prompt_len = 20, shared = 8, gen = 8, hang_after = -1, credit = 128, preempt_at = -1;
  app.add_option("--target", target, "kvd address (default: $KVD_TARGET, else kvd's default socket for this user)");
  app.add_option("--pool", pool, "pool name");
  app.add_option("--id", id, "request id prefix");
  app.add_option("--salt", salt, "tenant cache salt");
  app.add_option("--batch", batch, "requests decoded together")->check(CLI::Range(1, 4096));
  app.add_option("--prompt-len", prompt_len, "prompt tokens per request")->check(CLI::Range(1, 1 << 20));
  app.add_option("--shared", shared, "leading prompt tokens every request shares");
  app.add_option("--gen", gen, "decode steps")->check(CLI::Range(0, 1 << 20));
  app.add_option("--step-credit", credit, "block credit asked for per pool");
  app.add_option("--hang-after-steps", hang_after, "print STEPPING after this many decode steps and hang");
  app.add_option("--preempt-at", preempt_at,
                 "at this decode step preempt the first request (checkpoint + release) and resume it");
  CLI11_PARSE(app, argc, argv);

  // Every write is a WriteLayer call on this thread: nothing of a lost attachment is in flight.
  auto connected = kvd::client::Client::Connect(
      {.target = target, .worker_name = "step-worker", .step_credit_blocks = credit, .no_async_writes = true});
  if (!connected.ok()) return Fail(connected.status());
  kvd::client::Client& client = **connected;
  std::vector<Generation> gens(batch);
  for (int64_t i = 0; i < batch; ++i) {
    Generation& g = gens[i];
    for (int64_t t = 0; t < prompt_len; ++t) {
      g.tokens.push_back(static_cast<Token>(t < shared ? t : 100000 + i * 10000 + t));
    }
    g.spec.id = kvd::RequestId(absl::StrCat(id, "-", i));
    g.spec.ns.pool = pool;
    g.spec.ns.cache_salt = salt;
    g.spec.prompt = g.tokens;
    g.spec.max_new_tokens = gen;
  }
  Stats stats;
  int64_t steps = 0, round_trips = 0, cached = 0, resumed = 0, published = 0;
  auto run = [&](kvd::client::StepBatch& b) -> absl::StatusOr<kvd::client::StepAnswer> {
    KVD_ASSIGN_OR_RETURN(kvd::client::StepAnswer a, client.Step(b));
    ++steps;
    round_trips += a.sent ? 1 : 0;
    return a;
  };
  // Admission: start every request; those that come back waiting are started again next step.
  for (;;) {
    kvd::client::StepBatch b;
    for (Generation& g : gens) {
      if (!g.req.live) b.Start(&g.req, g.spec);
    }
    if (b.size() == 0) break;
    auto a = run(b);
    if (!a.ok()) return Fail(a.status());
    for (size_t k = 0; k < a->items.size(); ++k) {
      if (!a->items[k].status.ok()) return Fail(a->items[k].status);
    }
  }
  // Prefill: verify what was reused, write the rest, publish the prompt's full blocks.
  {
    kvd::client::StepBatch b;
    for (Generation& g : gens) {
      cached += g.req.acquired.cached_tokens;
      if (auto s = TouchKv(client, g, 0, g.req.acquired.cached_tokens, true, &stats); !s.ok()) return Fail(s);
      if (auto s = TouchKv(client, g, g.req.acquired.cached_tokens, prompt_len, false, &stats); !s.ok()) return Fail(s);
      b.Publish(&g.req, g.tokens, prompt_len / client.pools()[g.req.pool].geometry.block_tokens);
    }
    auto a = run(b);
    if (!a.ok()) return Fail(a.status());
  }
  // Decode.
  for (int64_t step = 0; step < gen; ++step) {
    if (step == hang_after) {
      // Every block this process may still write: its credit, and its tables past the published
      // prompt blocks (published blocks are immutable: never written again).
      std::vector<kvd::BlockIndex> mine = client.StepCreditBlocks(gens[0].req.pool);
      const size_t published = static_cast<size_t>(prompt_len / client.pools()[gens[0].req.pool].geometry.block_tokens);
      for (const Generation& g : gens) mine.insert(mine.end(), g.req.blocks.begin() + published, g.req.blocks.end());
      std::printf("STEPPING %lld writable=%s\n", static_cast<long long>(step), absl::StrJoin(mine, ",").c_str());
      std::fflush(stdout);
      for (;;) pause();  // the test kills this process
    }
    if (step == preempt_at) {
      // Preempted as a scheduler does when the pool cannot grow: checkpoint every position with
      // KV, release; then started again with resume_from, which hands the same KV back.
      Generation& g = gens[0];
      kvd::client::StepBatch p;
      p.Preempt(&g.req, g.tokens, "");
      auto pa = run(p);
      if (!pa.ok()) return Fail(pa.status());
      if (!pa->items[0].status.ok()) return Fail(pa->items[0].status);
      kvd::RequestSpec again = g.spec;
      again.resume_from = again.id;
      kvd::client::StepBatch r;
      r.Start(&g.req, again);
      auto ra = run(r);
      if (!ra.ok()) return Fail(ra.status());
      if (!ra->items[0].status.ok()) return Fail(ra->items[0].status);
      if (!g.req.acquired.resumed || g.req.acquired.resumed_tokens != g.tokens) {
        return Fail(absl::InternalError("the preempted request did not resume at its checkpoint"));
      }
      ++resumed;
      const int64_t have = g.req.acquired.cached_tokens;  // a fenced tail block comes back fresh
      if (auto s = TouchKv(client, g, 0, have, true, &stats); !s.ok()) return Fail(s);
      if (auto s = TouchKv(client, g, have, static_cast<int64_t>(g.tokens.size()), false, &stats); !s.ok()) {
        return Fail(s);
      }
    }
    kvd::client::StepBatch b;
    for (Generation& g : gens) b.Grow(&g.req, 1);
    auto a = run(b);
    if (!a.ok()) return Fail(a.status());
    for (size_t k = 0; k < gens.size(); ++k) {
      Generation& g = gens[k];
      if (!a->items[k].status.ok()) return Fail(a->items[k].status);
      g.tokens.push_back(kvd::example::NextToken(g.tokens.back()));
      const int64_t pos = static_cast<int64_t>(g.tokens.size()) - 1;
      if (auto s = TouchKv(client, g, pos, pos + 1, false, &stats); !s.ok()) return Fail(s);
    }
  }
  {
    kvd::client::StepBatch b;
    for (Generation& g : gens) {
      const int64_t bt = client.pools()[g.req.pool].geometry.block_tokens;
      b.Publish(&g.req, g.tokens, static_cast<int64_t>(g.tokens.size()) / bt);
      b.End(&g.req, 0, {}, /*completed=*/true);
    }
    auto a = run(b);
    if (!a.ok()) return Fail(a.status());
    for (const auto& item : a->items) {
      if (!item.status.ok()) return Fail(item.status);
    }
    for (size_t k = 0; k < gens.size(); ++k) published += a->items[2 * k].kept;
    for (const Generation& g : gens) {
      if (!g.req.error.ok()) return Fail(g.req.error);
    }
  }
  std::printf(
      "%s\n", absl::StrFormat("{\"requests\": %d, \"steps\": %d, \"round_trips\": %d, \"cached_tokens\": %d, "
                              "\"verified_bytes\": %d, \"written_bytes\": %d, \"mismatches\": %d, "
                              "\"resumed\": %d, \"kept_blocks\": %d}",
                              batch, steps, round_trips, cached, stats.verified_bytes, stats.written_bytes,
                              stats.mismatches, resumed, published)
                .c_str());
  return stats.mismatches == 0 ? 0 : 3;
}
