// kvd-bench against a live daemon: deterministic replays, its hit rate equals the daemon's own
// count, and its unlimited bound equals an independent computation.
#include <fstream>
#include <set>

#include <catch2/catch.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/integration/harness.h"

namespace kvd {
namespace {

using namespace kvd::testing;

double JsonDouble(const std::string& json, const std::string& key) {
  const std::string k = "\"" + key + "\": ";
  size_t at = json.find(k);
  if (at == std::string::npos) return -1;
  double v = -1;
  (void)absl::SimpleAtod(json.substr(at + k.size(), json.find_first_of(",}", at + k.size()) - at - k.size()), &v);
  return v;
}

struct Req {
  int64_t input;
  std::vector<uint64_t> ids;
};

// A small trace with shared prefixes: conversations that grow turn by turn, and one-offs.
std::vector<Req> MakeTrace() {
  std::vector<Req> t;
  uint64_t next = 1000;
  for (int conv = 0; conv < 6; ++conv) {
    std::vector<uint64_t> ids = {static_cast<uint64_t>(conv % 2)};  // two shared system prompts
    for (int turn = 0; turn < 4; ++turn) {
      ids.push_back(next++);
      t.push_back({static_cast<int64_t>(ids.size()) * 512 - 100, ids});
    }
  }
  for (int i = 0; i < 5; ++i) t.push_back({700, {next++, next++}});
  return t;
}

// Token hit rate of an unlimited cache at 16-token blocks, computed naively: a block is known
// when the same hash-id prefix and offset was seen before.
double NaiveUnlimited(const std::vector<Req>& trace) {
  std::set<std::vector<uint64_t>> seen;
  int64_t total = 0, hit = 0;
  for (const Req& r : trace) {
    total += r.input;
    auto key = [&](int64_t block) {
      std::vector<uint64_t> k(r.ids.begin(), r.ids.begin() + block * 16 / 512 + 1);
      k.push_back(block % 32);
      return k;
    };
    int64_t h = 0;
    while (h < (r.input - 1) / 16 && seen.count(key(h))) ++h;
    hit += h * 16;
    for (int64_t b = 0; b < r.input / 16; ++b) seen.insert(key(b));
  }
  return static_cast<double>(hit) / total;
}

TEST_CASE("kvd-bench replays deterministically and agrees with the daemon's counters", "[integration][bench]") {
  TempDir dir;
  const std::string trace = dir.path() + "/trace.jsonl";
  const std::vector<Req> reqs = MakeTrace();
  {
    std::ofstream out(trace);
    int64_t ts = 0;
    for (const Req& r : reqs) {
      out << "{\"timestamp\": " << ts++ << ", \"input_length\": " << r.input
          << ", \"output_length\": 20, \"hash_ids\": [" << absl::StrJoin(r.ids, ", ") << "]}\n";
    }
  }
  const std::string config =
      "pools:\n  - name: default\n    block_tokens: 16\n    num_layers: 1\n"
      "    bytes_per_token_per_layer: 8\n    capacity_blocks: 400\n    max_model_len: 4096\n";
  std::string reports[2];
  for (int run = 0; run < 2; ++run) {
    DaemonProcess d(config);  // a fresh daemon: same starting state
    const std::string json = dir.path() + absl::StrCat("/report", run, ".json");
    ProcessResult r = RunProcess(KVD_BENCH_BINARY, {"--trace=" + trace, "--target=" + d.target(), "--workers=1",
                                                    "--as-fast-as-possible", "--seed=7", "--json=" + json});
    INFO(r.out);
    REQUIRE(r.exit_code == 0);
    std::ifstream in(json);
    std::getline(in, reports[run]);
    INFO(reports[run]);
    REQUIRE(JsonDouble(reports[run], "requests") == reqs.size());
    REQUIRE(JsonDouble(reports[run], "hit_tokens") == JsonDouble(reports[run], "daemon_hit_tokens"));
    REQUIRE(JsonDouble(reports[run], "hit_tokens") > 0);
    REQUIRE(JsonDouble(reports[run], "unlimited_bound") == Approx(NaiveUnlimited(reqs)).epsilon(1e-5));
    REQUIRE(JsonDouble(reports[run], "farthest_next_use_bound") <= JsonDouble(reports[run], "unlimited_bound") + 1e-9);
    REQUIRE(JsonDouble(reports[run], "hit_rate") <= JsonDouble(reports[run], "farthest_next_use_bound") + 1e-9);
    // Compute saved: positive, below the hit rate (a prefix is the cheap part of a prompt), and
    // within the bounds' in the same order.
    REQUIRE(JsonDouble(reports[run], "compute_saved") > 0);
    REQUIRE(JsonDouble(reports[run], "compute_saved") < JsonDouble(reports[run], "hit_rate"));
    REQUIRE(JsonDouble(reports[run], "farthest_next_use_compute_saved") <=
            JsonDouble(reports[run], "unlimited_compute_saved") + 1e-9);
  }
  REQUIRE(JsonDouble(reports[0], "hit_rate") == JsonDouble(reports[1], "hit_rate"));
  REQUIRE(JsonDouble(reports[0], "compute_saved") == JsonDouble(reports[1], "compute_saved"));
}

// The agent fan-out (kvd-reuse-2): N requests start together on a new shared context of S tokens,
// each with its own tail, and each waits out a prefill delay before publishing. Asking kvd to wait
// for prompt blocks in flight, the node computes the context once: S + N x own prompt tokens.
// Without the wait every request computes the context too (the run that shows the difference).
TEST_CASE("kvd-bench's fan-out computes a shared context once with the in-flight wait", "[integration][bench]") {
  TempDir dir;
  const std::string config =
      "pools:\n  - name: default\n    block_tokens: 16\n    num_layers: 1\n"
      "    bytes_per_token_per_layer: 8\n    capacity_blocks: 400\n    max_model_len: 4096\n";
  constexpr int kN = 4, kContext = 64, kOwn = 16;
  DaemonProcess d(config);
  double computed[2] = {0, 0}, published_waits[2] = {0, 0};
  for (int wait = 0; wait < 2; ++wait) {
    const std::string json = dir.path() + absl::StrCat("/fanout", wait, ".json");
    // 80 prompt tokens at 40 tokens/s: each start's blocks stay in flight for 2 s. The workers are
    // processes that start at a common instant; under ASan on a loaded machine one can miss that
    // instant by hundreds of milliseconds, and a narrower window (400 ms, until CI failed with one
    // wait of three) would let a late one find the context published and count a plain hit.
    ProcessResult r = RunProcess(
        KVD_BENCH_BINARY, {"--target=" + d.target(), absl::StrCat("--fanout=", kN),
                           absl::StrCat("--fanout-context=", kContext), absl::StrCat("--fanout-own=", kOwn),
                           "--prefill-tps=40", "--max-decode-tokens=0", absl::StrCat("--seed=", 100 + wait),
                           absl::StrCat("--wait-in-flight-ms=", wait ? 5000 : 0), "--json=" + json});
    INFO(r.out);
    REQUIRE(r.exit_code == 0);
    std::string report;
    std::ifstream in(json);
    std::getline(in, report);
    INFO(report);
    REQUIRE(JsonDouble(report, "requests") == kN);
    REQUIRE(JsonDouble(report, "no_parent") == 0);
    REQUIRE(JsonDouble(report, "last_first_token_ms") > 0);
    computed[wait] = JsonDouble(report, "computed_tokens");
    published_waits[wait] = JsonDouble(report, "in_flight_published");
  }
  CHECK(computed[1] == kContext + kN * kOwn);  // the context once, every request's own tail
  CHECK(published_waits[1] == kN - 1);
  CHECK(computed[0] > kContext + kN * kOwn);   // without the wait, the context again
  CHECK(published_waits[0] == 0);
}

TEST_CASE("kvd-bench refuses a bad fan-out or in-flight wait, naming the flag", "[integration][bench]") {
  ProcessResult r = RunProcess(KVD_BENCH_BINARY, {"--target=unix:///nonexistent.sock", "--wait-in-flight-ms=40000"});
  CHECK(r.exit_code != 0);
  CHECK(r.out.find("--wait-in-flight-ms") != std::string::npos);
  r = RunProcess(KVD_BENCH_BINARY, {"--target=unix:///nonexistent.sock"});
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("--trace is required") != std::string::npos);
}

}  // namespace
}  // namespace kvd
