// No block changes hands while its old owner can still write it (docs/security.md, "Leases and
// fencing"). A worker writes its prompt's KV slowly on a second thread (a long prefill, a GPU
// stream) while kvd is taken over, fails over, or while the worker itself is stopped past its
// lease; another tenant's worker then takes blocks and publishes, and a third reads that prompt
// back checking every byte. Before fences, the new worker was given the writer's blocks (the
// allocator hands out the lowest free indices first) and the reader saw the writer's bytes.
#include <signal.h>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/integration/fence_fixture.h"
#include "tests/integration/harness.h"

namespace kvd {
namespace {

using namespace kvd::testing;

// 64 tokens (16 blocks) at 40 ms a token: about 2.6 s of writes after WRITING.
std::vector<std::string> SlowWriter(const std::string& target) {
  return {"--target=" + target, "--id=writer", "--prompt-range=0:64", "--async-writer-us=40000",
          "--salt=tenant-a"};
}

TEST_CASE("An asynchronous writer across --takeover: nothing it may still write goes to another tenant",
          "[integration][fences][handoff]") {
  DaemonProcess d(SmallPoolConfig(64));
  WorkerProcess a(SlowWriter(d.target()));
  REQUIRE(a.WaitForLine("WRITING", absl::Seconds(20)).ok());
  absl::SleepFor(absl::Milliseconds(300));
  REQUIRE(d.TakeOver());
  AnotherTenantReadsBackExactly(d.target());
}

TEST_CASE("An asynchronous writer across a failed takeover: the resumed kvd fences what it cannot vouch for",
          "[integration][fences][handoff]") {
  DaemonProcess d(SmallPoolConfig(64, "lease_ttl_s: 3\n"));
  WorkerProcess a(SlowWriter(d.target()));
  REQUIRE(a.WaitForLine("WRITING", absl::Seconds(20)).ok());
  absl::SleepFor(absl::Milliseconds(300));
  // The successor dies serving: the old kvd resumes on its memory with an empty index.
  setenv("KVD_TEST_HANDOFF_FAULT", "before-done", 1);
  const bool took_over = d.TakeOver();
  unsetenv("KVD_TEST_HANDOFF_FAULT");
  REQUIRE_FALSE(took_over);
  AnotherTenantReadsBackExactly(d.target());
  REQUIRE(d.Log().find("fenced for the lease TTL") != std::string::npos);
}

TEST_CASE("A writer stopped past its lease writes nothing when it resumes", "[integration][fences]") {
  DaemonProcess d(SmallPoolConfig(64, "lease_ttl_s: 4\n"));
  WorkerProcess a(SlowWriter(d.target()));
  REQUIRE(a.WaitForLine("WRITING", absl::Seconds(20)).ok());
  absl::SleepFor(absl::Milliseconds(200));
  a.Signal(SIGSTOP);
  // Its lease lapses (4 s) and kvd releases its request: the blocks are free again, and another
  // tenant is given them.
  absl::SleepFor(absl::Seconds(6));
  ProcessResult b = RunWorker({"--target=" + d.target(), "--id=b", "--prompt-range=5000:64", "--salt=tenant-b"});
  INFO(b.out);
  REQUIRE(b.exit_code == 0);
  // The writer wakes with its writer thread mid-prompt: it must notice the lease is gone first.
  a.Signal(SIGCONT);
  absl::SleepFor(absl::Seconds(3));
  ProcessResult reader = RunWorker({"--target=" + d.target(), "--id=reader", "--prompt-range=5000:64",
                                    "--salt=tenant-b"});
  INFO(reader.out);
  REQUIRE(JsonInt(reader.out, "cached_tokens") == 60);
  REQUIRE(JsonInt(reader.out, "mismatches") == 0);
}

}  // namespace
}  // namespace kvd
