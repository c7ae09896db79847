// kvd restarts under a running engine (docs/operations.md, "Restarts: what engines see"): the worker
// re-attaches on its own, requests that were live fail with KvdRestarted and are started again,
// and the engine is told when its slabs moved. Attacked with SIGKILL at random points of a
// request, 20 times over, with one worker process that never restarts.
#include <signal.h>

#include <random>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "tests/integration/harness.h"

namespace kvd {
namespace {

using namespace kvd::testing;

// Reads the worker's lines until one request after the latest restart has succeeded; counts what
// it saw. FAILs on a wrong byte or a worker that died.
struct Seen {
  int lost = 0, remapped = 0, kept_ok = 0, kept_changed = 0, succeeded = 0;
};

void ReadUntilSuccess(WorkerProcess& w, Seen& seen) {
  for (;;) {
    absl::StatusOr<std::string> line = w.WaitForLine("", absl::Seconds(20));
    INFO(line.status().ToString());
    REQUIRE(line.ok());
    INFO(*line);
    if (absl::StartsWith(*line, "LOST ")) {
      REQUIRE(absl::StrContains(*line, "kvd"));  // KvdRestarted or "not attached to kvd"
      ++seen.lost;
    } else if (absl::StartsWith(*line, "REMAPPED")) {
      ++seen.remapped;
    } else if (absl::StartsWith(*line, "KEPT ok")) {
      ++seen.kept_ok;
    } else if (absl::StartsWith(*line, "KEPT changed")) {
      ++seen.kept_changed;
    } else {
      REQUIRE(absl::StartsWith(*line, "{"));
      REQUIRE(JsonInt(*line, "mismatches") == 0);
      ++seen.succeeded;
      return;
    }
  }
}

TEST_CASE("A worker rides through 20 SIGKILLs of kvd: re-attaches, remaps, loses nothing else",
          "[integration][restart]") {
  DaemonProcess d(SmallPoolConfig(64));
  WorkerProcess w({"--target=" + d.target(), "--id=ride", "--prompt-range=0:22", "--gen=4",
                   "--requests=100000", "--pause-ms=2"});
  Seen seen;
  ReadUntilSuccess(w, seen);
  std::mt19937 rng(42);
  for (int i = 0; i < 20; ++i) {
    // Kill at a random point of the worker's request stream.
    absl::SleepFor(absl::Microseconds(std::uniform_int_distribution<int>(0, 20000)(rng)));
    REQUIRE(d.Restart());
    const int before = seen.remapped;
    do {
      ReadUntilSuccess(w, seen);
    } while (seen.remapped == before);  // a success from before the kill may still be in the pipe
    REQUIRE(w.Running());
  }
  INFO("lost " << seen.lost << ", remapped " << seen.remapped << ", succeeded " << seen.succeeded);
  REQUIRE(seen.remapped == 20);  // a plain restart is new memory, every time
  REQUIRE(seen.kept_changed == 0);
  REQUIRE(w.Running());
}

TEST_CASE("A live request fails with KvdRestarted, never a hang or memory kvd no longer owns",
          "[integration][restart]") {
  DaemonProcess d(SmallPoolConfig(64));
  int remaps = 0;
  auto c = client::Client::Connect({.target = d.target(), .worker_name = "engine",
                                    .on_remap = [&] { ++remaps; }});
  REQUIRE(c.ok());
  auto r = (*c)->Start(PoolRequest("live", Range(0, 20), 8));
  REQUIRE(r.ok());
  const int64_t epoch = (*c)->epoch();
  REQUIRE(d.Restart());
  // The client notices on its own (its supervisor reads the attach stream) and re-attaches.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while ((*c)->epoch() == epoch && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  REQUIRE((*c)->WaitAttached(absl::Seconds(10)).ok());
  REQUIRE((*c)->epoch() == epoch + 1);
  REQUIRE(remaps == 1);
  // Every call on the lost request says so, with the typed error, and sends nothing.
  absl::Status extend = (*r)->Extend(1);
  INFO(extend.ToString());
  REQUIRE(client::IsKvdRestarted(extend));
  REQUIRE(extend.code() == absl::StatusCode::kAborted);
  REQUIRE(absl::StrContains(extend.message(), "'live'"));
  REQUIRE(client::IsKvdRestarted((*r)->Publish(Range(0, 20)).status()));
  REQUIRE(client::IsKvdRestarted((*r)->Release(true)));
  // The engine re-admits it, and it runs on the new daemon's memory.
  auto again = (*c)->Start(PoolRequest("live", Range(0, 20), 8));
  INFO(again.status().ToString());
  REQUIRE(again.ok());
  std::vector<uint8_t> bytes(16, 0x5A);
  REQUIRE((*c)->WriteLayer((*again)->pool(), (*again)->blocks()[0], 0, 0, bytes.data(), bytes.size()).ok());
  REQUIRE((*again)->Publish(Range(0, 20)).ok());
  REQUIRE((*again)->Release(true).ok());
  // Its writes landed in the new daemon's memory: a fresh client reuses the block and reads them.
  auto fresh = client::Client::Connect({.target = d.target(), .worker_name = "fresh"});
  REQUIRE(fresh.ok());
  auto hit = (*fresh)->Start(PoolRequest("hit", Range(0, 20)));
  REQUIRE(hit.ok());
  REQUIRE((*hit)->cached_tokens() == 16);
  std::vector<uint8_t> got(16);
  REQUIRE((*fresh)->ReadLayer((*hit)->pool(), (*hit)->blocks()[0], 0, 0, got.data(), got.size()).ok());
  REQUIRE(got == bytes);
}

TEST_CASE("While kvd is away, Start waits for it within its bound, then says why", "[integration][restart]") {
  auto d = std::make_unique<DaemonProcess>(SmallPoolConfig(64));
  auto c = client::Client::Connect({.target = d->target(), .worker_name = "patient"});
  REQUIRE(c.ok());
  d->Signal(SIGKILL);
  REQUIRE(d->WaitExit(absl::Seconds(5)).ok());
  auto r = (*c)->Start(PoolRequest("early", Range(0, 20)), absl::Milliseconds(300));
  INFO(r.status().ToString());
  REQUIRE(absl::IsUnavailable(r.status()));
  REQUIRE(absl::StrContains(r.status().message(), "kvd"));
  REQUIRE_FALSE((*c)->attached());
}

}  // namespace
}  // namespace kvd
