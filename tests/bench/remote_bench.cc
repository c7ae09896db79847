// kvd_remote_bench: prefix fetch from the Redis tier (G4) over loopback, beside raw GETs of the
// same values in the same run.
//
//   kvd_remote_bench [--tokens=4096] [--layers=32] [--bytes-per-token-per-layer=4096] [--reps=7]
//                    [--redis=redis://127.0.0.1:PORT | redis-cluster://127.0.0.1:PORT,...]
//                    (default: starts its own redis-server)
//
// Node A publishes a --tokens prompt (16-token blocks; Llama-3-8B-shaped 2 MiB blocks by default)
// and uploads it write-through. Node B, a fresh cache, then acquires the same prompt --reps times
// (clearing its device pool between): each time TierStore's promotion asks Redis for the run
// (one EXISTS round trip), fetches it with pipelined GETs, verifies header and checksum and
// copies every block into B's pool. The baselines, same keys, same server: pipelined raw GETs
// through hiredis (no verification, no copy) and `redis-benchmark -t set,get`, both at kvd's
// pipeline depth for the value size (its GET line is the raw throughput; bytes/s = requests/s x
// value size).
#include <hiredis/hiredis.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gpu/host_arena.h"
#include "server/store/tier_store.h"
#include "tests/bench/tier_bench_node.h"
#include "tests/util/free_port.h"

namespace kvd {
namespace {

using SteadyClock = std::chrono::steady_clock;
double Since(SteadyClock::time_point t) { return std::chrono::duration<double>(SteadyClock::now() - t).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

using Node = TierBenchNode;

// Pipelined GETs of `keys` in chunks of `depth`; returns the bytes read.
int64_t RawGets(redisContext* c, const std::vector<std::string>& keys, size_t depth) {
  int64_t bytes = 0;
  for (size_t i = 0; i < keys.size(); i += depth) {
    const size_t end = std::min(keys.size(), i + depth);
    for (size_t k = i; k < end; ++k) redisAppendCommand(c, "GET %b", keys[k].data(), keys[k].size());
    for (size_t k = i; k < end; ++k) {
      void* r = nullptr;
      if (redisGetReply(c, &r) != REDIS_OK) std::exit(1);
      bytes += static_cast<redisReply*>(r)->len;
      freeReplyObject(r);
    }
  }
  return bytes;
}

}  // namespace
}  // namespace kvd

int main(int argc, char** argv) {
  using namespace kvd;
  int64_t tokens = 4096, layers = 32, bptl = 4096, reps = 7;
  std::string url;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&](const char* p) { return a.rfind(p, 0) == 0 ? a.substr(std::strlen(p)) : std::string(); };
    if (!val("--tokens=").empty()) tokens = std::stoll(val("--tokens="));
    else if (!val("--layers=").empty()) layers = std::stoll(val("--layers="));
    else if (!val("--bytes-per-token-per-layer=").empty()) bptl = std::stoll(val("--bytes-per-token-per-layer="));
    else if (!val("--reps=").empty()) reps = std::stoll(val("--reps="));
    else if (!val("--redis=").empty()) url = val("--redis=");
    else {
      std::fprintf(stderr, "usage: kvd_remote_bench [--tokens=N] [--layers=N] [--bytes-per-token-per-layer=N] [--reps=N] [--redis=URL]\n");
      return 2;
    }
  }
  pid_t redis = -1;
  int port = 0;
  std::string dir = "/tmp/kvd-remote-bench-" + std::to_string(getpid());
  if (url.empty()) {
    port = testing::FreeLoopbackPort();
    std::filesystem::create_directories(dir);
    redis = fork();
    if (redis == 0) {
      execlp("redis-server", "redis-server", "--bind", "127.0.0.1", "--port", std::to_string(port).c_str(), "--save", "",
             "--appendonly", "no", "--dir", dir.c_str(), "--logfile", "redis.log", static_cast<char*>(nullptr));
      _exit(127);
    }
    url = absl::StrCat("redis://127.0.0.1:", port);
    absl::SleepFor(absl::Milliseconds(300));
  } else if (url.rfind("redis-cluster://", 0) != 0) {
    port = std::stoi(url.substr(url.rfind(':') + 1));
  }

  PoolGeometry g;
  g.name = "llama8b";
  g.block_tokens = 16;
  g.num_layers = static_cast<int32_t>(layers);
  g.bytes_per_token_per_layer = bptl;
  const int64_t nblocks = tokens / 16;
  g.capacity_blocks = nblocks + 2;
  g.max_model_len = static_cast<int32_t>(tokens + 16);
  const int64_t bb = g.block_bytes_all_shards();
  TierOptions t;
  t.remote.url = url;
  t.remote.io_timeout = absl::Seconds(10);

  RequestSpec spec;
  spec.ns.pool = g.name;
  for (int64_t i = 0; i < tokens + 1; ++i) spec.prompt.push_back(static_cast<Token>(i * 7 + 1));
  {
    Node a(g, t);
    spec.id = RequestId("a");
    auto [acq, cached] = a.Start(spec);
    for (int64_t b = 0; b < nblocks; ++b) {
      std::vector<uint8_t> bytes(bb);
      for (int64_t k = 0; k < bb; ++k) bytes[k] = static_cast<uint8_t>((k * 131 + b * 7) >> 3);  // not all-equal
      Check(a.arena->WriteBlock(0, acq.blocks[b], bytes.data()), "fill");
    }
    std::vector<BlockIndex> blocks(acq.blocks.begin(), acq.blocks.begin() + nblocks);
    Check(a.cache->Publish(spec.id, spec.prompt, blocks).status(), "publish");
    Check(a.cache->Release(spec.id, true), "release");
    for (int i = 0; i < 3000 && a.store->Stats().remote.uploaded_blocks < static_cast<uint64_t>(nblocks); ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    std::printf("uploaded %llu blocks of %lld B (%s)\n", (unsigned long long)a.store->Stats().remote.uploaded_blocks,
                (long long)bb, url.c_str());
  }

  TierOptions tb = t;
  tb.remote.write_through = false;
  Node b(g, tb);
  std::vector<double> fetch_s;
  int64_t hit = 0;
  for (int64_t r = 0; r < reps; ++r) {
    spec.id = RequestId(absl::StrCat("b", r));
    auto t0 = SteadyClock::now();
    auto [acq, cached] = b.Start(spec);
    fetch_s.push_back(Since(t0));
    hit = cached;
    Check(b.cache->Release(spec.id, true), "release");
    b.cache->ClearCache();
  }
  const RemoteStats rs = b.store->Stats().remote;
  const double stored_per_block = static_cast<double>(rs.fetched_bytes) / std::max<uint64_t>(1, rs.fetched_blocks);

  const double f = Median(fetch_s);
  std::printf("G4 prefix fetch   %lld tokens = %lld blocks: median %.1f ms, %.0f blocks/s, %.2f GB/s "
              "(hit %lld tokens, %.0f B stored per block, verified and copied into the pool)\n",
              (long long)tokens, (long long)nblocks, f * 1e3, nblocks / f, nblocks * bb / f / 1e9, (long long)hit,
              stored_per_block);
  if (port == 0) {  // a Redis Cluster: the baselines below talk to one server
    std::printf("(Redis Cluster: %llu MOVED, %llu ASK, %llu slot maps read; raw baselines are single-server only)\n",
                (unsigned long long)rs.moved, (unsigned long long)rs.asked, (unsigned long long)rs.slot_refreshes);
    return 0;
  }
  redisContext* c = redisConnect("127.0.0.1", port);
  redisReply* keys_reply = static_cast<redisReply*>(redisCommand(c, "KEYS kvd:*"));
  std::vector<std::string> keys;
  for (size_t i = 0; i < keys_reply->elements; ++i) keys.emplace_back(keys_reply->element[i]->str, keys_reply->element[i]->len);
  freeReplyObject(keys_reply);
  std::vector<double> raw_s;
  int64_t raw_bytes = 0;
  // The pipeline depth kvd uses for this value size (tier_store_remote.cc: <= 32, ~8 MiB in flight).
  const size_t depth = static_cast<size_t>(std::clamp<int64_t>((int64_t{8} << 20) / bb, 1, 32));
  for (int64_t r = 0; r < reps; ++r) {
    auto t0 = SteadyClock::now();
    raw_bytes = RawGets(c, keys, depth);
    raw_s.push_back(Since(t0));
  }
  redisFree(c);

  const double raw = Median(raw_s);
  std::printf("raw pipelined GET %lld values (depth %zu):      median %.1f ms, %.0f values/s, %.2f GB/s  -> kvd/raw %.2f\n",
              (long long)keys.size(), depth, raw * 1e3, keys.size() / raw, raw_bytes / raw / 1e9, raw / f);
  std::fflush(stdout);
  const std::string cmd = absl::StrCat("redis-benchmark -h 127.0.0.1 -p ", port, " -t set,get -d ",
                                       static_cast<int64_t>(stored_per_block), " -P ", depth, " -n ", nblocks,
                                       " -c 1 -q 2>&1 | tr '\\r' '\\n' | grep 'requests per second'");
  std::printf("redis-benchmark (%s):\n", cmd.c_str());
  std::fflush(stdout);
  if (std::system(cmd.c_str()) != 0) std::printf("  (redis-benchmark not available)\n");
  if (redis > 0) {
    kill(redis, SIGTERM);
    waitpid(redis, nullptr, 0);
    std::filesystem::remove_all(dir);
  }
  return 0;
}
