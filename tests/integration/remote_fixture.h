// Helpers of the shared-tier (G4) integration tests: a daemon config with a Redis URL, the example
// worker run with every reused byte checked, and metric waits.
#pragma once

#include <string>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/integration/harness.h"

namespace kvd::testing {

inline std::string Config(const std::string& redis_url, const std::string& disk_dir) {
  return absl::StrCat(SmallPoolConfig(64), "tiers:\n  disk_dir: ", disk_dir, "\n  codec: lz4\n",
                      "  redis_url: ", redis_url, "\n  redis_retry_after_s: 0.2\n");
}

// Waits (up to 4 s) until the metric `series` of `d` reaches `at_least`; REQUIREs it does.
inline void WaitForMetric(const DaemonProcess& d, const std::string& series, int64_t at_least) {
  for (int i = 0; i < 400 && Metric(d, series) < at_least; ++i) absl::SleepFor(absl::Milliseconds(10));
  REQUIRE(Metric(d, series) >= at_least);
}

// The example worker over tokens [start, start + len); REQUIREs every reused byte is right.
inline ProcessResult Work(const DaemonProcess& d, const std::string& id, int start, int len) {
  ProcessResult r = RunWorker({"--target", d.target(), "--id", id, "--prompt-range", absl::StrCat(start, ":", len)});
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  REQUIRE(JsonInt(r.out, "mismatches") == 0);
  return r;
}

// `kvdctl status` of `d` (REQUIREs it succeeds).
inline std::string KvdctlStatus(const DaemonProcess& d) {
  ProcessResult r = RunProcess(KVDCTL_BINARY, {"--target=" + d.target(), "status"});
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  return r.out;
}

inline const std::string kUploaded = "kvd_remote_blocks_total{direction=\"uploaded\"}";

}  // namespace kvd::testing
