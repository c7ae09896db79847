// Fault tests: workers killed with SIGKILL at random points, over and over. Nothing may leak, no
// published block may be lost, and every interrupted generation with a checkpoint must resume
// on another worker with byte-exact KV.
#include <signal.h>

#include <random>
#include <thread>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "tests/integration/harness.h"

namespace kvd {
namespace {

using namespace kvd::testing;

// The daemon's report once every dead worker's requests are released (their Attach streams end),
// checked for exact accounting: only orphaned checkpoints hold budget, every block is in one state.
CacheReport SettledReport(client::Client& observer) {
  CacheReport r;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    absl::SleepFor(absl::Milliseconds(20));
    r = *observer.Report();
  } while (r.live_requests != 0 && absl::Now() < deadline);
  REQUIRE(r.live_requests == 0);
  REQUIRE(r.reserved_bytes == r.checkpoint_bytes);
  const PoolReport& pool = r.pools[0];
  REQUIRE(pool.free_blocks + pool.owned_blocks + pool.cached_blocks == pool.capacity_blocks);
  return r;
}

TEST_CASE("Over 100 workers killed at random points leak nothing and lose nothing",
          "[integration][fault]") {
  DaemonProcess d(SmallPoolConfig(8192), {"--lease-ttl=4"});
  auto observer = client::Client::Connect({.target = d.target(), .worker_name = "observer"});
  REQUIRE(observer.ok());
  // A published prefix that every other worker reuses while it is being killed.
  ProcessResult base = RunWorker({"--target", d.target(), "--id", "base", "--prompt-range", "0:41"});
  REQUIRE(base.exit_code == 0);

  std::mt19937 rng(7);
  constexpr int kWorkers = 120;
  int kills = 0, hung = 0;
  const auto prompt_of = [](int i) {
    return i % 2 == 0 ? std::string("0:41") : absl::StrCat(1000 + i * 100, ":21");
  };
  for (int first = 0; first < kWorkers; first += 4) {
    // Four at a time, so kills land while other workers hold blocks of the same prefix.
    std::vector<std::unique_ptr<WorkerProcess>> batch;
    for (int i = first; i < first + 4; ++i) {
      std::vector<std::string> args = {"--target", d.target(), "--id", absl::StrCat("k", i),
                                       "--prompt-range", prompt_of(i), "--gen", "24",
                                       "--checkpoint-every", "4"};
      if (i % 3 == 0) args.push_back("--hang-after-checkpoint");
      batch.push_back(std::make_unique<WorkerProcess>(args));
    }
    for (int j = 0; j < 4; ++j) {
      const int i = first + j;
      if (i % 3 == 0) {
        REQUIRE(batch[j]->WaitForLine("CHECKPOINTED", absl::Seconds(20)).ok());
        ++hung;
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, 40000)(rng)));
      }
      batch[j]->Kill(SIGKILL);
      ++kills;
    }
  }
  WARN(kills << " workers killed with SIGKILL (" << hung << " right after a checkpoint)");
  REQUIRE(kills >= 100);

  // Every dead worker's requests are released once its Attach stream ends; accounting is exact.
  CacheReport r = SettledReport(**observer);
  REQUIRE(r.orphaned_checkpoints >= hung);
  // The published prefix survived every kill.
  REQUIRE(*(*observer)->PeekPrefixLen(Namespace{.pool = "default"}, Range(0, 41)) == 40);

  // Every interrupted generation resumes (or, killed before its first checkpoint, starts again)
  // with byte-exact KV; afterwards nothing is left allocated.
  int resumed = 0;
  for (int i = 0; i < kWorkers; ++i) {
    ProcessResult res = RunWorker({"--target", d.target(), "--id", absl::StrCat("r", i), "--resume-from",
                                   absl::StrCat("k", i), "--prompt-range", prompt_of(i), "--gen", "24"});
    INFO(res.out);
    REQUIRE(res.exit_code == 0);
    REQUIRE(JsonInt(res.out, "mismatches") == 0);
    if (JsonBool(res.out, "resumed")) ++resumed;
    if (i % 3 == 0) REQUIRE(JsonBool(res.out, "resumed"));
  }
  WARN(resumed << " interrupted generations resumed from their checkpoints");
  r = *(*observer)->Report();
  REQUIRE(r.orphaned_checkpoints == 0);
  REQUIRE(r.pools[0].owned_blocks == 0);
  REQUIRE(r.reserved_bytes == 0);
  REQUIRE(r.live_requests == 0);
}

// The horizon policy evicts out of recency order (the newest probation block, or an overdue one,
// whichever the shadows favour). Drive it from outside: a pool far smaller than the prompts' union,
// shadows on every key and short horizons so that both orders and both overdue rules fire, workers
// on shared and private prefixes, a third of them SIGKILLed mid-request. No worker may ever read a
// wrong byte, and afterwards every block is accounted for.
TEST_CASE("Under the horizon policy a churning pool serves exact bytes while workers die",
          "[integration][fault][policy]") {
  DaemonProcess d(SmallPoolConfig(64, "eviction_policy: horizon\nhorizon_sample_every: 1\n"
                                      "horizon_probation: 0.5\nhorizon_main: 1\n"),
                  {"--lease-ttl=4"});
  auto observer = client::Client::Connect({.target = d.target(), .worker_name = "observer"});
  REQUIRE(observer.ok());
  std::mt19937 rng(11);
  const auto prompt_of = [](int i) {
    switch (i % 4) {
      case 0: return std::string("0:81");                  // a long shared prefix
      case 1: return std::string("0:41");                  // its first half
      case 2: return absl::StrCat(5000 + (i % 12) * 100, ":41");  // a few recurring ones
      default: return absl::StrCat(20000 + i * 100, ":61");       // used once
    }
  };
  int kills = 0, finished = 0;
  int64_t verified = 0;
  for (int first = 0; first < 48; first += 4) {
    std::vector<std::unique_ptr<WorkerProcess>> batch;
    for (int i = first; i < first + 4; ++i) {
      batch.push_back(std::make_unique<WorkerProcess>(std::vector<std::string>{
          "--target", d.target(), "--id", absl::StrCat("h", i), "--prompt-range", prompt_of(i), "--gen", "8"}));
    }
    for (int j = 0; j < 4; ++j) {
      if ((first + j) % 3 == 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, 20000)(rng)));
        batch[j]->Kill(SIGKILL);
        ++kills;
        continue;
      }
      absl::StatusOr<std::string> line = batch[j]->WaitForLine("{\"request\"", absl::Seconds(30));
      REQUIRE(line.ok());
      INFO(*line);
      REQUIRE(JsonInt(*line, "mismatches") == 0);
      verified += JsonInt(*line, "verified_bytes");
      ++finished;
    }
  }
  REQUIRE(kills >= 12);
  REQUIRE(verified > 0);  // reused prefixes were read and checked, not only written
  REQUIRE(SettledReport(**observer).pools[0].owned_blocks == 0);
  // What survived the churn still reads back exactly.
  for (int i = 0; i < 8; ++i) {
    ProcessResult res = RunWorker({"--target", d.target(), "--id", absl::StrCat("v", i), "--prompt-range",
                                   prompt_of(i), "--gen", "4"});
    INFO(res.out);
    REQUIRE(res.exit_code == 0);
    REQUIRE(JsonInt(res.out, "mismatches") == 0);
  }
  WARN(kills << " workers killed, " << finished << " finished under the horizon policy");
}

}  // namespace
}  // namespace kvd
