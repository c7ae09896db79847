// Test harness for integration tests: a real kvd process on a temporary Unix socket (never a
// fixed port: metrics bind port 0), and real worker processes.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/vocab/cache_types.h"

namespace kvd::testing {

// A temporary directory, removed with its contents on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A kvd daemon process. The constructor starts it and waits until it serves.
class DaemonProcess {
 public:
  // `config_yaml` becomes its --config; `extra_flags` are appended to the command line.
  DaemonProcess(const std::string& config_yaml, std::vector<std::string> extra_flags = {});
  ~DaemonProcess();  // SIGKILLs the daemon if still running

  // The gRPC target: the Unix socket, or HOST:PORT when extra_flags gave a --listen.
  std::string target() const { return tcp_target_.empty() ? "unix://" + socket_ : tcp_target_; }
  const std::string& side_socket() const { return side_socket_; }
  // The peer transfer listener as bound (HOST:PORT); empty without a transfer section.
  const std::string& transfer_address() const { return transfer_address_; }
  int metrics_port() const { return metrics_port_; }
  pid_t pid() const { return pid_; }
  const std::string& dir() const { return dir_.path(); }
  // Everything the daemon wrote to stdout and stderr so far.
  std::string Log() const;
  std::string log_path() const { return dir_.path() + "/kvd.log"; }
  // Sends `signal`; with wait, returns the exit code (-signal when killed by one).
  void Signal(int signal);
  // SIGKILLs the daemon (if running) and starts it again with the same config, flags, sockets and
  // directory; waits until it serves. False when it did not come up.
  bool Restart();
  absl::StatusOr<int> WaitExit(absl::Duration timeout);
  // Starts a successor with the same flags plus --takeover and `extra_flags` (and `config_yaml`
  // as its config when not empty): a hot handoff. True once the successor serves; this object
  // then follows it and predecessor() is the old process. False when the successor exited
  // (Log() says why); the old process is still this object's.
  bool TakeOver(const std::vector<std::string>& extra_flags = {}, const std::string& config_yaml = "");
  pid_t predecessor() const { return predecessor_; }
  absl::StatusOr<int> WaitPredecessorExit(absl::Duration timeout);

 private:
  bool Start();
  TempDir dir_;
  std::vector<std::string> args_;
  bool own_listen_ = false;
  std::string socket_;
  std::string side_socket_;
  int metrics_port_ = 0;
  pid_t pid_ = -1;
  pid_t predecessor_ = -1;
  std::string tcp_target_;
  std::string transfer_address_;
};

struct ProcessResult {
  int exit_code = -1;
  std::string out;
};

// Runs `binary` with `args` to completion (at most `timeout`), capturing stdout and stderr.
ProcessResult RunProcess(const std::string& binary, const std::vector<std::string>& args,
                         absl::Duration timeout = absl::Seconds(30));
// Runs the example worker with `args` to completion (at most `timeout`).
ProcessResult RunWorker(const std::vector<std::string>& args, absl::Duration timeout = absl::Seconds(30));
// Paths of the binaries under test.
std::string KvdBinary();
std::string ExampleWorkerBinary();
std::string StepWorkerBinary();  // kvd_step_worker: a batch per step (client/examples/step_worker.cc)

// A worker left running: started, with its stdout readable line by line.
class WorkerProcess {
 public:
  // The example worker, or `binary` when given.
  explicit WorkerProcess(const std::vector<std::string>& args, const std::string& binary = "");
  ~WorkerProcess();
  // Reads stdout until a line starting with `prefix` arrives (or timeout/EOF); lines before it
  // are dropped. An empty prefix takes the next line.
  absl::StatusOr<std::string> WaitForLine(const std::string& prefix, absl::Duration timeout);
  // Whether the process is still running (not reaped).
  bool Running();
  void Kill(int signal);
  // Sends `signal` without waiting (SIGSTOP, SIGCONT).
  void Signal(int signal);
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1;
  std::string buffer_;
};

// An integer field of a one-line JSON object, e.g. JsonInt(out, "cached_tokens").
int64_t JsonInt(const std::string& json, const std::string& key);
bool JsonBool(const std::string& json, const std::string& key);

// GET http://127.0.0.1:port/path over loopback; the body.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);
// The value of the Prometheus sample `series` (name and labels as printed) in a /metrics body;
// -1 when absent.
int64_t MetricValue(const std::string& body, const std::string& series);
// The same, scraped from the daemon now.
int64_t Metric(const DaemonProcess& d, const std::string& series);

// Tokens [start, start + n).
std::vector<Token> Range(Token start, int n);
// A request for `pool` (default "default") with `prompt` and `max_new` tokens to generate.
RequestSpec PoolRequest(const std::string& id, std::vector<Token> prompt, int64_t max_new = 0,
                        const std::string& pool = "default");

// A small pool config: 4-token blocks, 2 layers, 16 bytes per token per layer.
std::string SmallPoolConfig(int capacity_blocks = 64, const std::string& extra = "");

}  // namespace kvd::testing
