#include "tests/integration/harness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvd::testing {
namespace {

pid_t Spawn(const std::string& binary, const std::vector<std::string>& args, int stdout_fd,
            bool also_stderr = false) {
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(binary.c_str()));
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    if (stdout_fd >= 0) dup2(stdout_fd, STDOUT_FILENO);
    if (stdout_fd >= 0 && also_stderr) dup2(stdout_fd, STDERR_FILENO);
    execv(binary.c_str(), argv.data());
    _exit(127);
  }
  return pid;
}

absl::StatusOr<int> WaitPid(pid_t pid, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    int status = 0;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    if (r < 0) return absl::InternalError("waitpid failed");
    if (absl::Now() > deadline) return absl::DeadlineExceededError("process did not exit");
    absl::SleepFor(absl::Milliseconds(10));
  }
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TempDir::TempDir() {
  char tmpl[] = "/tmp/kvd-test-XXXXXX";
  path_ = mkdtemp(tmpl);
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

int64_t MetricValue(const std::string& body, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(body, '\n')) {
    if (absl::StartsWith(line, series + " ")) {
      double v = -1;
      (void)absl::SimpleAtod(line.substr(series.size() + 1), &v);
      return static_cast<int64_t>(v);
    }
  }
  return -1;
}

int64_t Metric(const DaemonProcess& d, const std::string& series) {
  absl::StatusOr<std::string> body = HttpGet(d.metrics_port(), "/metrics");
  return body.ok() ? MetricValue(*body, series) : -1;
}

std::string DaemonProcess::Log() const { return ReadFile(log_path()); }

DaemonProcess::DaemonProcess(const std::string& config_yaml, std::vector<std::string> extra_flags) {
  socket_ = dir_.path() + "/kvd.sock";
  side_socket_ = socket_ + ".slabs";
  const std::string config = dir_.path() + "/kvd.yaml";
  std::ofstream(config) << config_yaml;
  for (const std::string& f : extra_flags) own_listen_ |= f.rfind("--listen=", 0) == 0;
  args_ = {"--config=" + config, "--metrics-listen=127.0.0.1:0",
           "--ready-file=" + dir_.path() + "/ready.json", "--log-level=warn"};
  if (!own_listen_) args_.push_back("--listen=unix://" + socket_);
  args_.insert(args_.end(), extra_flags.begin(), extra_flags.end());
  Start();
}

bool DaemonProcess::Start() {
  const std::string ready = dir_.path() + "/ready.json";
  unlink(ready.c_str());
  // Its log goes to a file the tests can read (Log()), not to the test's terminal.
  const int log_fd = open(log_path().c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0640);
  pid_ = Spawn(KvdBinary(), args_, log_fd, /*also_stderr=*/true);
  if (log_fd >= 0) close(log_fd);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline) {
    const std::string json = ReadFile(ready);
    if (!json.empty()) {
      metrics_port_ = static_cast<int>(JsonInt(json, "metrics_port"));
      if (const size_t t = json.find("\"transfer\": \""); t != std::string::npos) {
        transfer_address_ = json.substr(t + 13, json.find('"', t + 13) - (t + 13));
      }
      if (own_listen_) {  // "grpc": "HOST:PORT" as bound
        const size_t at = json.find("\"grpc\": \"") + 9;
        tcp_target_ = json.substr(at, json.find('"', at) - at);
      }
      return true;
    }
    int status;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return false;  // died: tests see a connect failure
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

bool DaemonProcess::Restart() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  return Start();
}

bool DaemonProcess::TakeOver(const std::vector<std::string>& extra_flags, const std::string& config_yaml) {
  std::vector<std::string> args = args_;
  if (!config_yaml.empty()) {
    const std::string config = dir_.path() + "/kvd-next.yaml";
    std::ofstream(config) << config_yaml;
    for (std::string& a : args) {
      if (a.rfind("--config=", 0) == 0) a = "--config=" + config;
    }
  }
  args.push_back("--takeover");
  args.insert(args.end(), extra_flags.begin(), extra_flags.end());
  std::swap(args, args_);
  const pid_t old = pid_;
  const bool started = Start();
  if (!started) {
    std::swap(args, args_);
    if (pid_ > 0) kill(pid_, SIGKILL), waitpid(pid_, nullptr, 0);
    pid_ = old;
    return false;
  }
  if (predecessor_ > 0) kill(predecessor_, SIGKILL), waitpid(predecessor_, nullptr, 0);
  predecessor_ = old;
  return true;
}

absl::StatusOr<int> DaemonProcess::WaitPredecessorExit(absl::Duration timeout) {
  auto code = WaitPid(predecessor_, timeout);
  if (code.ok()) predecessor_ = -1;
  return code;
}

DaemonProcess::~DaemonProcess() {
  for (pid_t p : {pid_, predecessor_}) {
    if (p > 0) {
      kill(p, SIGKILL);
      waitpid(p, nullptr, 0);
    }
  }
}

void DaemonProcess::Signal(int signal) {
  if (pid_ > 0) kill(pid_, signal);
}

absl::StatusOr<int> DaemonProcess::WaitExit(absl::Duration timeout) {
  auto code = WaitPid(pid_, timeout);
  if (code.ok()) pid_ = -1;
  return code;
}

namespace {
// $KVD_TEST_BIN_DIR/<name> when set (the GPU bundle runs the tests far from the build tree), else
// the path CMake compiled in.
std::string TestBinary(const char* name, const char* built) {
  const char* dir = std::getenv("KVD_TEST_BIN_DIR");
  return dir != nullptr && *dir != '\0' ? absl::StrCat(dir, "/", name) : built;
}
}  // namespace

std::string KvdBinary() { return TestBinary("kvd", KVD_BINARY); }
std::string ExampleWorkerBinary() { return TestBinary("kvd_example_worker", KVD_EXAMPLE_WORKER); }
std::string StepWorkerBinary() { return TestBinary("kvd_step_worker", KVD_STEP_WORKER); }

ProcessResult RunWorker(const std::vector<std::string>& args, absl::Duration timeout) {
  return RunProcess(ExampleWorkerBinary(), args, timeout);
}

ProcessResult RunProcess(const std::string& binary, const std::vector<std::string>& args,
                         absl::Duration timeout) {
  int fds[2];
  ProcessResult r;
  if (pipe2(fds, O_CLOEXEC) != 0) return r;
  pid_t pid = Spawn(binary, args, fds[1], /*also_stderr=*/true);
  close(fds[1]);
  const absl::Time deadline = absl::Now() + timeout;
  char buf[4096];
  for (;;) {
    pollfd p{fds[0], POLLIN, 0};
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0) break;
    if (poll(&p, 1, static_cast<int>(left)) <= 0) break;
    ssize_t n = read(fds[0], buf, sizeof(buf));
    if (n <= 0) break;
    r.out.append(buf, n);
  }
  close(fds[0]);
  auto code = WaitPid(pid, absl::Seconds(5));
  if (!code.ok()) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
  }
  r.exit_code = code.ok() ? *code : -1;
  return r;
}

WorkerProcess::WorkerProcess(const std::vector<std::string>& args, const std::string& binary) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return;
  pid_ = Spawn(binary.empty() ? ExampleWorkerBinary() : binary, args, fds[1]);
  close(fds[1]);
  out_fd_ = fds[0];
}

WorkerProcess::~WorkerProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (out_fd_ >= 0) close(out_fd_);
}

absl::StatusOr<std::string> WorkerProcess::WaitForLine(const std::string& prefix, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    size_t nl;
    while ((nl = buffer_.find('\n')) != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      if (line.rfind(prefix, 0) == 0) return line;
    }
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0) return absl::DeadlineExceededError("no line with prefix " + prefix);
    pollfd p{out_fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    char buf[1024];
    ssize_t n = read(out_fd_, buf, sizeof(buf));
    if (n <= 0) return absl::UnavailableError("worker output ended");
    buffer_.append(buf, n);
  }
}

bool WorkerProcess::Running() {
  if (pid_ <= 0) return false;
  int status;
  if (waitpid(pid_, &status, WNOHANG) == pid_) {
    pid_ = -1;
    return false;
  }
  return true;
}

void WorkerProcess::Signal(int signal) {
  if (pid_ > 0) kill(pid_, signal);
}

void WorkerProcess::Kill(int signal) {
  if (pid_ <= 0) return;
  kill(pid_, signal);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

int64_t JsonInt(const std::string& json, const std::string& key) {
  const std::string k = "\"" + key + "\": ";
  size_t at = json.find(k);
  if (at == std::string::npos) return -1;
  size_t end = json.find_first_of(",}", at + k.size());
  int64_t v = -1;
  (void)absl::SimpleAtoi(json.substr(at + k.size(), end - at - k.size()), &v);
  return v;
}

bool JsonBool(const std::string& json, const std::string& key) {
  return json.find("\"" + key + "\": true") != std::string::npos;
}

absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return absl::UnavailableError("cannot connect to the metrics port");
  }
  // A server going away mid-request must not hang the test.
  const timeval limit{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));
  const std::string req = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  (void)!write(fd, req.data(), req.size());
  std::string resp;
  char buf[8192];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) resp.append(buf, n);
  close(fd);
  size_t body = resp.find("\r\n\r\n");
  if (body == std::string::npos) return absl::InternalError("malformed HTTP response");
  return resp.substr(body + 4);
}

std::vector<Token> Range(Token start, int n) {
  std::vector<Token> t;
  for (int i = 0; i < n; ++i) t.push_back(start + i);
  return t;
}

RequestSpec PoolRequest(const std::string& id, std::vector<Token> prompt, int64_t max_new,
                        const std::string& pool) {
  RequestSpec s;
  s.id = RequestId(id);
  s.ns.pool = pool;
  s.prompt = std::move(prompt);
  s.max_new_tokens = max_new;
  return s;
}

std::string SmallPoolConfig(int capacity_blocks, const std::string& extra) {
  return absl::StrCat(
      "pools:\n"
      "  - name: default\n"
      "    block_tokens: 4\n"
      "    num_layers: 2\n"
      "    bytes_per_token_per_layer: 16\n"
      "    capacity_blocks: ", capacity_blocks, "\n"
      "    max_model_len: 200\n",
      extra);
}

}  // namespace kvd::testing
