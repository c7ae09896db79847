// systemd's file-descriptor store keeps kvd's KV memory across a crash restart: kvd stores each
// slab's memfd (FDSTORE=1), a restarted kvd adopts the fds systemd passes back (LISTEN_FDS), and a
// worker that never stopped keeps its mappings — the bytes it wrote are still there.
//
// FdStoreSupervisor plays systemd, following the contracts of sd_pid_notify_with_fds(3) and
// sd_listen_fds_with_names(3): a datagram NOTIFY_SOCKET receiving "FDSTORE=1\nFDNAME=..." with
// the fds as SCM_RIGHTS ("FDSTOREREMOVE=1" drops a name), and on restart the stored fds as
// descriptors 3.. with LISTEN_FDS, LISTEN_PID (the new process's pid) and LISTEN_FDNAMES.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <map>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gpu/unique_fd.h"
#include "tests/integration/fence_fixture.h"
#include "tests/integration/harness.h"

namespace kvd {
namespace {

using namespace kvd::testing;

class FdStoreSupervisor {
 public:
  explicit FdStoreSupervisor(const std::string& config_yaml) {
    std::ofstream(dir_.path() + "/kvd.yaml") << config_yaml;
    notify_path_ = dir_.path() + "/notify";
    notify_ = UniqueFd(socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", notify_path_.c_str());
    REQUIRE(bind(notify_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
    int on = 1;
    setsockopt(notify_.get(), SOL_SOCKET, SO_PASSCRED, &on, sizeof(on));
  }
  ~FdStoreSupervisor() { Kill(); }

  std::string target() const { return "unix://" + dir_.path() + "/kvd.sock"; }
  std::string log() const {
    std::ifstream in(dir_.path() + "/kvd.log");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  std::map<std::string, UniqueFd>& store() { return store_; }

  // Starts kvd with the stored fds, as systemd restarts a unit; true once it serves.
  bool Start() {
    const std::string ready = dir_.path() + "/ready.json";
    unlink(ready.c_str());
    std::vector<std::string> names;
    std::vector<int> fds;
    for (auto& [name, fd] : store_) {
      names.push_back(name);
      fds.push_back(fd.get());
    }
    const std::string kvd = KvdBinary();
    std::vector<std::string> args = {kvd, "--config=" + dir_.path() + "/kvd.yaml",
                                     "--listen=" + target(), "--metrics-listen=off",
                                     "--ready-file=" + ready, "--log-level=info"};
    pid_ = fork();
    if (pid_ == 0) {
      const int log = open((dir_.path() + "/kvd.log").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0640);
      dup2(log, 1);
      dup2(log, 2);
      std::vector<int> high;
      for (int fd : fds) high.push_back(fcntl(fd, F_DUPFD, 100));
      for (size_t i = 0; i < high.size(); ++i) dup2(high[i], 3 + static_cast<int>(i));  // clears CLOEXEC
      setenv("NOTIFY_SOCKET", notify_path_.c_str(), 1);
      if (!fds.empty()) {
        setenv("LISTEN_FDS", std::to_string(fds.size()).c_str(), 1);
        setenv("LISTEN_PID", std::to_string(getpid()).c_str(), 1);
        setenv("LISTEN_FDNAMES", absl::StrJoin(names, ":").c_str(), 1);
      }
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(kvd.c_str(), argv.data());
      _exit(127);
    }
    for (int i = 0; i < 2000; ++i) {
      Receive();
      if (access(ready.c_str(), F_OK) == 0) {
        absl::SleepFor(absl::Milliseconds(50));  // FDSTORE is sent before READY; drain the socket
        Receive();
        return true;
      }
      if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  }

  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  // Reads every pending notification, keeping fds as systemd's store does.
  void Receive() {
    for (;;) {
      char buf[4096];
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 16) + CMSG_SPACE(sizeof(ucred))];
      iovec iov{buf, sizeof(buf) - 1};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      const ssize_t n = recvmsg(notify_.get(), &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
      if (n < 0) return;
      std::vector<UniqueFd> fds;
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
          const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
          const int* p = reinterpret_cast<const int*>(CMSG_DATA(c));
          for (size_t i = 0; i < count; ++i) fds.emplace_back(p[i]);
        }
      }
      std::map<std::string, std::string> kv;
      for (absl::string_view line : absl::StrSplit(absl::string_view(buf, n), '\n', absl::SkipEmpty())) {
        std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits('=', 1));
        if (parts.size() == 2) kv[parts[0]] = parts[1];
      }
      messages_.push_back(std::string(buf, n));
      if (kv["FDSTORE"] == "1" && fds.size() == 1) store_[kv["FDNAME"]] = std::move(fds[0]);
      if (kv["FDSTOREREMOVE"] == "1") store_.erase(kv["FDNAME"]);
    }
  }
  const std::vector<std::string>& messages() const { return messages_; }

 private:
  TempDir dir_;
  std::string notify_path_;
  UniqueFd notify_;
  pid_t pid_ = -1;
  std::map<std::string, UniqueFd> store_;
  std::vector<std::string> messages_;
};

TEST_CASE("Crash restarts under an fd store keep the KV memory a running worker has mapped",
          "[integration][restart][fdstore]") {
  // A short lease: each restart fences the kept memory for one TTL (docs/security.md).
  FdStoreSupervisor systemd(SmallPoolConfig(64, "lease_ttl_s: 4\n"));
  REQUIRE(systemd.Start());
  REQUIRE(systemd.store().size() == 1);  // one pool, one shard
  REQUIRE(absl::StartsWith(systemd.store().begin()->first, "kvdslab-0-0-"));
  WorkerProcess w({"--target=" + systemd.target(), "--id=kept", "--prompt-range=0:22",
                   "--requests=100000", "--pause-ms=20"});
  REQUIRE(w.WaitForLine("{", absl::Seconds(20)).ok());
  for (int i = 0; i < 5; ++i) {
    systemd.Kill();
    REQUIRE(systemd.Start());
    INFO(systemd.log());
    // The worker re-attaches and finds the bytes it wrote in its old mapping: no remap.
    absl::StatusOr<std::string> kept = w.WaitForLine("KEPT", absl::Seconds(20));
    INFO(kept.status().ToString());
    REQUIRE(kept.ok());
    REQUIRE(absl::StartsWith(*kept, "KEPT ok"));
    REQUIRE(w.WaitForLine("{", absl::Seconds(20)).ok());  // and its next request succeeds
  }
  REQUIRE(absl::StrContains(systemd.log(), "kept the KV memory of 1 slab(s)"));
  REQUIRE(w.Running());
}

// docs/security.md, "Leases and fencing": a crashed kvd said nothing about who was writing its
// memory, so the restarted one hands no block of it to anyone for a lease TTL, by which time every
// worker that could not renew has stopped writing by itself.
TEST_CASE("An asynchronous writer across an fd-store crash restart: nothing it may still write goes to another tenant",
          "[integration][restart][fdstore][fences]") {
  FdStoreSupervisor systemd(SmallPoolConfig(64, "lease_ttl_s: 3\n"));
  REQUIRE(systemd.Start());
  WorkerProcess a({"--target=" + systemd.target(), "--id=writer", "--prompt-range=0:64", "--async-writer-us=40000",
                   "--salt=tenant-a"});
  REQUIRE(a.WaitForLine("WRITING", absl::Seconds(20)).ok());
  absl::SleepFor(absl::Milliseconds(300));
  systemd.Kill();
  REQUIRE(systemd.Start());
  INFO(systemd.log());
  AnotherTenantReadsBackExactly(systemd.target());
  REQUIRE(absl::StrContains(systemd.log(), "fenced for the lease TTL"));
}

TEST_CASE("A stored fd that is not a fitting slab is never adopted", "[integration][restart][fdstore]") {
  FdStoreSupervisor systemd(SmallPoolConfig(64));
  REQUIRE(systemd.Start());
  REQUIRE(systemd.store().size() == 1);
  const std::string name = systemd.store().begin()->first;
  systemd.Kill();
  SECTION("a memfd of the wrong size under the right name") {
    UniqueFd wrong(memfd_create("impostor", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    REQUIRE(ftruncate(wrong.get(), 4096) == 0);
    systemd.store()[name] = std::move(wrong);
  }
  SECTION("an unsealed memfd of the right size (someone could shrink it under the workers)") {
    struct stat st {};
    REQUIRE(fstat(systemd.store()[name].get(), &st) == 0);
    UniqueFd unsealed(memfd_create("unsealed", MFD_CLOEXEC));
    REQUIRE(ftruncate(unsealed.get(), st.st_size) == 0);
    systemd.store()[name] = std::move(unsealed);
  }
  SECTION("a slab stored for another pool configuration") {
    systemd.store()["kvdslab-0-0-00000000deadbeef"] = std::move(systemd.store()[name]);
    systemd.store().erase(name);
  }
  REQUIRE(systemd.Start());
  INFO(systemd.log());
  REQUIRE_FALSE(absl::StrContains(systemd.log(), "kept the KV memory"));
  // It serves on fresh memory, byte for byte.
  ProcessResult r = RunWorker({"--target=" + systemd.target(), "--id=a", "--prompt-range=0:22"});
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  REQUIRE(JsonInt(r.out, "mismatches") == 0);
}

}  // namespace
}  // namespace kvd
