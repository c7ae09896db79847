// kvdctl: the admin CLI over kvd's gRPC API.
//
//   kvdctl [--target=unix:///run/kvd/kvd.sock] [--json] COMMAND
//     status            budget, reservations, requests, sessions, hit rate, pressure, workers
//     pools             geometry and block states of every pool
//     requests          live requests
//     sessions          sessions with their affinity
//     gc [--max-idle-ms=N]   expire TTLs and evict idle unreferenced blocks
//     boundary          trim pools above the high watermark
//     drain             stop admitting (as SIGTERM does, without exiting)
//     events [--after=N] [--follow]   index events; --follow keeps streaming
//     health            exit 0 when kvd is SERVING, 1 otherwise (draining, unreachable): probes
// Human-readable tables by default; --json prints the API's messages as JSON (one per line for
// events). Exit status 1 with the gRPC status on failure.

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <grpcpp/grpcpp.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "proto/grpc_status.h"
#include "server/build_info.h"
#include "server/config_values.h"
#include "server/kvdctl_json.h"
#include "proto/vocab/default_paths.h"
#include "proto/vocab/pool_geometry.h"

namespace {

using kvd::v1::Kvd;

std::string Json(const google::protobuf::Message& m) { return kvd::ToJsonLine(m); }

std::string Bytes(int64_t b);

// Redis's maxmemory as kvd read it: -1 when CONFIG GET was not answered, 0 when unbounded.
std::string MaxMemory(int64_t bytes) {
  return bytes < 0 ? "unknown" : bytes == 0 ? "unbounded" : Bytes(bytes);
}

// Prints rows as left-aligned columns.
void Table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& r : rows) {
    for (size_t i = 0; i < r.size(); ++i) {
      if (i >= width.size()) width.push_back(0);
      width[i] = std::max(width[i], r[i].size());
    }
  }
  for (const auto& r : rows) {
    std::string line;
    for (size_t i = 0; i < r.size(); ++i) {
      line += r[i];
      if (i + 1 < r.size()) line += std::string(width[i] - r[i].size() + 2, ' ');
    }
    std::cout << line << "\n";
  }
}

std::string Bytes(int64_t b) {
  if (b >= (int64_t{1} << 30)) return absl::StrFormat("%.1f GiB", b / 1073741824.0);
  if (b >= (int64_t{1} << 20)) return absl::StrFormat("%.1f MiB", b / 1048576.0);
  if (b >= 1024) return absl::StrFormat("%.1f KiB", b / 1024.0);
  return absl::StrCat(b, " B");
}

int Fail(const grpc::Status& s) {
  // The code by name (FAILED_PRECONDITION), as the docs and kvd's logs spell it.
  std::cerr << "kvdctl: " << kvd::FromGrpcStatus(s) << "\n";
  return 1;
}

template <typename Resp, typename Fn>
int Call(Fn&& fn, Resp* resp, int deadline_s = 10) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(deadline_s));
  grpc::Status s = fn(&ctx, resp);
  return s.ok() ? 0 : Fail(s);
}

int Status(Kvd::Stub& stub, bool json) {
  kvd::v1::ReportResponse r;
  if (int rc = Call([&](auto* c, auto* p) { return stub.Report(c, kvd::v1::ReportRequest(), p); }, &r)) return rc;
  if (json) {
    std::cout << Json(r) << "\n";
    return 0;
  }
  const double looked = static_cast<double>(r.hit_tokens() + r.miss_tokens());
  std::vector<std::string> pools;
  for (const kvd::v1::PoolReport& p : r.pools()) {
    pools.push_back(absl::StrCat(p.name(), " (", p.free_blocks(), " of ", p.capacity_blocks(), " blocks free)"));
  }
  Table({{"state", r.draining() ? "draining (admits no new work)" : "serving"},
         {"pools", absl::StrJoin(pools, ", ")},
         {"budget", Bytes(r.budget_bytes())},
         {"reserved", absl::StrFormat("%s (%.1f%%)", Bytes(r.reserved_bytes()),
                                      r.budget_bytes() ? 100.0 * r.reserved_bytes() / r.budget_bytes() : 0)},
         {"pressure", absl::StrFormat("%s (%.1f%% available)", r.pressure(), 100 * r.available_fraction())},
         {"live requests", absl::StrCat(r.live_requests())},
         {"attached workers", absl::StrCat(r.attached_workers())},
         {"sessions", absl::StrCat(r.sessions())},
         {"checkpoints awaiting resume", absl::StrCat(r.orphaned_checkpoints(), " (", Bytes(r.checkpoint_bytes()), ")")},
         {"indexed blocks", absl::StrCat(r.indexed_blocks())},
         {"hit rate (tokens)", absl::StrFormat("%.1f%% of %d", looked ? 100 * r.hit_tokens() / looked : 0.0,
                                               static_cast<int64_t>(looked))},
         {"admissions", absl::StrCat(r.admitted(), " admitted, ", r.waited(), " waited, ", r.rejected(), " rejected")},
         {"last event", absl::StrCat(r.last_event_sequence())}});
  if (r.has_tiers()) {
    const kvd::v1::TierReport& t = r.tiers();
    std::cout << "\n";
    Table({{"TIER", "USED", "CAPACITY", "RECORDS"},
           {"host", Bytes(t.host_used_bytes()), Bytes(t.host_capacity_bytes()), absl::StrCat(t.host_records())},
           {"disk", Bytes(t.disk_used_bytes()), Bytes(t.disk_capacity_bytes()),
            absl::StrCat(t.disk_records(), " in ", t.disk_segments(), " segments")}});
    std::cout << "\n";
    Table({{"pending persistence", absl::StrCat(t.pending_snapshot_records(), " cached records, ",
                                                t.pending_spill_records(), " spills (",
                                                Bytes(t.pending_spill_bytes()), "), ",
                                                t.pending_checkpoints(), " checkpoints")},
           {"last flush", t.flushes() == 0 ? std::string("never")
                                           : absl::StrFormat("%s in %.3fs (%d of %d failed)",
                                                             t.last_flush_durable() ? "durable" : "NOT durable",
                                                             t.last_flush_seconds(), t.flush_failures(), t.flushes())},
           {"promoted tokens", absl::StrCat(t.promoted_tokens())},
           {"compression ratio", absl::StrFormat("%.2f", t.compression_ratio())},
           {"checksum failures", absl::StrCat(t.checksum_failures())},
           {"objects", absl::StrCat(t.objects())}});
    if (t.has_remote()) {
      const kvd::v1::RemoteTierReport& g4 = t.remote();
      std::cout << "\n";
      const char* state = !g4.available() ? " (SKIPPED after a failure)"
                          : g4.failing()  ? " (FAILING: its last call failed)"
                                          : " (available)";
      Table({{"redis tier", absl::StrCat(g4.url(), state)},
             {"lookups", absl::StrCat(g4.lookups(), " (", g4.hit_blocks(), " blocks found, ", g4.fetched_blocks(), " fetched)")},
             {"uploads", absl::StrCat(g4.uploaded_blocks(), " uploaded, ", g4.refreshed_blocks(), " already there, ",
                                      g4.upload_dropped(), " dropped")},
             {"memory", absl::StrCat("maxmemory ", MaxMemory(g4.maxmemory()), ", policy ",
                                     g4.eviction_policy().empty() ? "unknown" : g4.eviction_policy(), ", ",
                                     g4.oom_refusals(), " values refused for want of memory")},
             {"failures", absl::StrCat(g4.errors(), " errors and ", g4.skipped(), " skipped of ", g4.calls(), " calls, ", g4.corrupt(),
                                       " corrupt values", g4.last_error().empty() ? "" : "; last: " + g4.last_error())}});
    }
  }
  return 0;
}

void PrintFlush(const kvd::v1::FlushResponse& f) {
  std::cout << (f.durable() ? "durable" : "NOT durable") << ": wrote " << f.written_records()
            << " records (" << Bytes(f.written_bytes()) << "), " << f.already_durable()
            << " already on disk, " << f.failed_records() << " failed"
            << absl::StrFormat(" in %.3fs", f.seconds()) << "\n";
  if (!f.durable()) std::cout << "error: " << f.error() << "\n";
}

int SavedPrefixes(Kvd::Stub& stub, bool json) {
  grpc::ClientContext ctx;
  auto reader = stub.SavedPrefixes(&ctx, kvd::v1::SavedPrefixesRequest());
  kvd::v1::SavedPrefixBatch batch;
  std::vector<std::vector<std::string>> rows = {{"POOL", "ADAPTER", "TOKENS", "FIRST TOKENS"}};
  while (reader->Read(&batch)) {
    for (const auto& p : batch.prefixes()) {
      if (json) {
        std::cout << Json(p) << "\n";
        continue;
      }
      std::vector<std::string> head;
      for (int i = 0; i < std::min(p.tokens_size(), 8); ++i) head.push_back(absl::StrCat(p.tokens(i)));
      rows.push_back({p.namespace_().pool(), p.namespace_().adapter(), absl::StrCat(p.tokens_size()),
                      absl::StrJoin(head, ",") + (p.tokens_size() > 8 ? ",..." : "")});
    }
  }
  grpc::Status s = reader->Finish();
  if (!s.ok()) return Fail(s);
  if (!json) Table(rows);
  return 0;
}

int Pools(Kvd::Stub& stub, bool json) {
  kvd::v1::ListPoolsResponse pools;
  kvd::v1::ReportResponse r;
  if (int rc = Call([&](auto* c, auto* p) { return stub.ListPools(c, kvd::v1::ListPoolsRequest(), p); }, &pools)) return rc;
  if (int rc = Call([&](auto* c, auto* p) { return stub.Report(c, kvd::v1::ReportRequest(), p); }, &r)) return rc;
  if (json) {
    std::cout << Json(pools) << "\n";
    return 0;
  }
  std::vector<std::vector<std::string>> rows = {
      {"POOL", "BLOCK", "LAYERS", "BLOCK BYTES", "LAYOUT", "FORMAT", "SHARDS", "CAPACITY", "FREE", "OWNED", "CACHED",
       "EVICTABLE", "MODEL"}};
  for (int i = 0; i < pools.pools_size(); ++i) {
    const auto& p = pools.pools(i);
    const auto& s = r.pools(i);
    rows.push_back({p.name(), absl::StrCat(p.block_tokens(), " tok"), absl::StrCat(p.num_layers()),
                    Bytes(p.block_bytes()),
                    p.layout() == kvd::v1::LAYOUT_LAYER_MAJOR ? "layer_major" : "block_major",
                    p.dtype().empty() ? "-"
                    : p.kv_arrangement().empty()
                        ? p.dtype()
                        : absl::StrCat(p.dtype(), " ", p.kv_heads(), "x", p.head_dim(), " ", p.kv_arrangement()),
                    absl::StrCat(p.slabs_size()), absl::StrCat(p.capacity_blocks()),
                    absl::StrCat(s.free_blocks()), absl::StrCat(s.owned_blocks()),
                    absl::StrCat(s.cached_blocks()), absl::StrCat(s.evictable_blocks()),
                    p.model_fingerprint().empty() ? "-" : p.model_fingerprint()});
  }
  Table(rows);
  // Hybrid pools' KV groups (docs/hybrid.md): a second table, absent when no pool has groups.
  std::vector<std::vector<std::string>> groups = {
      {"POOL", "GROUP", "KIND", "LAYERS", "UNIT BYTES", "CAPACITY", "FIRST BLOCK", "REGION OFFSET", "PARAMETERS",
       "FREE", "OWNED", "CACHED", "EVICTABLE"}};
  for (int i = 0; i < pools.pools_size(); ++i) {
    const auto& p = pools.pools(i);
    for (int j = 0; j < p.groups_size(); ++j) {
      const auto& g = p.groups(j);
      // The group's counts now (Report), "-" from a daemon that does not send them.
      std::vector<std::string> counts(4, "-");
      if (i < r.pools_size() && j < r.pools(i).groups_size()) {
        const auto& c = r.pools(i).groups(j);
        counts = {absl::StrCat(c.free()), absl::StrCat(c.owned()), absl::StrCat(c.cached()), absl::StrCat(c.evictable())};
      }
      std::string params = "-";
      if (g.kind() == "sliding_window") params = absl::StrCat("window ", g.window());
      if (g.kind() == "chunked_local") params = absl::StrCat("chunk ", g.chunk());
      if (g.kind() == "state") {
        params = absl::StrCat("k ", g.checkpoint_every_blocks(), g.checkpoint_at_end() ? ", tail" : "");
      }
      groups.push_back({p.name(), g.name(), g.kind(),
                        absl::StrJoin(kvd::FormatLayers(std::vector<int32_t>(g.layers().begin(), g.layers().end())), ","),
                        Bytes(g.layer_unit_bytes() * g.layers_size()),
                        absl::StrCat(g.capacity(), g.kind() == "state" ? " slots" : " blocks"),
                        absl::StrCat(g.first_block()), Bytes(g.region_offset_bytes()), params, counts[0], counts[1],
                        counts[2], counts[3]});
    }
  }
  if (groups.size() > 1) {
    std::cout << "\n";
    Table(groups);
  }
  return 0;
}

int Requests(Kvd::Stub& stub, bool json) {
  kvd::v1::ListHandlesResponse r;
  if (int rc = Call([&](auto* c, auto* p) { return stub.ListHandles(c, kvd::v1::ListHandlesRequest(), p); }, &r)) return rc;
  if (json) {
    std::cout << Json(r) << "\n";
    return 0;
  }
  std::vector<std::vector<std::string>> rows = {
      {"REQUEST", "WORKER", "POOL", "SESSION", "TOKENS", "CACHED", "BLOCKS", "RESERVED", "CHECKPOINT"}};
  for (const auto& h : r.handles()) {
    rows.push_back({h.request_id(), h.worker_id(), h.pool(), h.session_id(),
                    h.acquired() ? absl::StrCat(h.num_tokens()) : "(admitted)",
                    absl::StrCat(h.cached_tokens()), absl::StrCat(h.blocks_size()),
                    Bytes(h.reserved_bytes()), h.has_checkpoint() ? "yes" : "no"});
  }
  Table(rows);
  return 0;
}

int Sessions(Kvd::Stub& stub, bool json) {
  kvd::v1::ListSessionsResponse r;
  if (int rc = Call([&](auto* c, auto* p) { return stub.ListSessions(c, kvd::v1::ListSessionsRequest(), p); }, &r)) return rc;
  if (json) {
    std::cout << Json(r) << "\n";
    return 0;
  }
  std::vector<std::vector<std::string>> rows = {{"SESSION", "WORKER", "PROTECTED BLOCKS", "EXPIRES IN"}};
  const int64_t now_ms = absl::ToUnixMillis(absl::Now());
  for (const auto& s : r.sessions()) {
    rows.push_back({s.session_id(), s.worker_id(), absl::StrCat(s.protected_blocks()),
                    absl::StrFormat("%.0fs", (s.expires_unix_ms() - now_ms) / 1000.0)});
  }
  Table(rows);
  return 0;
}

std::string EventLine(const kvd::v1::CacheEvent& e) {
  const char* kind = e.kind() == kvd::v1::CacheEvent::STORED    ? "stored"
                     : e.kind() == kvd::v1::CacheEvent::REMOVED ? "removed"
                                                                : "cleared";
  if (e.kind() == kvd::v1::CacheEvent::CLEARED) return absl::StrCat(e.sequence(), " cleared");
  return absl::StrCat(e.sequence(), " ", kind, " pool=", e.pool(), " block=", e.block(),
                      " key=", absl::BytesToHexString(e.block_key()),
                      e.parent_key().empty() ? "" : absl::StrCat(" parent=", absl::BytesToHexString(e.parent_key())),
                      e.tokens_size() ? absl::StrCat(" tokens=", e.tokens_size()) : "");
}

int Events(Kvd::Stub& stub, bool json, uint64_t after, bool follow) {
  kvd::v1::ReportResponse r;
  if (int rc = Call([&](auto* c, auto* p) { return stub.Report(c, kvd::v1::ReportRequest(), p); }, &r)) return rc;
  const uint64_t until = r.last_event_sequence();
  if (!follow && after >= until) return 0;
  grpc::ClientContext ctx;
  kvd::v1::WatchEventsRequest req;
  req.set_after_sequence(after);
  auto reader = stub.WatchEvents(&ctx, req);
  kvd::v1::EventBatch batch;
  while (reader->Read(&batch)) {
    if (batch.resync()) {
      std::cout << (json ? "{\"resync\": true}" : "resync: events before this point are no longer buffered") << "\n";
      if (!follow) {
        ctx.TryCancel();
        return 0;
      }
    }
    uint64_t last = 0;
    for (const auto& e : batch.events()) {
      std::cout << (json ? Json(e) : EventLine(e)) << "\n";
      last = e.sequence();
    }
    std::cout.flush();
    if (!follow && last >= until) {
      ctx.TryCancel();
      return 0;
    }
  }
  // The stream ended on its own: say why unless it ended well.
  const grpc::Status s = reader->Finish();
  return s.ok() ? 0 : Fail(s);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvdctl: administer a kvd daemon"};
  std::string target = kvd::DefaultTarget();
  bool json = false;
  app.add_option("--target", target, "kvd address (env KVD_TARGET)");
  app.add_flag("--json", json, "print JSON instead of tables");
  app.require_subcommand(1);
  auto* status = app.add_subcommand("status", "budget, requests, sessions, hit rate, pressure");
  auto* pools = app.add_subcommand("pools", "pools and their block states");
  auto* requests = app.add_subcommand("requests", "live requests");
  auto* sessions = app.add_subcommand("sessions", "sessions and their affinity");
  auto* gc = app.add_subcommand("gc", "expire TTLs and evict unreferenced blocks idle for --max-idle, or --all");
  int64_t max_idle_ms = -1;
  std::string max_idle;
  bool gc_all = false;
  auto* gc_idle = gc->add_option("--max-idle", max_idle, "evict blocks idle at least this long (e.g. 10m, 30s)");
  auto* gc_idle_ms = gc->add_option("--max-idle-ms", max_idle_ms, "the same in milliseconds")->excludes(gc_idle);
  gc->add_flag("--all", gc_all, "evict every unprotected, unreferenced block however recently used")
      ->excludes(gc_idle)
      ->excludes(gc_idle_ms);
  auto* boundary = app.add_subcommand("boundary", "trim pools above the high watermark");
  auto* drain = app.add_subcommand("drain", "stop admitting new work");
  auto* undrain = app.add_subcommand("undrain", "admit again after `drain` (not after SIGTERM)");
  auto* events = app.add_subcommand("events", "index events");
  uint64_t after = 0;
  bool follow = false;
  events->add_option("--after", after, "start after this sequence number");
  events->add_flag("--follow", follow, "keep streaming");
  auto* health = app.add_subcommand("health", "exit 0 when SERVING (for probes)");
  auto* flush = app.add_subcommand("flush", "make every cached prefix durable on disk (exit 2 when not durable)");
  auto* close = app.add_subcommand("close", "after a drain: flush, then clear device and host tiers");
  auto* saved = app.add_subcommand("saved", "token prefixes the disk tier holds");
  auto* version = app.add_subcommand("version", "this kvdctl's build, and the daemon's when it answers");
  // The global flags are taken after the command too: `kvdctl status --json` as `kvdctl --json status`.
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    sub->add_option("--target", target, "kvd address (env KVD_TARGET)");
    sub->add_flag("--json", json, "print JSON instead of tables");
  }
  CLI11_PARSE(app, argc, argv);

  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  if (*version) {
    kvd::v1::ReportResponse r;
    const bool reachable = channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(2));
    if (reachable) {
      if (int rc = Call([&](auto* c, auto* p) { return Kvd::NewStub(channel)->Report(c, kvd::v1::ReportRequest(), p); },
                        &r)) {
        return rc;
      }
    }
    if (json) {
      std::cout << "{\"kvdctl\": " << kvd::JsonString(kvd::BuildInfo("kvdctl"))
                << ", \"daemon\": " << (reachable ? kvd::JsonString(r.build()) : "null")
                << ", \"target\": " << kvd::JsonString(target) << "}\n";
    } else {
      std::cout << kvd::BuildInfo("kvdctl") << "\n"
                << (reachable ? absl::StrCat("daemon: ", r.build()) : absl::StrCat("daemon: not reachable at ", target))
                << "\n";
    }
    return 0;
  }
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(5))) {
    std::cerr << "kvdctl: cannot reach kvd at " << target << "\n";
    return 1;
  }
  if (*health) {
    auto hstub = grpc::health::v1::Health::NewStub(channel);
    grpc::health::v1::HealthCheckResponse r;
    if (int rc = Call([&](auto* c, auto* p) {
          return hstub->Check(c, grpc::health::v1::HealthCheckRequest(), p);
        }, &r)) {
      return rc;
    }
    const bool serving = r.status() == grpc::health::v1::HealthCheckResponse::SERVING;
    if (json) std::cout << Json(r) << "\n";
    else std::cout << (serving ? "SERVING" : "NOT_SERVING") << "\n";
    return serving ? 0 : 1;
  }
  auto stub = Kvd::NewStub(channel);
  if (*status) return Status(*stub, json);
  if (*pools) return Pools(*stub, json);
  if (*requests) return Requests(*stub, json);
  if (*sessions) return Sessions(*stub, json);
  if (*events) return Events(*stub, json, after, follow);
  if (*gc) {
    // Destructive without a bound: the operator says so (gc --all) rather than getting it by
    // leaving the argument out.
    kvd::v1::GcRequest req;
    if (!max_idle.empty()) {
      absl::StatusOr<absl::Duration> d = kvd::ParseDurationValue("--max-idle", max_idle);
      if (!d.ok() || *d < absl::ZeroDuration()) {
        std::cerr << "kvdctl: " << (d.ok() ? "--max-idle must be >= 0" : std::string(d.status().message())) << "\n";
        return 2;
      }
      req.set_max_idle_ms(absl::ToInt64Milliseconds(*d));
    } else if (max_idle_ms >= 0) {
      req.set_max_idle_ms(max_idle_ms);
    } else if (!gc_all) {
      std::cerr << "kvdctl gc: say which blocks: --max-idle=DURATION (e.g. 10m) evicts blocks idle that long; "
                   "--all evicts every unprotected, unreferenced block\n";
      return 2;
    }
    kvd::v1::GcResponse r;
    if (int rc = Call([&](auto* c, auto* p) { return stub->Gc(c, req, p); }, &r)) return rc;
    if (json) std::cout << Json(r) << "\n";
    else std::cout << "freed " << r.blocks_freed() << " blocks (" << Bytes(r.bytes_freed()) << "), dropped "
                   << r.checkpoints_dropped() << " checkpoints, expired " << r.sessions_expired() << " sessions\n";
    return 0;
  }
  if (*boundary) {
    kvd::v1::BoundaryResponse r;
    if (int rc = Call([&](auto* c, auto* p) { return stub->Boundary(c, kvd::v1::BoundaryRequest(), p); }, &r)) return rc;
    if (json) std::cout << Json(r) << "\n";
    else std::cout << "evicted " << r.evicted_blocks() << " blocks\n";
    return 0;
  }
  if (*flush) {
    kvd::v1::FlushResponse r;
    if (int rc = Call([&](auto* c, auto* p) { return stub->Flush(c, kvd::v1::FlushRequest(), p); }, &r, 600)) return rc;
    if (json) std::cout << Json(r) << "\n";
    else PrintFlush(r);
    return r.durable() ? 0 : 2;
  }
  if (*close) {
    kvd::v1::CloseResponse r;
    if (int rc = Call([&](auto* c, auto* p) { return stub->Close(c, kvd::v1::CloseRequest(), p); }, &r, 600)) return rc;
    if (json) {
      std::cout << Json(r) << "\n";
    } else {
      if (r.has_flush()) PrintFlush(r.flush());
      std::cout << "cleared " << r.cleared_blocks() << " device blocks\n";
    }
    return !r.has_flush() || r.flush().durable() ? 0 : 2;
  }
  if (*saved) return SavedPrefixes(*stub, json);
  if (*undrain) {
    kvd::v1::DrainRequest req;
    req.set_resume(true);
    kvd::v1::DrainResponse r;
    if (int rc = Call([&](auto* c, auto* p) { return stub->Drain(c, req, p); }, &r)) return rc;
    if (json) std::cout << Json(r) << "\n";
    else std::cout << "admitting again; " << r.live_requests() << " requests live\n";
    return 0;
  }
  if (*drain) {
    kvd::v1::DrainResponse r;
    if (int rc = Call([&](auto* c, auto* p) { return stub->Drain(c, kvd::v1::DrainRequest(), p); }, &r)) return rc;
    if (json) std::cout << Json(r) << "\n";
    else std::cout << "draining: new work is refused; " << r.live_requests() << " requests still live\n";
    return 0;
  }
  return 0;
}
