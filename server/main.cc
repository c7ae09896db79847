// kvd: flags, config file and environment -> Options -> Daemon; runs until SIGTERM or SIGINT,
// then drains (new work gets UNAVAILABLE, running requests may finish) and exits 0.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <thread>

#include <CLI/CLI.hpp>
#if KVD_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "server/config_values.h"
#include "server/daemon.h"
#include "server/build_info.h"
#include "server/store/remote_tier.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace {

// Tells systemd (Type=notify) about readiness and shutdown; a no-op outside systemd.
void NotifySystemd(const char* state) {
#if KVD_HAVE_SYSTEMD
  sd_notify(0, state);
#else
  (void)state;
#endif
}

// A third of the systemd watchdog's interval (WATCHDOG_USEC), or zero when it is off.
absl::Duration WatchdogPeriod() {
#if KVD_HAVE_SYSTEMD
  uint64_t usec = 0;
  if (sd_watchdog_enabled(0, &usec) > 0 && usec > 0) return absl::Microseconds(static_cast<int64_t>(usec / 3));
#endif
  return absl::ZeroDuration();
}

void WriteReadyFile(const std::string& path, const kvd::Daemon& d) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << "{\"grpc\": \"" << d.grpc_address() << "\", \"side_socket\": \"" << d.side_socket()
        << "\", \"metrics_port\": " << d.metrics_port() << ", \"transfer\": \"" << d.transfer_address()
        << "\", \"pid\": " << getpid() << "}\n";
  }
  std::rename(tmp.c_str(), path.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  CLI::App app{"kvd: the node's KV-cache daemon"};
  std::string config, listen, side_socket, metrics_listen, backend, ready_file, log_level;
  // Sizes, durations and addresses stay text here: config_values.h parses them exactly as it
  // parses the same keys in the YAML file, and Validate() checks their ranges for both.
  std::string max_message_bytes, lease_ttl, drain_timeout;
  app.add_option("--config", config, "YAML config file (pools, budget, policies)")->envname("KVD_CONFIG");
  app.add_option("--listen", listen, "gRPC address: unix:///path or HOST:PORT")->envname("KVD_LISTEN");
  app.add_option("--side-socket", side_socket, "Unix socket passing slab fds (default: <listen>.slabs)");
  app.add_option("--metrics-listen", metrics_listen, "HOST:PORT for /metrics (port 0 picks); off disables")
      ->envname("KVD_METRICS_LISTEN");
  app.add_option("--backend", backend, "memory backend: host, cuda or auto")->envname("KVD_BACKEND");
  app.add_option("--ready-file", ready_file, "write a JSON file with the bound addresses once serving");
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error")->envname("KVD_LOG_LEVEL");
  app.add_option("--max-message-bytes", max_message_bytes, "largest gRPC message accepted (e.g. 64MiB)");
  app.add_option("--lease-ttl", lease_ttl, "time without heartbeat before a worker is dead (seconds, or e.g. 10s)");
  app.add_option("--drain-timeout", drain_timeout, "time running requests get on SIGTERM (seconds, or e.g. 30s)");
  std::string tls_cert, tls_key, tls_client_ca;
  app.add_option("--tls-cert", tls_cert, "PEM certificate chain for a TCP listen address");
  app.add_option("--tls-key", tls_key, "PEM private key for --tls-cert");
  app.add_option("--tls-client-ca", tls_client_ca, "PEM CA: require client certificates it signed");
  std::vector<int64_t> allowed_uids, allowed_gids;
  app.add_option("--allowed-uids", allowed_uids, "uids allowed besides root and kvd's user (comma-separated)")
      ->delimiter(',');
  app.add_option("--allowed-gids", allowed_gids, "gids allowed (primary or supplementary; comma-separated)")
      ->delimiter(',');
  std::string socket_group;
  app.add_option("--socket-group", socket_group, "group owning the Unix sockets (workers join it)")
      ->envname("KVD_SOCKET_GROUP");
  std::string disk_dir;
  std::string host_tier_bytes;
  app.add_option("--disk-dir", disk_dir, "directory of the disk tier (G3); enables flush and warm restart")
      ->envname("KVD_DISK_DIR");
  app.add_option("--host-tier-bytes", host_tier_bytes, "host RAM for the host tier (G2), e.g. 8GiB")
      ->envname("KVD_HOST_TIER_BYTES");
  std::string redis_url;
  app.add_option("--redis-url", redis_url, "shared Redis/Valkey tier (G4): redis://host:port[/db] or unix:///path")
      ->envname("KVD_REDIS_URL");
  std::string router_events, router_replay;
  app.add_option("--router-events", router_events, "ZMQ endpoint for router KV events (e.g. tcp://*:5557)")
      ->envname("KVD_ROUTER_EVENTS");
  app.add_option("--router-replay", router_replay, "ZMQ endpoint of the router events' replay socket")
      ->envname("KVD_ROUTER_REPLAY");
  app.set_version_flag("--version", kvd::BuildInfo());
  bool takeover = false;
  app.add_flag("--takeover", takeover,
               "take over from the kvd serving this socket (its sockets, memory and index: a hot handoff); "
               "start afresh when none serves");
  std::string after_handoff = "exit";
  app.add_option("--after-handoff", after_handoff,
                 "once a successor took over: exit, or wait for SIGTERM (under a supervisor that restarts exits)")
      ->check(CLI::IsMember({"exit", "wait"}));
  bool print_config = false;
  app.add_flag("--print-config", print_config, "print the effective configuration as YAML and exit");
  CLI11_PARSE(app, argc, argv);

  kvd::Options options;
  if (!config.empty()) {
    absl::Status s = kvd::LoadConfigFile(config, &options);
    if (!s.ok()) {
      std::cerr << "kvd: " << s.message() << "\n";
      return 2;
    }
  }
  // Flags and environment override the file. A flag given as text goes through the parser of
  // the same key in the file (config_values.h); the first mistake is reported, one line, exit 2.
  absl::Status flag_error;
  const auto set_parsed = [&flag_error](const std::string& text, absl::string_view flag, auto parse, auto* out) {
    if (text.empty() || !flag_error.ok()) return;
    auto parsed = parse(flag, text);
    if (parsed.ok()) {
      *out = *std::move(parsed);
    } else {
      flag_error = parsed.status();
    }
  };
  set_parsed(listen, "--listen", kvd::NormalizeListen, &options.server.listen);
  set_parsed(max_message_bytes, "--max-message-bytes", kvd::ParseSize, &options.server.max_message_bytes);
  set_parsed(lease_ttl, "--lease-ttl", kvd::ParseDurationValue, &options.server.lease_ttl);
  set_parsed(drain_timeout, "--drain-timeout", kvd::ParseDurationValue, &options.server.drain_timeout);
  set_parsed(host_tier_bytes, "--host-tier-bytes", kvd::ParseSize, &options.tiers.host_bytes);
  if (!flag_error.ok()) {
    std::cerr << "kvd: invalid configuration: " << flag_error.message() << "\n";
    return 2;
  }
  if (!side_socket.empty()) options.server.side_socket = side_socket;
  if (app.count("--metrics-listen") > 0 || std::getenv("KVD_METRICS_LISTEN") != nullptr) {
    options.server.metrics_listen = metrics_listen == "off" ? "" : metrics_listen;
  }
  if (!backend.empty()) options.server.backend = backend;
  if (!ready_file.empty()) options.server.ready_file = ready_file;
  if (!log_level.empty()) options.server.log_level = log_level;
  if (!disk_dir.empty()) options.tiers.disk_dir = disk_dir;
  if (!tls_cert.empty()) options.server.tls_cert_file = tls_cert;
  if (!allowed_uids.empty()) options.server.allowed_uids = allowed_uids;
  if (!socket_group.empty()) options.server.socket_group = socket_group;
  if (!allowed_gids.empty()) options.server.allowed_gids = allowed_gids;
  if (!tls_key.empty()) options.server.tls_key_file = tls_key;
  if (!tls_client_ca.empty()) options.server.tls_client_ca_file = tls_client_ca;
  if (!redis_url.empty()) {
    options.tiers.remote.url = redis_url;
    if (kvd::RedactUrl(redis_url) != redis_url) {
      spdlog::warn("--redis-url carries a password, which every local user can read in /proc/{}/cmdline; "
                   "pass it in $KVD_REDIS_PASSWORD or tiers.redis_password_file instead", getpid());
    }
  }
  if (!router_events.empty()) options.router_events.endpoint = router_events;
  if (!router_replay.empty()) options.router_events.replay_endpoint = router_replay;

  options.ApplyDefaults();
  if (absl::Status s = options.Validate(); !s.ok()) {
    std::cerr << "kvd: invalid configuration: " << s.message() << "\n";
    return 2;
  }
  if (print_config) {
    std::cout << kvd::FormatConfig(options);
    return 0;
  }

  spdlog::set_default_logger(spdlog::stderr_color_mt("kvd"));
  spdlog::set_level(spdlog::level::from_str(options.server.log_level));

  // Block the shutdown signals before any thread starts, so only sigwait below receives them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGUSR2);  // raised by the handoff thread once a successor took over
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  absl::Mutex handoff_mu;
  std::optional<std::pair<absl::Status, kvd::HandoffNext>> handoff_outcome;
  const kvd::Daemon::HandoffHook on_handoff = [&handoff_mu, &handoff_outcome](absl::Status outcome,
                                                                               kvd::HandoffNext next) {
    {
      absl::MutexLock lock(&handoff_mu);
      handoff_outcome.emplace(std::move(outcome), next);
    }
    kill(getpid(), SIGUSR2);
  };
  auto daemon = kvd::Daemon::Start(options, takeover, on_handoff);
  if (!daemon.ok()) {
    std::cerr << "kvd: " << daemon.status().message() << "\n";
    return 1;
  }
  std::cout << "kvd: workers connect to " << (*daemon)->grpc_address() << "\n";
  if ((*daemon)->metrics_port() > 0) {
    std::cout << "kvd: metrics at http://" << options.server.metrics_listen.substr(0, options.server.metrics_listen.rfind(':'))
              << ":" << (*daemon)->metrics_port() << "/metrics\n";
  }
  std::cout.flush();
  if (!options.server.ready_file.empty()) WriteReadyFile(options.server.ready_file, **daemon);

  NotifySystemd("READY=1");
  // With WatchdogSec= in the unit, systemd restarts kvd unless it hears WATCHDOG=1 in time: sent
  // only while the engine answers and the listener serves a Ping (Daemon::Probe).
  struct Watchdog {
    absl::Notification stop;
    std::thread thread;
    ~Watchdog() {
      stop.Notify();
      if (thread.joinable()) thread.join();
    }
  };
  const auto start_watchdog = [](kvd::Daemon* d) {
    auto w = std::make_unique<Watchdog>();
    if (absl::Duration period = WatchdogPeriod(); period > absl::ZeroDuration()) {
      w->thread = std::thread([stop = &w->stop, period, d] {
        bool failing = false;
        do {
          if (absl::Status s = d->Probe(period); s.ok()) {
            NotifySystemd("WATCHDOG=1");
            if (failing) spdlog::info("watchdog: kvd answers again");
            failing = false;
          } else if (!failing) {
            spdlog::error("watchdog: {}; not telling systemd kvd is alive (it restarts kvd after WatchdogSec)",
                          s.ToString());
            failing = true;
          }
        } while (!stop->WaitForNotificationWithTimeout(period));
      });
    }
    return w;
  };
  std::unique_ptr<Watchdog> watchdog = start_watchdog(daemon->get());

  int sig = 0;
  for (;;) {
    sigwait(&signals, &sig);
    if (sig != SIGUSR2) break;
    std::pair<absl::Status, kvd::HandoffNext> outcome{absl::OkStatus(), kvd::HandoffNext::kExit};
    {
      absl::MutexLock lock(&handoff_mu);
      if (handoff_outcome.has_value()) outcome = *std::exchange(handoff_outcome, std::nullopt);
    }
    watchdog.reset();
    if (outcome.second != kvd::HandoffNext::kExit) {
      // The successor never got the memory, or got it and is gone: serve again (server/handoff.h).
      const bool keep_index = outcome.second == kvd::HandoffNext::kResumeWithIndex;
      spdlog::error("handoff failed after this kvd stopped serving: {}; serving again on the same sockets and "
                    "memory, {}", outcome.first.ToString(),
                    keep_index ? "cache as it was" : "with an empty index (the successor may have written blocks)");
      auto resumed = kvd::Daemon::Resume(std::move(*daemon), keep_index, on_handoff);
      if (!resumed.ok()) {
        spdlog::error("could not serve again: {}", resumed.status().ToString());
        return 1;
      }
      *daemon = std::move(*resumed);
      watchdog = start_watchdog(daemon->get());
      continue;
    }
    if (!outcome.first.ok()) {
      spdlog::error("handoff failed after this kvd stopped serving, and the new kvd may still run: {}; exiting",
                    outcome.first.ToString());
      daemon->reset();
      return 1;
    }
    daemon->reset();  // lets the metrics address go, which the successor is waiting to bind
    if (after_handoff == "wait") {
      spdlog::info("handed over: the new kvd serves; waiting for SIGTERM (--after-handoff=wait)");
      sigset_t stop;
      sigemptyset(&stop);
      sigaddset(&stop, SIGTERM);
      sigaddset(&stop, SIGINT);
      sigwait(&stop, &sig);
    }
    spdlog::info("handed over: kvd exits, its successor serves");
    return 0;
  }
  spdlog::info("received signal {}: draining for up to {} (a second signal stops at once)", sig,
               absl::FormatDuration((*daemon)->options().server.drain_timeout));
  NotifySystemd("STOPPING=1");
  (*daemon)->Drain((*daemon)->options().server.drain_timeout, [&signals] {
    timespec zero{0, 0};
    return sigtimedwait(&signals, nullptr, &zero) > 0;
  });
  watchdog.reset();
  daemon->reset();
  spdlog::info("kvd stopped");
  return 0;
}
