// Load test: 64 worker processes (kvd-bench) run mixed request cycles — admit, acquire with
// prefix reuse, publish, decode with Extend and Checkpoint, release — against one daemon whose
// pool holds a fraction of the working set, so admission waits and eviction never stop. Bounded:
// 1,280 requests, loopback Unix socket. At the end Report must account for every block, the
// budget must be back to zero and no request may be left. Throughput and p99 are printed (the
// figures go in docs/performance.md), never asserted.
#include <fstream>
#include <random>

#include <catch2/catch.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client.h"
#include "tests/integration/harness.h"

namespace kvd {
namespace {

using namespace kvd::testing;

double JsonNumber(const std::string& json, const std::string& key) {
  const size_t at = json.find("\"" + key + "\":");
  if (at == std::string::npos) return -1;
  double v = -1;
  size_t end = json.find_first_of(",}", at);
  (void)absl::SimpleAtod(json.substr(at + key.size() + 3, end - at - key.size() - 3), &v);
  return v;
}

TEST_CASE("64 workers under constant admission waits and eviction leave exact accounting",
          "[load]") {
  TempDir dir;
  const std::string trace = dir.path() + "/trace.jsonl";
  {
    // 1,280 requests over 40 conversations: each turn extends its conversation's prefix.
    std::mt19937 rng(64);
    std::ofstream out(trace);
    std::vector<std::vector<int>> conv(40);
    int next_id = 1;
    for (int i = 0; i < 1280; ++i) {
      std::vector<int>& c = conv[rng() % conv.size()];
      for (int k = 1 + static_cast<int>(rng() % 4); k > 0; --k) c.push_back(next_id++);
      if (c.size() > 24) c.erase(c.begin() + 4, c.begin() + 12);  // keep prompts bounded
      out << "{\"timestamp\": " << i << ", \"input_length\": " << c.size() * 16
          << ", \"output_length\": 24, \"hash_ids\": [" << absl::StrJoin(c, ", ") << "]}\n";
    }
  }
  // 16-token blocks; 600 blocks hold a fraction of the ~4,000-block working set, and 64 workers'
  // reservations (up to 26 blocks each) exceed it: waits and evictions all along.
  const std::string config =
      "pools:\n  - name: default\n    block_tokens: 16\n    num_layers: 2\n"
      "    bytes_per_token_per_layer: 64\n    capacity_blocks: 600\n    max_model_len: 1024\n";
  DaemonProcess d(config);
  const std::string json = dir.path() + "/report.json";
  ProcessResult r = RunProcess(KVD_BENCH_BINARY,
                               {"--trace=" + trace, "--target=" + d.target(), "--workers=64",
                                "--as-fast-as-possible", "--max-decode-tokens=24",
                                "--checkpoint-every=8", "--no-bounds", "--json=" + json},
                               absl::Minutes(5));
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  std::ifstream in(json);
  std::string report;
  std::getline(in, report);
  INFO(report);
  REQUIRE(JsonNumber(report, "requests") == 1280);
  WARN("64 workers: " << JsonNumber(report, "requests_per_second") << " requests/s, "
                      << JsonNumber(report, "waits") << " admission waits; per-RPC p99 in the report: "
                      << report);

  auto observer = client::Client::Connect({.target = d.target(), .worker_name = "observer"});
  REQUIRE(observer.ok());
  CacheReport rep;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    rep = *(*observer)->Report();
  } while (rep.live_requests != 0 && absl::Now() < deadline);
  REQUIRE(rep.live_requests == 0);
  REQUIRE(rep.reserved_bytes == 0);
  REQUIRE(rep.orphaned_checkpoints == 0);
  const PoolReport& pool = rep.pools[0];
  REQUIRE(pool.owned_blocks == 0);
  REQUIRE(pool.free_blocks + pool.cached_blocks == pool.capacity_blocks);
  REQUIRE(pool.evictable_blocks == pool.cached_blocks);  // nobody holds a reference any more
  REQUIRE(rep.waited > 0);                                // admission really waited
  REQUIRE(rep.evictions[static_cast<int>(EvictReason::kCapacity)] > 0);  // eviction really ran
}

}  // namespace
}  // namespace kvd
