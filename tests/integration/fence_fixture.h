// The check of the fence tests (fence_test.cc, fd_store_test.cc): while a slow writer of tenant A
// may still be writing, another tenant computes and publishes a prompt, and once the writer would
// have finished a reader gets that prompt back whole, byte for byte.
#pragma once

#include <string>

#include <catch2/catch.hpp>

#include "absl/time/clock.h"
#include "tests/integration/harness.h"

namespace kvd::testing {

// Another tenant computes and publishes a prompt now; once the slow writer would have finished,
// a reader gets it back whole, byte for byte.
inline void AnotherTenantReadsBackExactly(const std::string& target) {
  ProcessResult b = RunWorker({"--target=" + target, "--id=b", "--prompt-range=5000:64", "--salt=tenant-b"},
                              absl::Seconds(60));
  INFO(b.out);
  REQUIRE(b.exit_code == 0);
  absl::SleepFor(absl::Seconds(3));
  ProcessResult reader = RunWorker({"--target=" + target, "--id=reader", "--prompt-range=5000:64",
                                    "--salt=tenant-b"});
  INFO(reader.out);
  REQUIRE(JsonInt(reader.out, "cached_tokens") == 60);
  REQUIRE(JsonInt(reader.out, "mismatches") == 0);
  REQUIRE(reader.exit_code == 0);
}

}  // namespace kvd::testing
