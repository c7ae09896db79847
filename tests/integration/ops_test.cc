// Operations: health, reflection, configuration errors, --print-config, kvdctl, exact metrics.
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <filesystem>
#include <fstream>

#include <catch2/catch.hpp>

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "gpu/unique_fd.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kvd/v1/kvd.pb.h"
#include "reflection.grpc.pb.h"
#include "tests/integration/harness.h"

namespace kvd {
namespace {

using namespace kvd::testing;

grpc::health::v1::HealthCheckResponse::ServingStatus Health(const DaemonProcess& d) {
  auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp);
  return s.ok() ? resp.status() : grpc::health::v1::HealthCheckResponse::UNKNOWN;
}

TEST_CASE("Health is SERVING, then NOT_SERVING while draining; a second SIGTERM stops at once", "[integration][ops]") {
  DaemonProcess d(SmallPoolConfig(), {"--drain-timeout=60"});
  REQUIRE(Health(d) == grpc::health::v1::HealthCheckResponse::SERVING);
  auto c = client::Client::Connect({.target = d.target()});
  REQUIRE(c.ok());
  RequestSpec s = PoolRequest("held", {1, 2, 3});
  auto req = (*c)->Start(s);
  REQUIRE(req.ok());
  d.Signal(SIGTERM);
  auto status = Health(d);
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (status != grpc::health::v1::HealthCheckResponse::NOT_SERVING && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
    status = Health(d);
  }
  REQUIRE(status == grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  // A SIGTERM drain is the way out: no operator command undoes it.
  ProcessResult undrain = RunProcess(KVDCTL_BINARY, {"--target=" + d.target(), "undrain"});
  REQUIRE(undrain.exit_code != 0);
  REQUIRE(undrain.out.find("shutting down (SIGTERM)") != std::string::npos);
  REQUIRE(Health(d) == grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  // The request is still live and the drain deadline is a minute away: a second signal ends it now.
  d.Signal(SIGTERM);
  auto code = d.WaitExit(absl::Seconds(10));
  REQUIRE(code.ok());
  REQUIRE(*code == 0);
  // The daemon is gone: the request's and the client's clean-up calls fail fast, harmlessly.
  req->reset();
  c->reset();
}

TEST_CASE("Server reflection lists the kvd service", "[integration][ops]") {
  DaemonProcess d(SmallPoolConfig());
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(
      grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  auto stream = stub->ServerReflectionInfo(&ctx);
  grpc::reflection::v1alpha::ServerReflectionRequest req;
  req.set_list_services("");
  REQUIRE(stream->Write(req));
  grpc::reflection::v1alpha::ServerReflectionResponse resp;
  REQUIRE(stream->Read(&resp));
  std::vector<std::string> names;
  for (const auto& s : resp.list_services_response().service()) names.push_back(s.name());
  INFO(absl::StrJoin(names, ","));
  REQUIRE(std::find(names.begin(), names.end(), "kvd.v1.Kvd") != names.end());
  stream->WritesDone();
  stream->Finish();
}

TEST_CASE("The systemd watchdog hears from kvd while it serves, and not once its socket is gone",
          "[integration][ops]") {
  TempDir dir;
  const std::string notify = dir.path() + "/notify";
  auto sock = UniqueFd(socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", notify.c_str());
  REQUIRE(bind(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  const timeval tv{0, 100'000};
  setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  // What systemd would set: notifications go to our socket; a watchdog of 0.6 s (kvd probes and
  // pings every 0.2 s).
  setenv("NOTIFY_SOCKET", notify.c_str(), 1);
  setenv("WATCHDOG_USEC", "600000", 1);
  DaemonProcess d(SmallPoolConfig());
  unsetenv("NOTIFY_SOCKET");
  unsetenv("WATCHDOG_USEC");
  // Counts WATCHDOG=1 messages received within `window`.
  const auto pings = [&](absl::Duration window) {
    int n = 0;
    const absl::Time end = absl::Now() + window;
    char buf[512];
    while (absl::Now() < end) {
      const ssize_t got = recv(sock.get(), buf, sizeof(buf) - 1, 0);
      if (got > 0 && std::string(buf, static_cast<size_t>(got)).find("WATCHDOG=1") != std::string::npos) ++n;
    }
    return n;
  };
  REQUIRE(pings(absl::Seconds(3)) >= 2);
  // An operator's slip: the socket file is deleted. kvd can no longer be reached; the watchdog
  // must stop hearing from it (systemd would restart it) and the log says why.
  REQUIRE(std::filesystem::remove(d.target().substr(7)));
  pings(absl::Seconds(2));  // probes already under way may still succeed
  REQUIRE(pings(absl::Seconds(2)) == 0);
  REQUIRE(d.Log().find("watchdog: UNAVAILABLE") != std::string::npos);
}

TEST_CASE("Every configuration error exits non-zero naming the field", "[integration][ops]") {
  TempDir dir;
  struct Case {
    std::string yaml;
    std::string named;
  } cases[] = {
      {"pools:\n  - name: p\n    block_tokens: 0\n", "block_tokens"},
      {"pools:\n  - name: p\n    num_layers: -1\n", "num_layers"},
      {"pools:\n  - name: p\n    capacity_blocks: 0\n", "capacity_blocks"},
      {"pools:\n  - name: p\n    max_model_len: 2\n", "max_model_len"},
      {"pools:\n  - name: p\n    layout: diagonal\n", "layout"},
      {"pools:\n  - name: p\n    allocator: malloc\n", "allocator must be ipc or vmm"},
      {"backend: host\npools:\n  - name: p\n    allocator: vmm\n", "allocator vmm is CUDA memory"},
      {"pools:\n  - name: p\n  - name: p\n", "duplicate pool name"},
      {"pools:\n  - name: p\n    shards: 2\n    devices: [0]\n", "devices"},
      {"backend: tpu\n", "backend"},
      {"lease_ttl_s: 0\n", "lease_ttl_s"},
      {"log_level: loud\n", "log_level"},
      {"max_message_bytes: 10\n", "max_message_bytes"},
      {"boundary_low_watermark: 0.99\n", "must satisfy 0 < low <= high <= 1, not low 0.99, high 0.9"},
      {"budget_bytes: 1Gb\n", "budget_bytes: '1Gb' is ambiguous: Gb reads as gigabits"},
      {"budget_bytes: 1GiB\n", "budget_bytes 1073741824 is more than the pools hold together (138412032 bytes)"},
      {"demote_reserve: 0.9\n", "demote_reserve must be in [0, 0.5], not 0.9"},
      {"demote_reserve: 0.1\n", "demote_reserve needs a tier to demote into"},
      {"budget_bytes: -5\n", "budget_bytes"},
      {"session_ttl_s: -1\n", "session_ttl_s"},
      {"event_buffer: 0\n", "event_buffer"},
      {"eviction_policy: lfu\n", "eviction_policy must be lru, slru or horizon, not 'lfu'"},
      {"eviction_policy: horizon\nhorizon_margin: 0.5\n", "horizon_margin must be in [1, 10], not 0.5"},
      {"horizon_probation: 0\n", "horizon_probation and horizon_main must be in (0, 64]"},
      {"colour: blue\n", "unknown key 'colour'"},
      {"pools: [\n", "config"},
      {"lease_ttl_s: soon\n", "lease_ttl_s"},
      {"tiers:\n  redis_url: http://cache:6379\n", "tiers.redis_url"},
      {"tiers:\n  redis_url: redis://127.0.0.1:6379\n  redis_ttl_s: 0\n", "redis_ttl_s"},
      {"router_events:\n  replay_endpoint: ipc:///tmp/kvd-replay\n", "router_events.replay_endpoint"},
      {"router_events:\n  colour: blue\n", "unknown key 'colour'"},
      {"router_events:\n  endpoint: bogus://nowhere\n", "router_events.endpoint bogus://nowhere"},
      // Strict at every level, with the value and the allowed forms named (config_values.h).
      {"pools:\n  - name: p\n    capacity_block: 1000\n", "pools[0]: unknown key 'capacity_block'"},
      {"tiers:\n  colour: blue\n", "tiers: unknown key 'colour'"},
      {"", "is empty: expected a YAML map"},
      {"# only a comment\n", "is empty: expected a YAML map"},
      {"tiers:\n  host_bytes: -5\n", "tiers: host_bytes: '-5' is not a size: expected bytes"},
      {"tiers:\n  host_bytes: 8 gigs\n", "host_bytes: '8 gigs' is not a size"},
      {"budget_bytes: [1, 2]\n", "budget_bytes: expected a single value"},
      {"lease_ttl_s: -3\n", "lease_ttl_s must be > 0, not -3s"},
      {"drain_timeout_s: 5 minutes\n", "drain_timeout_s: '5 minutes' is not a duration"},
      {"listen: kvd.sock\n", "listen: 'kvd.sock' is neither"},
      {"pools:\n  - name: llama@8b\n", "pool 'llama@8b': the name may hold printable ASCII except spaces and '@'"},
      {"pools:\n  - name: \"llama 8b\"\n", "pool 'llama 8b': the name may hold"},
      // A model fingerprint: a misspelt key, a space, a control byte, a novel are each named.
      {"pools:\n  - name: p\n    model_fingerprnt: llama@v1\n", "pools[0]: unknown key 'model_fingerprnt'"},
      {"pools:\n  - name: p\n    model_fingerprint: \"llama v1\"\n",
       "pools[0] (pool 'p'): model_fingerprint has byte 0x20 at offset 5; only printable ASCII without spaces"},
      {"pools:\n  - name: p\n    model_fingerprint: \"llama\\tv1\"\n", "model_fingerprint has byte 0x09 at offset 5"},
      {"pools:\n  - name: p\n    model_fingerprint: " + std::string(300, 'x') + "\n",
       "(pool 'p'): model_fingerprint is 300 bytes; at most 256 are allowed"},
      // Larger than any machine: named with its size before anything is allocated.
      {"pools:\n  - name: huge\n    capacity_blocks: 2000000000\n", "pool 'huge' needs"},
      {"max_message_bytes: 3000000000\n", "max_message_bytes must be between 4096 and 2147483647"},
  };
  for (const Case& c : cases) {
    const std::string path = dir.path() + "/bad.yaml";
    std::ofstream(path) << c.yaml;
    ProcessResult r = RunProcess(KvdBinary(), {"--config=" + path, "--listen=unix://" + dir.path() + "/k.sock"},
                                 absl::Seconds(10));
    INFO(c.yaml << " -> " << r.out);
    REQUIRE(r.exit_code != 0);
    REQUIRE(r.out.find(c.named) != std::string::npos);
  }
  REQUIRE_FALSE(std::filesystem::exists(dir.path() + "/k.sock"));  // nothing was bound
}

TEST_CASE("A second kvd on a live daemon's socket refuses to start and names --takeover; a dead one's is replaced",
          "[integration][ops]") {
  DaemonProcess a(SmallPoolConfig(32));
  TempDir dir;
  const std::string config = dir.path() + "/kvd.yaml";
  std::ofstream(config) << SmallPoolConfig(32);
  const std::string socket = a.target().substr(7);
  ProcessResult second = RunProcess(KvdBinary(), {"--config=" + config, "--listen=" + a.target(), "--metrics-listen=off"},
                                    absl::Seconds(20));
  INFO(second.out);
  REQUIRE(second.exit_code != 0);
  REQUIRE(absl::StrContains(second.out, socket));
  REQUIRE(absl::StrContains(second.out, "--takeover"));
  // The first still serves on both of its sockets, which are where they were.
  REQUIRE(std::filesystem::is_socket(socket));
  REQUIRE(std::filesystem::is_socket(a.side_socket()));
  ProcessResult w = RunWorker({"--target", a.target(), "--id", "still-there", "--prompt-range", "0:9"});
  INFO(w.out);
  REQUIRE(w.exit_code == 0);
  // Something that is not a socket is never replaced.
  const std::string file = dir.path() + "/not-a-socket";
  std::ofstream(file) << "operator's notes\n";
  ProcessResult onto_file =
      RunProcess(KvdBinary(), {"--config=" + config, "--listen=unix://" + file, "--metrics-listen=off"}, absl::Seconds(20));
  INFO(onto_file.out);
  REQUIRE(onto_file.exit_code != 0);
  REQUIRE(absl::StrContains(onto_file.out, "not a socket"));
  REQUIRE(std::filesystem::is_regular_file(file));
  // A SIGKILLed daemon's socket files are stale: its restart replaces them and serves.
  REQUIRE(a.Restart());
  ProcessResult after = RunWorker({"--target", a.target(), "--id", "after-restart", "--prompt-range", "0:9"});
  INFO(after.out);
  REQUIRE(after.exit_code == 0);
}

TEST_CASE("Metric labels name configured pools only: made-up pool names mint no series", "[integration][ops]") {
  DaemonProcess d(SmallPoolConfig(32));
  for (int i = 0; i < 5; ++i) {
    ProcessResult r = RunWorker({"--target=" + d.target(), "--pool=made-up-" + std::to_string(i),
                                 "--id=x" + std::to_string(i), "--prompt-range=0:9"});
    REQUIRE(r.exit_code != 0);  // NOT_FOUND
  }
  REQUIRE(RunWorker({"--target=" + d.target(), "--id=real", "--prompt-range=0:9"}).exit_code == 0);
  absl::StatusOr<std::string> body = HttpGet(d.metrics_port(), "/metrics");
  REQUIRE(body.ok());
  REQUIRE_FALSE(absl::StrContains(*body, "made-up-"));
  REQUIRE(absl::StrContains(*body, "kvd_admission_wait_seconds_count{outcome=\"admitted\",pool=\"default\"}"));
}

TEST_CASE("Flags are parsed and checked exactly like the same keys in the file", "[integration][ops]") {
  TempDir dir;
  const std::string listen = "--listen=unix://" + dir.path() + "/k.sock";
  const auto run = [&](std::string yaml, std::vector<std::string> flags) {
    const std::string path = dir.path() + "/c.yaml";
    std::ofstream(path) << SmallPoolConfig(32, yaml);
    flags.insert(flags.begin(), "--config=" + path);
    ProcessResult r = RunProcess(KvdBinary(), flags, absl::Seconds(10));
    INFO(absl::StrJoin(flags, " ") << " -> " << r.out);
    REQUIRE(r.exit_code == 2);
    return r.out;
  };
  // The same mistake by flag and by key: the same message after the place it was made.
  const auto after = [](const std::string& out, const std::string& from) {
    const size_t at = out.find(from);
    REQUIRE(at != std::string::npos);
    return out.substr(at, out.find('\n', at) - at);
  };
  REQUIRE(after(run("lease_ttl_s: -3\n", {listen}), "lease_ttl_s must") ==
          after(run("", {listen, "--lease-ttl=-3"}), "lease_ttl_s must"));
  REQUIRE(after(run("drain_timeout_s: -1\n", {listen}), "drain_timeout_s must") ==
          after(run("", {listen, "--drain-timeout=-1"}), "drain_timeout_s must"));
  REQUIRE(after(run("tiers:\n  host_bytes: -5\n", {listen}), "'-5' is not a size") ==
          after(run("", {listen, "--host-tier-bytes=-5"}), "'-5' is not a size"));
  REQUIRE(after(run("max_message_bytes: 10\n", {listen}), "max_message_bytes must") ==
          after(run("", {listen, "--max-message-bytes=10"}), "max_message_bytes must"));
  REQUIRE(run("", {"--listen=kvd.sock"}).find("--listen: 'kvd.sock' is neither") != std::string::npos);
  REQUIRE(run("", {listen, "--lease-ttl=soon"}).find("--lease-ttl: 'soon' is not a duration") != std::string::npos);
  REQUIRE_FALSE(std::filesystem::exists(dir.path() + "/k.sock"));  // nothing was bound

  // Units and the Unix spellings are accepted, from the file and from flags alike.
  const std::string path = dir.path() + "/units.yaml";
  std::ofstream(path) << SmallPoolConfig(8192, "budget_bytes: 1MiB\nlease_ttl_s: 1m\ntiers:\n  host_bytes: 8GiB\n");
  ProcessResult a = RunProcess(KvdBinary(), {"--config=" + path, "--print-config", "--listen=" + dir.path() + "/x.sock",
                                             "--drain-timeout=2m", "--max-message-bytes=32MiB"});
  INFO(a.out);
  REQUIRE(a.exit_code == 0);
  REQUIRE(a.out.find("budget_bytes: 1048576\n") != std::string::npos);
  REQUIRE(a.out.find("lease_ttl_s: 60\n") != std::string::npos);
  REQUIRE(a.out.find("host_bytes: 8589934592\n") != std::string::npos);
  REQUIRE(a.out.find("drain_timeout_s: 120\n") != std::string::npos);
  REQUIRE(a.out.find("max_message_bytes: 33554432\n") != std::string::npos);
  REQUIRE(a.out.find("listen: unix://" + dir.path() + "/x.sock\n") != std::string::npos);
  REQUIRE(a.out.find("side_socket: " + dir.path() + "/x.sock.slabs\n") != std::string::npos);

  // And a daemon given a bare socket path serves on it.
  DaemonProcess d(SmallPoolConfig(), {"--listen=" + dir.path() + "/bare.sock"});
  REQUIRE(d.target() == "unix://" + dir.path() + "/bare.sock");
  REQUIRE(Health(d) == grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_CASE("--print-config round-trips", "[integration][ops]") {
  TempDir dir;
  const std::string first = dir.path() + "/first.yaml";
  std::ofstream(first) << SmallPoolConfig(32, "session_ttl_s: 42\nbudget_bytes: 2048\n");
  ProcessResult a = RunProcess(KvdBinary(), {"--config=" + first, "--print-config", "--listen=unix:///tmp/x.sock"});
  REQUIRE(a.exit_code == 0);
  REQUIRE(a.out.find("session_ttl_s: 42") != std::string::npos);
  REQUIRE(a.out.find("capacity_blocks: 32") != std::string::npos);
  const std::string second = dir.path() + "/second.yaml";
  std::ofstream(second) << a.out;
  ProcessResult b = RunProcess(KvdBinary(), {"--config=" + second, "--print-config"});
  REQUIRE(b.exit_code == 0);
  REQUIRE(b.out == a.out);
}

TEST_CASE("kvdctl reports what the daemon holds, as tables and as JSON", "[integration][ops]") {
  DaemonProcess d(SmallPoolConfig());
  REQUIRE(RunWorker({"--target=" + d.target(), "--id=a", "--prompt-range=0:10", "--session=chat"}).exit_code == 0);
  auto c = client::Client::Connect({.target = d.target()});
  REQUIRE(c.ok());
  RequestSpec s = PoolRequest("live-one", {1, 2, 3, 4, 5});
  auto req = (*c)->Start(s);
  REQUIRE(req.ok());
  auto ctl = [&](std::vector<std::string> args) {
    args.insert(args.begin(), "--target=" + d.target());
    ProcessResult r = RunProcess(KVDCTL_BINARY, args);
    INFO(r.out);
    REQUIRE(r.exit_code == 0);
    return r.out;
  };
  const std::string table = ctl({"status"});
  REQUIRE(table.find("live requests") != std::string::npos);
  REQUIRE(table.find("state                        serving") != std::string::npos);
  REQUIRE(table.find("pools                        default (") != std::string::npos);
  REQUIRE(ctl({"health"}).find("SERVING") != std::string::npos);
  REQUIRE(ctl({"pools"}).find("default") != std::string::npos);
  REQUIRE(ctl({"requests"}).find("live-one") != std::string::npos);
  REQUIRE(ctl({"sessions"}).find("chat") != std::string::npos);
  const std::string events = ctl({"events"});
  REQUIRE(events.find("1 stored pool=default") != std::string::npos);
  REQUIRE(events.find("2 stored pool=default") != std::string::npos);

  using google::protobuf::util::JsonStringToMessage;
  v1::ReportResponse report;
  REQUIRE(JsonStringToMessage(ctl({"--json", "status"}), &report).ok());
  REQUIRE(report.live_requests() == 1);
  REQUIRE(report.sessions() == 1);
  v1::ListHandlesResponse handles;
  REQUIRE(JsonStringToMessage(ctl({"--json", "requests"}), &handles).ok());
  REQUIRE(handles.handles(0).request_id() == "live-one");
  v1::ListSessionsResponse sessions;
  REQUIRE(JsonStringToMessage(ctl({"--json", "sessions"}), &sessions).ok());
  REQUIRE(sessions.sessions(0).session_id() == "chat");
  v1::ListPoolsResponse pools;
  REQUIRE(JsonStringToMessage(ctl({"--json", "pools"}), &pools).ok());
  REQUIRE(pools.pools(0).block_tokens() == 4);
  // Numbers are JSON numbers (protobuf's JSON quotes 64-bit ones) and keys are the hex the
  // tables print (not base64).
  REQUIRE(ctl({"--json", "status"}).find("\"live_requests\": 1,") != std::string::npos);
  std::vector<std::string> lines = absl::StrSplit(ctl({"--json", "events", "--after=1"}), '\n', absl::SkipEmpty());
  REQUIRE(lines.size() == 1);
  REQUIRE(lines[0].find("\"sequence\": 2,") != std::string::npos);
  const size_t key_at = events.find("2 stored pool=default");
  const size_t hex_at = events.find(" key=", key_at) + 5;
  const std::string key_hex = events.substr(hex_at, 32);
  REQUIRE(key_hex.find_first_not_of("0123456789abcdef") == std::string::npos);
  REQUIRE(lines[0].find("\"block_key\": \"" + key_hex + "\"") != std::string::npos);
  REQUIRE(lines[0].find("\"kind\": \"STORED\"") != std::string::npos);
  // gc without saying which blocks is refused before anything is evicted.
  ProcessResult bare_gc = RunProcess(KVDCTL_BINARY, {"--target=" + d.target(), "gc"});
  REQUIRE(bare_gc.exit_code == 2);
  REQUIRE(bare_gc.out.find("--max-idle=DURATION") != std::string::npos);
  REQUIRE(ctl({"gc", "--max-idle=10m"}).find("freed 0 blocks") != std::string::npos);
  v1::GcResponse gc;
  REQUIRE(JsonStringToMessage(ctl({"--json", "gc", "--all"}), &gc).ok());
  REQUIRE(gc.blocks_freed() == 0);  // the session protects a's prefix
  REQUIRE(ctl({"boundary"}).find("evicted 0 blocks") != std::string::npos);
  v1::DrainResponse drain;
  REQUIRE(JsonStringToMessage(ctl({"--json", "drain"}), &drain).ok());
  REQUIRE(drain.live_requests() == 1);
  RequestSpec late = s;
  late.id = RequestId("late");
  REQUIRE((*c)->Admit(late).status().code() == absl::StatusCode::kUnavailable);
  ProcessResult draining = RunProcess(KVDCTL_BINARY, {"--target=" + d.target(), "health"});
  REQUIRE(draining.exit_code == 1);
  REQUIRE(draining.out.find("NOT_SERVING") != std::string::npos);
  // status says so, as the operator watching a drain reads it, in both flag positions.
  REQUIRE(ctl({"status"}).find("draining (admits no new work)") != std::string::npos);
  REQUIRE(JsonStringToMessage(ctl({"status", "--json"}), &report).ok());
  REQUIRE(report.draining());
  // An operator's drain is undone by undrain (twice is harmless): serving and admitting again.
  REQUIRE(ctl({"undrain"}).find("admitting again; 1 requests live") != std::string::npos);
  REQUIRE(ctl({"undrain"}).find("admitting again") != std::string::npos);
  REQUIRE(ctl({"health"}).find("SERVING") != std::string::npos);
  REQUIRE((*c)->Admit(late).ok());
  REQUIRE(JsonStringToMessage(ctl({"status", "--json"}), &report).ok());
  REQUIRE_FALSE(report.draining());
  ProcessResult unreachable = RunProcess(KVDCTL_BINARY, {"--target=unix:///nonexistent/kvd.sock", "status"});
  REQUIRE(unreachable.exit_code == 1);
  // Errors name the gRPC status as the docs spell it, not its number.
  ProcessResult flush = RunProcess(KVDCTL_BINARY, {"--target=" + d.target(), "flush"});
  REQUIRE(flush.exit_code == 1);
  REQUIRE(flush.out.find("kvdctl: FAILED_PRECONDITION: kvd runs without tiers") != std::string::npos);
}

TEST_CASE("Metric counters match a scripted workload exactly", "[integration][ops]") {
  DaemonProcess d(SmallPoolConfig(64));
  const std::string t = "--target=" + d.target();
  // a: 10 prompt tokens miss; it generates 2 tokens of its own, so it publishes blocks [0..3],
  //    [4..7] and [8, 9, g1, g2].
  REQUIRE(RunWorker({t, "--id=a", "--prompt-range=0:10", "--gen=2"}).exit_code == 0);
  // b: 13 tokens; its first 8 hit, then [8..11] differs from a's third block: 5 miss, 1 new block.
  REQUIRE(RunWorker({t, "--id=b", "--prompt-range=0:13"}).exit_code == 0);
  // c: 5 unrelated tokens miss; 1 new block.
  REQUIRE(RunWorker({t, "--id=c", "--prompt-range=500:5"}).exit_code == 0);
  auto body = HttpGet(d.metrics_port(), "/metrics");
  REQUIRE(body.ok());
  INFO(*body);
  REQUIRE(MetricValue(*body, "kvd_lookups_total") == 3);
  REQUIRE(MetricValue(*body, "kvd_hit_tokens_total") == 8);
  REQUIRE(MetricValue(*body, "kvd_miss_tokens_total") == 10 + 5 + 5);
  REQUIRE(MetricValue(*body, "kvd_published_blocks_total") == 5);
  REQUIRE(MetricValue(*body, "kvd_admissions_total{result=\"admitted\"}") == 3);
  REQUIRE(MetricValue(*body, "kvd_rpc_latency_seconds_count{code=\"OK\",method=\"Start\"}") == 3);  // Admit + Acquire
  REQUIRE(MetricValue(*body, "kvd_rpc_latency_seconds_count{code=\"OK\",method=\"Extend\"}") == 2);
  REQUIRE(MetricValue(*body, "kvd_rpc_latency_seconds_count{code=\"OK\",method=\"Release\"}") == 3);
  REQUIRE(MetricValue(*body, "kvd_blocks{pool=\"default\",state=\"cached_evictable\"}") == 5);
  REQUIRE(MetricValue(*body, "kvd_blocks{pool=\"default\",state=\"free\"}") == 59);
  REQUIRE(MetricValue(*body, "kvd_bytes{pool=\"default\",tier=\"device\",state=\"cached_evictable\"}") == 5 * 128);
  // kvd_bytes states partition the pool: a stacked panel of them adds up to the total.
  double states = 0;
  for (const char* state : {"free", "owned", "cached_referenced", "cached_evictable"}) {
    states += MetricValue(*body, absl::StrCat("kvd_bytes{pool=\"default\",tier=\"device\",state=\"", state, "\"}"));
  }
  REQUIRE(states == MetricValue(*body, "kvd_bytes{pool=\"default\",tier=\"device\",state=\"total\"}"));
  REQUIRE(states == 64 * 128);
  // One admission-wait observation per Start (each admitted at once: in the 0 bucket).
  REQUIRE(MetricValue(*body, "kvd_admission_wait_seconds_count{outcome=\"admitted\",pool=\"default\"}") == 3);
  REQUIRE(MetricValue(*body, "kvd_admission_wait_seconds_bucket{outcome=\"admitted\",pool=\"default\",le=\"0\"}") == 3);
  REQUIRE(MetricValue(*body, "kvd_live_requests") == 0);
  REQUIRE(MetricValue(*body, "kvd_build_info{backend=\"host\",version=\"" KVD_VERSION "\"}") == 1);
}

TEST_CASE("kvd --version and kvdctl version name the build, the commit and the CUDA runtime",
          "[integration][ops][version]") {
  ProcessResult v = RunProcess(KvdBinary(), {"--version"});
  INFO(v.out);
  REQUIRE(v.exit_code == 0);
  REQUIRE(v.out.find("kvd " KVD_VERSION " (commit ") != std::string::npos);
  REQUIRE(v.out.find("CUDA runtime ") != std::string::npos);
  DaemonProcess d(SmallPoolConfig());
  ProcessResult ctl = RunProcess(KVDCTL_BINARY, {"--target=" + d.target(), "version"});
  INFO(ctl.out);
  REQUIRE(ctl.exit_code == 0);
  REQUIRE(ctl.out.find("kvdctl " KVD_VERSION " (commit ") != std::string::npos);
  REQUIRE(ctl.out.find("daemon: kvd " KVD_VERSION " (commit ") != std::string::npos);
  REQUIRE(ctl.out.find(", backend host") != std::string::npos);
  // No daemon: kvdctl still says what it is, and that nothing answers.
  ProcessResult alone = RunProcess(KVDCTL_BINARY, {"--target=unix://" + d.dir() + "/nothing.sock", "version"});
  REQUIRE(alone.exit_code == 0);
  REQUIRE(alone.out.find("daemon: not reachable") != std::string::npos);
  // --json before or after the command: one JSON object either way.
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--json", "version"},
                                               std::vector<std::string>{"version", "--json"}}) {
    std::vector<std::string> with_target = args;
    with_target.push_back("--target=" + d.target());
    ProcessResult j = RunProcess(KVDCTL_BINARY, with_target);
    INFO(j.out);
    REQUIRE(j.exit_code == 0);
    REQUIRE(j.out.find("{\"kvdctl\": \"kvdctl " KVD_VERSION " (commit ") == 0);
    REQUIRE(j.out.find("\"daemon\": \"kvd " KVD_VERSION) != std::string::npos);
  }
  ProcessResult alone_json = RunProcess(KVDCTL_BINARY, {"--json", "--target=unix://" + d.dir() + "/nothing.sock", "version"});
  REQUIRE(alone_json.out.find("\"daemon\": null") != std::string::npos);
}

}  // namespace
}  // namespace kvd
