// kvd_tier_bench: the tier figures of docs/performance.md, each beside its baseline, in one run.
//
//   kvd_tier_bench [--dir=/var/tmp] [--blocks=128] [--trace=conversation_trace.jsonl]
//                  [--restart=100000,1000000]
//
// 1. G1 -> G2 demotion and G2 -> G1 promotion of --blocks 2 MiB blocks (Llama-3-8B: 16 tokens x
//    32 layers x 4 KiB), beside a plain memcpy of the same bytes.
// 2. G2 -> G3 flush and G3 -> G1 promotion, beside a plain sequential write (+ fsync) and read of
//    a file of the same size in the same directory; the page cache is dropped for both reads.
// 3. Warm-restart load time with N saved blocks (small blocks: the load reads headers only).
// 4. Hit rate on a Mooncake trace with G1 at 3M tokens alone, then with G2 + G3 under it, and
//    what TierStore::Stats() (a /metrics scrape) costs with G1 full.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "client/tools/trace.h"
#include "gpu/host_arena.h"
#include "server/store/segment_file.h"
#include "server/store/tier_store.h"
#include "tests/bench/tier_bench_node.h"

namespace kvd {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
double GBps(int64_t bytes, double s) { return bytes / s / 1e9; }

using Node = TierBenchNode;

void DropPageCache(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  fdatasync(fd);
  posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  close(fd);
}

void DropDirCache(const std::string& dir) {
  for (const auto& e : std::filesystem::directory_iterator(dir)) DropPageCache(e.path());
}

void MoveBench(const std::string& base, int64_t nblocks) {
  PoolGeometry g;
  g.name = "llama8b";
  g.block_tokens = 16;
  g.num_layers = 32;
  g.bytes_per_token_per_layer = 4096;
  g.capacity_blocks = nblocks + 2;
  g.max_model_len = 1 << 20;
  const int64_t bb = g.block_bytes_all_shards();
  const int64_t total = nblocks * bb;
  const std::string dir = base + "/kvd-tier-bench";
  std::filesystem::remove_all(dir);
  TierOptions t;
  t.host_bytes = (nblocks + 2) * bb;
  t.disk_dir = dir;
  t.disk_bytes = 4 * total;
  Node node(g, t);
  RequestSpec spec;
  spec.id = RequestId("w");
  spec.ns.pool = g.name;
  for (int64_t i = 0; i < nblocks * 16 + 1; ++i) spec.prompt.push_back(static_cast<Token>(i));
  auto [acq, cached] = node.Start(spec);
  for (int64_t b = 0; b < nblocks; ++b) {
    std::vector<uint8_t> bytes(bb, static_cast<uint8_t>(b));
    Check(node.arena->WriteBlock(0, acq.blocks[b], bytes.data()), "fill");
  }
  std::vector<BlockIndex> blocks(acq.blocks.begin(), acq.blocks.begin() + nblocks);
  Check(node.cache->Publish(spec.id, spec.prompt, blocks).status(), "publish");
  Check(node.cache->Release(spec.id, true), "release");

  // Baseline: memcpy of the same bytes between two warm buffers.
  std::vector<uint8_t> a(total, 1), b(total, 2);
  double memcpy_s = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), total);
    memcpy_s = std::min(memcpy_s, Since(t0));
  }
  // Warm-up round trip (first touches of every page), then forget G2's copies.
  node.cache->Gc();
  spec.id = RequestId("r0");
  node.Start(spec);
  Check(node.cache->Release(spec.id, true), "release");
  node.store->DropMemory();
  auto t0 = Clock::now();
  node.cache->Gc();  // every block G1 -> G2
  const double demote_s = Since(t0);
  spec.id = RequestId("r1");
  t0 = Clock::now();
  auto r1 = node.Start(spec);
  const double promote_g2_s = Since(t0);
  Check(node.cache->Release(spec.id, true), "release");
  std::printf("G1->G2 demotion  %6.2f GB/s  (%lld x %lld B; memcpy of the same bytes %6.2f GB/s, ratio %.2f)\n",
              GBps(total, demote_s), (long long)nblocks, (long long)bb, GBps(total, memcpy_s), memcpy_s / demote_s);
  std::printf("G2->G1 promotion %6.2f GB/s  (hit %lld tokens; ratio to memcpy %.2f)\n",
              GBps(total, promote_g2_s), (long long)r1.second, memcpy_s / promote_g2_s);

  // Baseline: sequential write + fsync and read of one file of the same size, same directory.
  const std::string raw = dir + "/raw.bin";
  t0 = Clock::now();
  {
    int fd = open(raw.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    for (int64_t off = 0; off < total; off += 8 << 20) {
      if (write(fd, a.data() + off, std::min<int64_t>(8 << 20, total - off)) < 0) std::exit(1);
    }
    fsync(fd);
    close(fd);
  }
  const double raw_write_s = Since(t0);
  DropPageCache(raw);
  t0 = Clock::now();
  {
    int fd = open(raw.c_str(), O_RDONLY);
    for (int64_t off = 0; off < total; off += 8 << 20) {
      if (read(fd, b.data() + off, std::min<int64_t>(8 << 20, total - off)) < 0) std::exit(1);
    }
    close(fd);
  }
  const double raw_read_s = Since(t0);
  std::filesystem::remove(raw);
  node.cache->Gc();  // back to G2
  t0 = Clock::now();
  absl::StatusOr<FlushResult> f = node.store->Flush();  // G2 -> G3
  const double flush_s = Since(t0);
  node.store->DropMemory();
  DropDirCache(dir);
  spec.id = RequestId("r2");
  t0 = Clock::now();
  auto r2 = node.Start(spec);
  const double promote_g3_s = Since(t0);
  Check(node.cache->Release(spec.id, true), "release");
  std::printf("G2->G3 flush     %6.2f GB/s  (%lld records, durable %d; sequential write+fsync %6.2f GB/s, ratio %.2f)\n",
              GBps(total, flush_s), (long long)f->written_blocks, f->durable, GBps(total, raw_write_s),
              raw_write_s / flush_s);
  std::printf("G3->G1 promotion %6.2f GB/s  (hit %lld tokens, cold page cache; sequential read %6.2f GB/s, ratio %.2f)\n",
              GBps(total, promote_g3_s), (long long)r2.second, GBps(total, raw_read_s), raw_read_s / promote_g3_s);
  std::filesystem::remove_all(dir);
}

void RestartBench(const std::string& base, int64_t n) {
  PoolGeometry g;
  g.name = "m";
  g.block_tokens = 16;
  g.num_layers = 1;
  g.bytes_per_token_per_layer = 4;  // 64-byte blocks: the load never reads payloads anyway
  g.capacity_blocks = 1024;
  const std::string dir = base + "/kvd-restart-bench";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  Manifest m;
  const int64_t per_segment = 65536;
  std::string payload(64, 'x');
  const BlockKey root = NamespaceRootKey(Namespace{.pool = "m"});
  BlockKey parent;
  for (int64_t first = 0; first < n; first += per_segment) {
    std::vector<RecordHeader> headers;
    std::vector<absl::string_view> payloads;
    for (int64_t i = first; i < std::min(n, first + per_segment); ++i) {
      RecordHeader h;
      h.ns.pool = "m";
      h.tokens.resize(16);
      for (int k = 0; k < 16; ++k) h.tokens[k] = static_cast<Token>(i * 16 + k);
      const bool chain = i % 64 != 0;  // prefixes of 64 blocks
      h.has_parent = chain;
      h.parent_key = chain ? parent : BlockKey{};
      h.key = ChainBlockKey(h.parent_key, root, h.tokens);
      parent = h.key;
      h.raw_length = 64;
      h.stored_length = 64;
      h.checksum = Checksum(payload.data(), payload.size());
      h.layout_tag = LayoutTag(g);
      headers.push_back(std::move(h));
      payloads.push_back(payload);
    }
    const uint64_t number = m.next_segment++;
    Check(WriteSegment(dir, SegmentName(number), headers, payloads).status(), "segment");
    m.segments.push_back(number);
  }
  Check(WriteManifest(dir, m), "manifest");
  DropDirCache(dir);
  TierOptions t;
  t.disk_dir = dir;
  t.disk_bytes = int64_t{1} << 40;
  auto t0 = Clock::now();
  Node node(g, t);
  const double s = Since(t0);
  const TierStats st = node.store->Stats();
  std::printf("restart with %8lld saved blocks: %.3f s to serve (load %.3f s, %lld reloaded, %.0f blocks/s)\n",
              (long long)n, s, st.load_seconds, (long long)st.reloaded_records, n / s);
  std::filesystem::remove_all(dir);
}

void HitRateBench(const std::string& base, const std::string& trace_path, int64_t g1_tokens) {
  auto trace = bench::LoadTrace(trace_path);
  Check(trace.status(), "trace");
  for (int with_tiers = 0; with_tiers < 2; ++with_tiers) {
    PoolGeometry g;
    g.name = "trace";
    g.block_tokens = 16;
    g.num_layers = 1;
    g.bytes_per_token_per_layer = 1;
    g.capacity_blocks = g1_tokens / 16;
    g.max_model_len = 1 << 22;
    const std::string dir = base + "/kvd-hit-bench";
    std::filesystem::remove_all(dir);
    TierOptions t;
    t.host_bytes = with_tiers ? 2 * g1_tokens : 16;  // 2x G1 in G2 (16-byte blocks)
    t.disk_dir = with_tiers ? dir : "";
    t.disk_bytes = int64_t{8} << 30;
    t.segment_bytes = 1 << 20;
    std::unique_ptr<Node> node;
    if (with_tiers) {
      node = std::make_unique<Node>(g, t);
    } else {
      node = std::make_unique<Node>(g, TierOptions{.host_bytes = 16});  // G2 of one block: G1 alone
      node->cache->SetEvictionSink(nullptr);
    }
    int64_t prompt = 0, hit = 0;
    auto t0 = Clock::now();
    for (size_t i = 0; i < trace->size(); ++i) {
      RequestSpec spec;
      spec.id = RequestId(absl::StrCat("r", i));
      spec.ns.pool = "trace";
      spec.prompt = bench::TraceTokens((*trace)[i]);
      spec.max_new_tokens = (*trace)[i].output_length;
      if (spec.prompt.empty() || static_cast<int64_t>(spec.prompt.size()) + spec.max_new_tokens > g1_tokens) continue;
      auto [acq, cached] = node->Start(spec);
      const int64_t full = static_cast<int64_t>(spec.prompt.size()) / 16;
      std::vector<BlockIndex> blocks(acq.blocks.begin(), acq.blocks.begin() + full);
      Check(node->cache->Publish(spec.id, spec.prompt, blocks).status(), "publish");
      Check(node->cache->Release(spec.id, true), "release");
      prompt += static_cast<int64_t>(spec.prompt.size());
      hit += cached;
    }
    const TierStats st = node->store->Stats();
    std::printf("%-34s hit rate %5.1f%% (%lld of %lld prompt tokens; promoted %llu from host, %llu from disk; %.1f s)\n",
                with_tiers ? "G1 3M tokens + G2 6M + G3 on disk:" : "G1 3M tokens alone:", 100.0 * hit / prompt,
                (long long)hit, (long long)prompt, (unsigned long long)st.promotions[1],
                (unsigned long long)st.promotions[2], Since(t0));
    // What a /metrics scrape costs the tiers with G1 full: Stats(), median of 21 calls.
    std::vector<double> calls;
    for (int k = 0; k < 21; ++k) {
      const auto s0 = Clock::now();
      (void)node->store->Stats();
      calls.push_back(Since(s0));
    }
    std::sort(calls.begin(), calls.end());
    std::printf("  TierStore::Stats() with %lld blocks in G1: %.1f us (median of 21)\n",
                (long long)node->cache->Report().indexed_blocks, calls[10] * 1e6);
    node.reset();
    std::filesystem::remove_all(dir);
  }
}

}  // namespace
}  // namespace kvd

int main(int argc, char** argv) {
  std::string dir = "/var/tmp", trace, restart = "100000,1000000";
  int64_t blocks = 128;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--dir=", 0) == 0) dir = a.substr(6);
    else if (a.rfind("--blocks=", 0) == 0) blocks = std::stoll(a.substr(9));
    else if (a.rfind("--trace=", 0) == 0) trace = a.substr(8);
    else if (a.rfind("--restart=", 0) == 0) restart = a.substr(10);
    else {
      std::fprintf(stderr, "usage: kvd_tier_bench [--dir=D] [--blocks=N] [--trace=PATH] [--restart=N,M]\n");
      return 2;
    }
  }
  kvd::MoveBench(dir, blocks);
  for (absl::string_view n : absl::StrSplit(restart, ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (absl::SimpleAtoi(n, &v)) kvd::RestartBench(dir, v);
  }
  if (!trace.empty()) kvd::HitRateBench(dir, trace, 3'000'000);
  return 0;
}
