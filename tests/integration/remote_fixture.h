// Helpers of the shared-tier (G4) integration tests: a daemon config with a Redis URL, the example
// worker run with every reused byte checked, metric waits, and a real redis-server.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/integration/harness.h"
#include "tests/util/free_port.h"

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

// A real redis-server bound to loopback only, without persistence, in a temp directory.
class RedisServer {
 public:
  RedisServer() : port_(FreeLoopbackPort()) {
    REQUIRE(port_ > 0);
    Start();
  }
  // Also listening on a Unix socket in its directory (unix_url()).
  struct WithUnixSocket {};
  explicit RedisServer(WithUnixSocket) : port_(FreeLoopbackPort()), unix_socket_(true) {
    REQUIRE(port_ > 0);
    Start();
  }
  ~RedisServer() { Kill(); }

  void Start() {
    pid_ = fork();
    if (pid_ == 0) {
      const std::string port = std::to_string(port_);
      const std::string sock = socket_path();
      std::vector<const char*> argv = {"redis-server", "--bind", "127.0.0.1", "--port", port.c_str(), "--save", "",
                                       "--appendonly", "no", "--dir", dir_.path().c_str(), "--logfile", "redis.log"};
      if (unix_socket_) argv.insert(argv.end(), {"--unixsocket", sock.c_str(), "--unixsocketperm", "700"});
      argv.push_back(nullptr);
      execvp("redis-server", const_cast<char* const*>(argv.data()));
      _exit(127);
    }
    for (int i = 0; i < 200; ++i) {
      if (Cli({"PING"}).out.find("PONG") != std::string::npos) return;
      absl::SleepFor(absl::Milliseconds(25));
    }
    FAIL("redis-server did not start on port " << port_ << " (is it installed? scripts/test.sh installs it)");
  }
  void Kill() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }
  ProcessResult Cli(std::vector<std::string> args) const {
    std::vector<std::string> full = {"-h", "127.0.0.1", "-p", std::to_string(port_)};
    full.insert(full.end(), args.begin(), args.end());
    return RunProcess("/usr/bin/redis-cli", full, absl::Seconds(10));
  }
  std::vector<std::string> Keys() const {
    std::vector<std::string> keys;
    for (absl::string_view k : absl::StrSplit(Cli({"--scan", "--pattern", "kvd:*"}).out, '\n', absl::SkipEmpty())) {
      keys.emplace_back(k);
    }
    return keys;
  }
  std::string url() const { return absl::StrCat("redis://127.0.0.1:", port_); }
  std::string socket_path() const { return dir_.path() + "/redis.sock"; }
  std::string unix_url() const { return "unix://" + socket_path(); }
  int port() const { return port_; }

 private:
  TempDir dir_;
  int port_;
  bool unix_socket_ = false;
  pid_t pid_ = -1;
};

}  // namespace kvd::testing
