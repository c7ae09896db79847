// The shared tier (G4) on a real Redis Cluster: three masters and three replicas started on
// loopback from Debian's redis-server and joined with `redis-cli --cluster create`. Daemons share
// prefixes whose keys spread over every master (bytes verified by the reader); a master SIGKILLed
// mid-workload fails no request and loses no byte once its replica is promoted; a slot range is
// resharded while lookups run, every lookup a full hit (ASK and MOVED followed).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <memory>
#include <thread>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/integration/harness.h"
#include "tests/integration/remote_fixture.h"
#include "tests/util/free_port.h"

namespace kvd {
namespace {

using namespace kvd::testing;

// A loopback port whose cluster bus port (+10000) is free too.
int ClusterPort(const std::vector<int>& taken) {
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int p = FreeLoopbackPort();
    if (p <= 0 || p > 55000 || std::find(taken.begin(), taken.end(), p) != taken.end()) continue;
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(p + 10000));
    const bool bus_free = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(fd);
    if (bus_free) return p;
  }
  FAIL("no free port pair for a cluster node");
  return -1;
}

class RedisCluster {
 public:
  struct Node {
    std::string id;
    int port = 0;
    bool master = false;
    std::string master_id;  // of a replica
  };

  RedisCluster() {
    std::vector<std::string> addrs;
    for (int i = 0; i < 6; ++i) {
      ports_.push_back(ClusterPort(ports_));
      Start(ports_.back());
      addrs.push_back(absl::StrCat("127.0.0.1:", ports_.back()));
    }
    std::vector<std::string> args = {"--cluster", "create"};
    args.insert(args.end(), addrs.begin(), addrs.end());
    for (const char* a : {"--cluster-replicas", "1", "--cluster-yes"}) args.push_back(a);
    ProcessResult created = RunProcess("/usr/bin/redis-cli", args, absl::Seconds(60));
    INFO(created.out);
    REQUIRE(created.exit_code == 0);
    WaitHealthy();
  }
  ~RedisCluster() {
    for (auto& [port, pid] : pids_) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }

  ProcessResult Cli(int port, std::vector<std::string> args, absl::Duration timeout = absl::Seconds(10)) const {
    std::vector<std::string> full = {"-h", "127.0.0.1", "-p", std::to_string(port)};
    full.insert(full.end(), args.begin(), args.end());
    return RunProcess("/usr/bin/redis-cli", full, timeout);
  }
  // The cluster as a live node sees it (CLUSTER NODES), failed nodes left out.
  std::vector<Node> Nodes() const {
    for (int port : ports_) {
      if (!pids_.contains(port)) continue;
      ProcessResult r = Cli(port, {"CLUSTER", "NODES"});
      if (r.exit_code != 0) continue;
      std::vector<Node> nodes;
      for (absl::string_view line : absl::StrSplit(r.out, '\n', absl::SkipEmpty())) {
        const std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
        if (f.size() < 8 || absl::StrContains(f[2], "fail")) continue;
        Node n;
        n.id = f[0];
        const std::string addr = f[1].substr(0, f[1].find('@'));
        n.port = std::stoi(addr.substr(addr.rfind(':') + 1));
        n.master = absl::StrContains(f[2], "master");
        n.master_id = f[3];
        nodes.push_back(n);
      }
      return nodes;
    }
    return {};
  }
  std::vector<Node> Masters() const {
    std::vector<Node> out;
    for (const Node& n : Nodes()) {
      if (n.master) out.push_back(n);
    }
    return out;
  }
  int64_t KeysOn(int port) const { return std::stoll(Cli(port, {"DBSIZE"}).out); }
  // Waits until every live node reports cluster_state:ok with three masters serving all slots.
  void WaitHealthy() const {
    for (int i = 0; i < 400; ++i) {
      bool ok = true;
      for (int port : ports_) {
        if (pids_.contains(port)) ok &= absl::StrContains(Cli(port, {"CLUSTER", "INFO"}).out, "cluster_state:ok");
      }
      if (ok && Masters().size() == 3) return;
      absl::SleepFor(absl::Milliseconds(100));
    }
    FAIL("the cluster did not become healthy");
  }
  void Kill(int port) {
    kill(pids_.at(port), SIGKILL);
    waitpid(pids_.at(port), nullptr, 0);
    pids_.erase(port);
  }
  // redis-cluster:// URL naming every node as a seed.
  std::string url() const {
    std::vector<std::string> seeds;
    for (int p : ports_) seeds.push_back(absl::StrCat("127.0.0.1:", p));
    return "redis-cluster://" + absl::StrJoin(seeds, ",");
  }

 private:
  void Start(int port) {
    const std::string dir = absl::StrCat(dir_.path(), "/", port);
    REQUIRE(RunProcess("/bin/mkdir", {"-p", dir}).exit_code == 0);
    const pid_t pid = fork();
    if (pid == 0) {
      execlp("redis-server", "redis-server", "--bind", "127.0.0.1", "--port", std::to_string(port).c_str(),
             "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000",
             "--save", "", "--appendonly", "no", "--dir", dir.c_str(), "--logfile", "redis.log",
             static_cast<char*>(nullptr));
      _exit(127);
    }
    pids_[port] = pid;
    for (int i = 0; i < 200; ++i) {
      if (Cli(port, {"PING"}).out.find("PONG") != std::string::npos) return;
      absl::SleepFor(absl::Milliseconds(25));
    }
    FAIL("redis-server (cluster mode) did not start on port " << port);
  }

  TempDir dir_;
  std::vector<int> ports_;
  std::map<int, pid_t> pids_;
};

// Publishes prompts [start + 100 k, 65 tokens) for k < n on `d` (16 blocks each, uploaded).
void Publish(const DaemonProcess& d, const std::string& tag, int start, int n) {
  const int64_t before = Metric(d, kUploaded);
  for (int k = 0; k < n; ++k) REQUIRE(JsonInt(Work(d, absl::StrCat(tag, k), start + 100 * k, 65).out, "cached_tokens") == 0);
  WaitForMetric(d, kUploaded, before + 16 * n);
}

// A cluster, and a daemon on it that published prompts [start + 100 k, 65 tokens) for k < n.
struct PublishedCluster {
  PublishedCluster(int start, int n) : a(Config(cluster.url(), disks.path() + "/a")) { Publish(a, "a", start, n); }
  // A new daemon on the cluster with its own empty disk.
  std::unique_ptr<DaemonProcess> Node(const std::string& name) const {
    return std::make_unique<DaemonProcess>(Config(cluster.url(), disks.path() + "/" + name));
  }
  RedisCluster cluster;
  TempDir disks;
  DaemonProcess a;
};

// Runs the same prompts on `d`: each a full hit (64 of 65 tokens), every reused byte checked.
void ExpectFullHits(const DaemonProcess& d, const std::string& tag, int start, int n, int first = 0) {
  for (int k = first; k < n; ++k) {
    ProcessResult r = Work(d, absl::StrCat(tag, k), start + 100 * k, 65);
    REQUIRE(JsonInt(r.out, "cached_tokens") == 64);
    REQUIRE(JsonInt(r.out, "verified_bytes") == 64 * 2 * 16);
  }
}

TEST_CASE("Daemons share prefixes through a Redis Cluster; keys spread over every master",
          "[integration][remote][cluster]") {
  PublishedCluster p(10000, 6);
  RedisCluster& cluster = p.cluster;
  for (const RedisCluster::Node& m : cluster.Masters()) {
    INFO("master on port " << m.port);
    REQUIRE(cluster.KeysOn(m.port) > 0);  // 96 keys hashed over 16,384 slots: every master has some
  }
  // Another node with an empty disk reads all of it back (the worker checks every byte).
  std::unique_ptr<DaemonProcess> b = p.Node("b");
  ExpectFullHits(*b, "b", 10000, 6);
  REQUIRE(Metric(*b, "kvd_promotions_total{from=\"remote\"}") == 96);
  REQUIRE(Metric(*b, "kvd_remote_errors_total") == 0);
  REQUIRE(KvdctlStatus(*b).find("redis-cluster://") != std::string::npos);

  // An operator's slip: one master named with redis://. Requests still work (the tier is
  // skipped), and the error says what to write instead.
  const int port = cluster.Masters().front().port;
  DaemonProcess slip(Config(absl::StrCat("redis://127.0.0.1:", port), p.disks.path() + "/slip"));
  for (int k = 0; k < 6; ++k) Work(slip, absl::StrCat("slip", k), 10000 + 100 * k, 65);
  REQUIRE(Metric(slip, "kvd_remote_errors_total") >= 1);
  REQUIRE(KvdctlStatus(slip).find("name the cluster with redis-cluster://") != std::string::npos);
}

TEST_CASE("A master killed mid-workload: no request fails, and its replica serves every byte",
          "[integration][remote][cluster]") {
  PublishedCluster p(20000, 6);
  RedisCluster& cluster = p.cluster;
  // Every master has handed its writes to its replica (WAIT), so a promotion loses nothing.
  for (const RedisCluster::Node& m : cluster.Masters()) {
    REQUIRE(cluster.Cli(m.port, {"WAIT", "1", "5000"}).out.find("1") != std::string::npos);
  }
  const RedisCluster::Node victim = cluster.Masters().front();
  REQUIRE(cluster.KeysOn(victim.port) > 0);

  // Workers keep running on a second daemon while the master dies and its replica takes over:
  // every request succeeds with no wrong byte (the tier is skipped while the slots have no master).
  std::unique_ptr<DaemonProcess> b = p.Node("b");
  cluster.Kill(victim.port);
  const absl::Time until = absl::Now() + absl::Seconds(4);
  for (int i = 0; absl::Now() < until; ++i) Work(*b, absl::StrCat("during", i), 30000 + 100 * (i % 20), 65);
  cluster.WaitHealthy();  // the replica is a master now
  REQUIRE(cluster.Masters().size() == 3);
  for (const RedisCluster::Node& m : cluster.Masters()) REQUIRE(m.port != victim.port);

  // A fresh node reads every block published before the kill, those of the dead master's slots
  // from the promoted replica (the slot map read again: the dead seed is skipped).
  std::unique_ptr<DaemonProcess> c = p.Node("c");
  ExpectFullHits(*c, "c", 20000, 6);
  REQUIRE(Metric(*c, "kvd_promotions_total{from=\"remote\"}") == 96);
}

TEST_CASE("Resharding a slot range while lookups run: every lookup a full hit, no wrong byte",
          "[integration][remote][cluster]") {
  PublishedCluster p(40000, 8);
  RedisCluster& cluster = p.cluster;
  std::vector<RedisCluster::Node> masters = cluster.Masters();
  REQUIRE(masters.size() == 3);
  // A daemon that read the slot map before the move.
  std::unique_ptr<DaemonProcess> before = p.Node("before");
  ExpectFullHits(*before, "before", 40000, 1);

  // Move 4,000 slots from one master to another in the background (redis-cli migrates the keys
  // slot by slot: ASK while a slot is migrating, MOVED once it is done).
  std::atomic<bool> done{false};
  ProcessResult reshard;
  std::thread mover([&] {
    reshard = cluster.Cli(masters[0].port,
                          {"--cluster", "reshard", absl::StrCat("127.0.0.1:", masters[0].port), "--cluster-from",
                           masters[0].id, "--cluster-to", masters[1].id, "--cluster-slots", "4000", "--cluster-yes"},
                          absl::Seconds(120));
    done = true;
  });
  // Fresh daemons (nothing cached on them) look the prompts up while the slots move.
  // Each reads the slot map at its first lookup and then follows whatever the move does to it.
  int lookups = 0;
  int64_t redirects = 0;
  while (!done || lookups < 8) {
    std::unique_ptr<DaemonProcess> node = p.Node(absl::StrCat("r", lookups));
    const DaemonProcess& r = *node;
    for (int k = 0; k < 8; ++k) {
      ProcessResult w = Work(r, absl::StrCat("r", lookups, "-", k), 40000 + 100 * k, 65);
      REQUIRE(JsonInt(w.out, "cached_tokens") == 64);
      absl::SleepFor(absl::Milliseconds(50));
    }
    REQUIRE(Metric(r, "kvd_remote_errors_total") == 0);
    redirects += Metric(r, "kvd_remote_cluster_redirects_total{kind=\"moved\"}") +
                 Metric(r, "kvd_remote_cluster_redirects_total{kind=\"ask\"}");
    ++lookups;
  }
  mover.join();
  INFO(reshard.out);
  REQUIRE(reshard.exit_code == 0);
  const int64_t after_first = cluster.KeysOn(masters[0].port);
  const int64_t after_second = cluster.KeysOn(masters[1].port);
  INFO("keys on the source " << after_first << ", on the target " << after_second);
  REQUIRE(after_second > after_first);  // the target took over most of the source's keys
  INFO(redirects << " redirections followed by " << lookups << " daemons during the move");
  // The daemon holding the old map meets MOVED for the slots that left, follows it, and reads all.
  ExpectFullHits(*before, "before", 40000, 8, /*first=*/1);
  REQUIRE(Metric(*before, "kvd_remote_cluster_redirects_total{kind=\"moved\"}") > 0);
  REQUIRE(Metric(*before, "kvd_remote_errors_total") == 0);
  // Once the move is over, a new daemon reads the new map and everything.
  ExpectFullHits(*p.Node("late"), "late", 40000, 8);
}

}  // namespace
}  // namespace kvd
