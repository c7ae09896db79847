// kvd_example_worker: plays an inference engine against a live kvd.
//
// For one prompt it acquires state (resumed checkpoint, cached prefix, or fresh), verifies every
// byte of every reused token slot, "computes" KV for the rest by writing a deterministic pattern
// (a function of token, position and layer) into its writable blocks in place, publishes the full
// blocks, then generates --gen tokens one at a time (Extend, write, checkpoint every
// --checkpoint-every tokens), publishes again and releases. It prints one JSON line:
//   {"request": ..., "worker": ..., "resumed": ..., "cached_tokens": ..., "tokens": ...,
//    "verified_bytes": ..., "written_bytes": ..., "mismatches": ...}
// and exits 0, or 3 when a reused byte did not match (wrong KV served).
//
//   kvd_example_worker --target=unix:///run/kvd/kvd.sock --id=r1 --prompt-range=0:100 --gen=20
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "client/examples/kv_pattern.h"

namespace {

using kvd::Token;

struct Stats {
  int64_t verified_bytes = 0;
  int64_t written_bytes = 0;
  int64_t mismatches = 0;
};

// Writes (or, with verify, checks) the KV of positions [from, to) of `tokens`.
absl::Status TouchKv(kvd::client::Client& client, const kvd::client::KvRequest& req,
                     const std::vector<Token>& tokens, int64_t from, int64_t to, bool verify,
                     Stats* stats) {
  const kvd::client::PoolView& pool = client.pools()[req.pool()];
  const kvd::PoolGeometry& g = pool.geometry;
  for (int64_t pos = from; pos < to; ++pos) {
    const kvd::BlockIndex block = req.blocks()[pos / g.block_tokens];
    const int64_t slot = (pos % g.block_tokens) * g.bytes_per_token_per_layer;
    for (uint32_t shard = 0; shard < pool.shard_base.size(); ++shard) {
      if (pool.shard_base[shard] == nullptr) continue;  // another rank's shard
      for (int32_t layer = 0; layer < g.num_layers; ++layer) {
        std::vector<uint8_t> want(g.bytes_per_token_per_layer);
        for (int64_t j = 0; j < g.bytes_per_token_per_layer; ++j) {
          want[j] = kvd::example::KvByte(tokens[pos], pos, layer + 1000 * shard, j);
        }
        if (verify) {
          std::vector<uint8_t> got(want.size());
          auto s = client.ReadLayer(req.pool(), block, layer, slot, got.data(), got.size(), shard);
          if (!s.ok()) return s;
          for (size_t j = 0; j < got.size(); ++j) stats->mismatches += got[j] != want[j];
          stats->verified_bytes += g.bytes_per_token_per_layer;
        } else {
          auto s = client.WriteLayer(req.pool(), block, layer, slot, want.data(), want.size(), shard);
          if (!s.ok()) return s;
          stats->written_bytes += g.bytes_per_token_per_layer;
        }
      }
    }
  }
  return absl::OkStatus();
}

std::vector<Token> ParsePrompt(const std::string& list, const std::string& range) {
  std::vector<Token> out;
  if (!range.empty()) {
    std::vector<std::string> parts = absl::StrSplit(range, ':');
    uint32_t start = 0, len = 0;
    if (parts.size() == 2 && absl::SimpleAtoi(parts[0], &start) && absl::SimpleAtoi(parts[1], &len)) {
      for (uint32_t i = 0; i < len; ++i) out.push_back(start + i);
    }
  }
  for (absl::string_view t : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    uint32_t v = 0;
    if (absl::SimpleAtoi(t, &v)) out.push_back(v);
  }
  return out;
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvd_example_worker: %s\n", s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvd example worker"};
  std::string target, pool = "default", id = "example", prompt_list, prompt_range, resume_from,
              session, salt;
  int64_t gen = 0, checkpoint_every = 0, async_writer_us = 0;
  bool hang_after_checkpoint = false;
  app.add_option("--target", target, "kvd address, e.g. unix:///run/kvd/kvd.sock")->required();
  app.add_option("--pool", pool, "pool name");
  app.add_option("--id", id, "request id");
  app.add_option("--prompt", prompt_list, "comma-separated prompt tokens");
  app.add_option("--prompt-range", prompt_range, "START:LEN prompt tokens start..start+len-1, before --prompt");
  app.add_option("--gen", gen, "tokens to generate");
  app.add_option("--checkpoint-every", checkpoint_every, "checkpoint every N generated tokens");
  app.add_option("--resume-from", resume_from, "resume this interrupted request's checkpoint");
  app.add_option("--session", session, "session id");
  app.add_option("--salt", salt, "tenant cache salt");
  int32_t shard = -1;
  app.add_option("--shard", shard, "tensor-parallel rank: map only this shard (-1: all)");
  app.add_option("--async-writer-us", async_writer_us,
                 "write the prompt's KV on a second thread (as a GPU stream would), this many "
                 "microseconds per token, and publish at once: the client's write fence orders it");
  app.add_flag("--hang-after-checkpoint", hang_after_checkpoint,
               "after the first checkpoint, print CHECKPOINTED and wait to be killed");
  CLI11_PARSE(app, argc, argv);

  auto client = kvd::client::Client::Connect(
      {.target = target, .worker_name = "example-" + id, .shard = shard});
  if (!client.ok()) return Fail(client.status());
  kvd::RequestSpec spec;
  spec.id = kvd::RequestId(id);
  spec.ns.pool = pool;
  spec.ns.cache_salt = salt;
  spec.prompt = ParsePrompt(prompt_list, prompt_range);
  spec.max_new_tokens = gen;
  spec.session = kvd::SessionId(session);
  spec.resume_from = kvd::RequestId(resume_from);
  auto req = (*client)->Start(spec);
  if (!req.ok()) return Fail(req.status());
  kvd::client::KvRequest& r = **req;

  std::vector<Token> tokens = r.resumed() ? r.resumed_tokens() : spec.prompt;
  Stats stats;
  // Reused KV must be exactly what the writer of these tokens wrote.
  if (auto s = TouchKv(**client, r, tokens, 0, r.cached_tokens(), /*verify=*/true, &stats); !s.ok()) return Fail(s);
  std::jthread writer;  // the asynchronous "stream" of --async-writer-us; joined by its fence
  if (async_writer_us > 0) {
    auto done = std::make_shared<std::promise<absl::Status>>();
    std::shared_future<absl::Status> finished = done->get_future().share();
    writer = std::jthread([&, done] {
      absl::Status s;
      for (int64_t pos = r.cached_tokens(); pos < r.num_tokens() && s.ok(); ++pos) {
        std::this_thread::sleep_for(std::chrono::microseconds(async_writer_us));
        s = TouchKv(**client, r, tokens, pos, pos + 1, false, &stats);
      }
      done->set_value(s);
    });
    (*client)->AddWriteFence([finished] { return finished.get(); });
    std::printf("WRITING\n");
    std::fflush(stdout);
  } else if (auto s = TouchKv(**client, r, tokens, r.cached_tokens(), r.num_tokens(), false, &stats); !s.ok()) {
    return Fail(s);
  }
  if (auto p = r.Publish(tokens); !p.ok()) return Fail(p.status());

  const int64_t generated_before = static_cast<int64_t>(tokens.size() - spec.prompt.size());
  for (int64_t i = generated_before; i < gen; ++i) {
    if (auto s = r.Extend(1); !s.ok()) return Fail(s);
    tokens.push_back(kvd::example::NextToken(tokens.back()));
    const int64_t pos = static_cast<int64_t>(tokens.size()) - 1;
    if (auto s = TouchKv(**client, r, tokens, pos, pos + 1, false, &stats); !s.ok()) return Fail(s);
    if (checkpoint_every > 0 && (i + 1) % checkpoint_every == 0) {
      if (auto s = r.Checkpoint(tokens, "generated=" + std::to_string(i + 1)); !s.ok()) return Fail(s);
      if (hang_after_checkpoint) {
        std::printf("CHECKPOINTED %zu\n", tokens.size());
        std::fflush(stdout);
        for (;;) pause();  // the test kills this process with SIGKILL
      }
    }
  }
  if (auto p = r.Publish(tokens); !p.ok()) return Fail(p.status());
  const bool resumed = r.resumed();
  const int64_t cached = r.cached_tokens();
  if (auto s = r.Release(/*completed=*/true); !s.ok()) return Fail(s);
  if (writer.joinable()) writer.join();
  std::printf(
      "{\"request\": \"%s\", \"worker\": \"%s\", \"resumed\": %s, \"cached_tokens\": %lld, "
      "\"tokens\": %zu, \"verified_bytes\": %lld, \"written_bytes\": %lld, \"mismatches\": %lld}\n",
      id.c_str(), (*client)->worker_id().value().c_str(), resumed ? "true" : "false",
      static_cast<long long>(cached), tokens.size(), static_cast<long long>(stats.verified_bytes),
      static_cast<long long>(stats.written_bytes), static_cast<long long>(stats.mismatches));
  return stats.mismatches == 0 ? 0 : 3;
}
