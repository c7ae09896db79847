// kvd_example_worker: plays an inference engine against a live kvd.
//
// For one prompt it acquires state (resumed checkpoint, cached prefix, or fresh), verifies every
// byte of every reused token slot, "computes" KV for the rest by writing a deterministic pattern
// (a function of token, position and layer) into its writable blocks in place, publishes the full
// blocks, then generates --gen tokens one at a time (Extend, write, checkpoint every
// --checkpoint-every tokens), publishes again and releases. It prints one JSON line:
//   {"request": ..., "worker": ..., "resumed": ..., "cached_tokens": ..., "tokens": ...,
//    "verified_bytes": ..., "written_bytes": ..., "mismatches": ..., "blocks": [...]}
// and exits 0, or 3 when a reused byte did not match (wrong KV served).
//
//   kvd_example_worker --id=r1 --prompt-range=0:100 --gen=20   [--target=unix:///run/kvd/kvd.sock]
#include <unistd.h>

#include <algorithm>
#include <atomic>
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
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "proto/vocab/default_paths.h"
#include "client/examples/kv_pattern.h"
#include "proto/vocab/status_macros.h"

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
          // A request of a lost attachment is never written again (its blocks may be someone
          // else's now); WriteLayer itself refuses while the lease is not held.
          if (!req.MayWrite()) return absl::AbortedError("the request's lease is lost: writing stopped");
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

struct Options {
  int64_t gen = 0;
  int64_t checkpoint_every = 0;
  int64_t async_writer_us = 0;
  bool careless_writer = false;
  bool hang_after_checkpoint = false;
};

// One request, start to release, as an engine would run it; its JSON line, or the first error.
// `blocks`, when given, receives the request's blocks.
absl::StatusOr<std::string> RunRequest(kvd::client::Client& client, const kvd::RequestSpec& spec,
                                       const Options& o, Stats& stats,
                                       std::vector<kvd::BlockIndex>* blocks = nullptr) {
  auto req = client.Start(spec);
  if (!req.ok()) return req.status();
  kvd::client::KvRequest& r = **req;

  std::vector<Token> tokens = r.resumed() ? r.resumed_tokens() : spec.prompt;
  // Reused KV must be exactly what the writer of these tokens wrote.
  KVD_RETURN_IF_ERROR(TouchKv(client, r, tokens, 0, r.cached_tokens(), /*verify=*/true, &stats));
  std::jthread writer;  // the asynchronous "stream" of --async-writer-us; joined by its fence
  if (o.async_writer_us > 0 && o.careless_writer) {
    // An engine that gates its writer on the client's lease alone, waits while it is not held,
    // registers no quiesce hook and syncs with its writer itself before publishing.
    writer = std::jthread([&] {
      const kvd::client::PoolView& pool = client.pools()[r.pool()];
      const kvd::PoolGeometry& g = pool.geometry;
      for (int64_t pos = r.cached_tokens(); pos < r.num_tokens(); ++pos) {
        std::this_thread::sleep_for(std::chrono::microseconds(o.async_writer_us));
        for (int i = 0; i < 30000 && !client.MayWrite(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        const kvd::BlockIndex block = r.blocks()[pos / g.block_tokens];
        const int64_t slot = (pos % g.block_tokens) * g.bytes_per_token_per_layer;
        for (int32_t layer = 0; layer < g.num_layers; ++layer) {
          std::vector<uint8_t> want(g.bytes_per_token_per_layer);
          for (int64_t j = 0; j < g.bytes_per_token_per_layer; ++j) want[j] = kvd::example::KvByte(tokens[pos], pos, layer, j);
          if (client.WriteLayer(r.pool(), block, layer, slot, want.data(), want.size()).ok()) {
            stats.written_bytes += g.bytes_per_token_per_layer;
          }
        }
      }
    });
    std::printf("WRITING\n");
    std::fflush(stdout);
    writer.join();
  } else if (o.async_writer_us > 0) {
    auto done = std::make_shared<std::promise<absl::Status>>();
    std::shared_future<absl::Status> finished = done->get_future().share();
    writer = std::jthread([&, done] {
      absl::Status s;
      for (int64_t pos = r.cached_tokens(); pos < r.num_tokens() && s.ok(); ++pos) {
        std::this_thread::sleep_for(std::chrono::microseconds(o.async_writer_us));
        s = TouchKv(client, r, tokens, pos, pos + 1, false, &stats);
      }
      done->set_value(s);
    });
    client.AddWriteFence([finished] { return finished.get(); });
    std::printf("WRITING\n");
    std::fflush(stdout);
  } else {
    KVD_RETURN_IF_ERROR(TouchKv(client, r, tokens, r.cached_tokens(), r.num_tokens(), false, &stats));
  }
  KVD_RETURN_IF_ERROR(r.Publish(tokens).status());

  const int64_t generated_before = static_cast<int64_t>(tokens.size() - spec.prompt.size());
  for (int64_t i = generated_before; i < o.gen; ++i) {
    KVD_RETURN_IF_ERROR(r.Extend(1));
    tokens.push_back(kvd::example::NextToken(tokens.back()));
    const int64_t pos = static_cast<int64_t>(tokens.size()) - 1;
    KVD_RETURN_IF_ERROR(TouchKv(client, r, tokens, pos, pos + 1, false, &stats));
    if (o.checkpoint_every > 0 && (i + 1) % o.checkpoint_every == 0) {
      KVD_RETURN_IF_ERROR(r.Checkpoint(tokens, "generated=" + std::to_string(i + 1)));
      if (o.hang_after_checkpoint) {
        std::printf("CHECKPOINTED %zu\n", tokens.size());
        std::fflush(stdout);
        for (;;) pause();  // the test kills this process with SIGKILL
      }
    }
  }
  KVD_RETURN_IF_ERROR(r.Publish(tokens).status());
  const bool resumed = r.resumed();
  const int64_t cached = r.cached_tokens();
  if (blocks != nullptr) *blocks = r.blocks();
  const std::string block_list = absl::StrJoin(r.blocks(), ", ");  // where its KV lives, for readers
  KVD_RETURN_IF_ERROR(r.Release(/*completed=*/true));
  if (writer.joinable()) writer.join();
  return absl::StrFormat(
      "{\"request\": \"%s\", \"worker\": \"%s\", \"resumed\": %s, \"cached_tokens\": %d, "
      "\"tokens\": %d, \"verified_bytes\": %d, \"written_bytes\": %d, \"mismatches\": %d, "
      "\"blocks\": [%s]}",
      spec.id.value(), client.worker_id().value(), resumed ? "true" : "false", cached, tokens.size(),
      stats.verified_bytes, stats.written_bytes, stats.mismatches, block_list);
}

// The bytes of one token slot this worker wrote, remembered through its own mapping, so that
// after kvd restarts it can tell whether the memory was kept (the bytes are still there).
struct Probe {
  const uint8_t* at = nullptr;  // in this process's mapping (host backend)
  std::vector<uint8_t> bytes;
};

Probe Remember(kvd::client::Client& client, const kvd::RequestSpec& spec,
               const std::vector<kvd::BlockIndex>& blocks) {
  Probe p;
  if (client.backend() != "host" || blocks.empty()) return p;
  auto pool = client.FindPool(spec.ns.pool);
  if (!pool.ok()) return p;
  auto ptr = client.LayerPointer((*pool)->id, blocks[0], 0);
  if (!ptr.ok()) return p;
  p.at = *ptr;
  p.bytes.assign(*ptr, *ptr + (*pool)->geometry.bytes_per_token_per_layer);
  return p;
}

// --requests=N: runs N requests one after another, riding through kvd restarts. A request lost
// to a restart (KvdRestarted) or started while kvd is away (UNAVAILABLE) is started again. Prints
// each request's JSON line, "LOST <k> <why>" for each loss, and after each re-attachment "KEPT
// <ok|changed>" (kvd kept its memory: the bytes this worker wrote are still in its old mapping)
// or "REMAPPED" (new memory; on_remap was called).
int RunLoop(const std::string& target, const std::string& id, const kvd::RequestSpec& base,
            int64_t requests, int64_t pause_ms, const Options& o, int32_t shard) {
  std::atomic<int> remaps{0};
  auto client = kvd::client::Client::Connect({.target = target, .worker_name = "example-" + id,
                                              .shard = shard, .on_remap = [&] { ++remaps; }});
  if (!client.ok()) return Fail(client.status());
  int64_t epoch = (*client)->epoch();
  int seen_remaps = 0;
  Probe probe;
  for (int64_t k = 0; k < requests;) {
    if ((*client)->epoch() != epoch) {  // re-attached since the last request
      epoch = (*client)->epoch();
      if (remaps.load() != seen_remaps) {
        seen_remaps = remaps.load();
        std::printf("REMAPPED %lld\n", static_cast<long long>(epoch));
      } else if (probe.at != nullptr) {
        const bool same = std::equal(probe.bytes.begin(), probe.bytes.end(), probe.at);
        std::printf("KEPT %s %lld\n", same ? "ok" : "changed", static_cast<long long>(epoch));
      }
      std::fflush(stdout);
      probe = Probe();
    }
    kvd::RequestSpec spec = base;
    spec.id = kvd::RequestId(absl::StrCat(id, "-", k));
    for (Token& t : spec.prompt) t += static_cast<Token>(1000 * (k % 3));  // every third repeats
    Stats stats;
    std::vector<kvd::BlockIndex> blocks;
    absl::StatusOr<std::string> line = RunRequest(**client, spec, o, stats, &blocks);
    if (!line.ok()) {
      if (kvd::client::IsKvdRestarted(line.status()) || absl::IsUnavailable(line.status())) {
        std::printf("LOST %lld %s\n", static_cast<long long>(k), std::string(line.status().message()).c_str());
        std::fflush(stdout);
        continue;  // start it again
      }
      return Fail(line.status());
    }
    if (stats.mismatches != 0) {
      std::printf("%s\n", line->c_str());
      return 3;
    }
    std::printf("%s\n", line->c_str());
    std::fflush(stdout);
    probe = Remember(**client, spec, blocks);
    ++k;
    if (pause_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
  }
  std::printf("DONE %lld\n", static_cast<long long>(requests));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvd example worker"};
  std::string target = kvd::DefaultTarget(), pool = "default", id = "example", prompt_list, prompt_range, resume_from,
              session, salt, adapter;
  Options o;
  int64_t requests = 0, pause_ms = 0;
  app.add_option("--target", target, "kvd address (default: $KVD_TARGET, else kvd's default socket for this user)");
  app.add_option("--pool", pool, "pool name");
  app.add_option("--id", id, "request id");
  app.add_option("--prompt", prompt_list, "comma-separated prompt tokens");
  app.add_option("--prompt-range", prompt_range, "START:LEN prompt tokens start..start+len-1, before --prompt");
  app.add_option("--gen", o.gen, "tokens to generate");
  app.add_option("--checkpoint-every", o.checkpoint_every, "checkpoint every N generated tokens");
  app.add_option("--resume-from", resume_from, "resume this interrupted request's checkpoint");
  app.add_option("--session", session, "session id");
  app.add_option("--salt", salt, "tenant cache salt");
  app.add_option("--adapter", adapter, "LoRA adapter name (its own namespace)");
  int32_t shard = -1;
  app.add_option("--shard", shard, "tensor-parallel rank: map only this shard (-1: all)");
  app.add_option("--async-writer-us", o.async_writer_us,
                 "write the prompt's KV on a second thread (as a GPU stream would), this many "
                 "microseconds per token, and publish at once: the client's write fence orders it");
  app.add_flag("--careless-writer", o.careless_writer,
               "with --async-writer-us: gate the writer on Client::MayWrite() alone (waiting while it is "
               "false), with no write fence and no quiesce hook, as a careless engine would");
  app.add_flag("--hang-after-checkpoint", o.hang_after_checkpoint,
               "after the first checkpoint, print CHECKPOINTED and wait to be killed");
  app.add_option("--requests", requests,
                 "run this many requests (ids ID-0, ID-1, ...) riding through kvd restarts");
  app.add_option("--pause-ms", pause_ms, "with --requests: pause between requests");
  CLI11_PARSE(app, argc, argv);

  kvd::RequestSpec spec;
  spec.id = kvd::RequestId(id);
  spec.ns.pool = pool;
  spec.ns.cache_salt = salt;
  spec.ns.adapter = adapter;
  spec.prompt = ParsePrompt(prompt_list, prompt_range);
  spec.max_new_tokens = o.gen;
  spec.session = kvd::SessionId(session);
  spec.resume_from = kvd::RequestId(resume_from);
  if (requests > 0) return RunLoop(target, id, spec, requests, pause_ms, o, shard);

  // Its writers check KvRequest::MayWrite before each write, and a quiesce waits for the one in
  // flight through the write fence: it vouches for its writes, unless told to be careless.
  auto client = kvd::client::Client::Connect({.target = target,
                                              .worker_name = "example-" + id,
                                              .shard = shard,
                                              .no_async_writes = !o.careless_writer});
  if (!client.ok()) return Fail(client.status());
  Stats stats;
  absl::StatusOr<std::string> line = RunRequest(**client, spec, o, stats);
  if (!line.ok()) return Fail(line.status());
  std::printf("%s\n", line->c_str());
  return stats.mismatches == 0 ? 0 : 3;
}
