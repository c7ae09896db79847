#include "server/daemon.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <filesystem>

#include <grpcpp/create_channel.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gpu/fd_passing.h"
#include "gpu/host_arena.h"
#if KVD_HAVE_CUDA
#include "gpu/cuda_arena.h"
#endif
#include "proto/vocab/status_macros.h"
#include "server/config_values.h"
#include "server/rpc/access_interceptor.h"
#include "server/rpc/ended_writers.h"
#include "server/handoff.h"
#include "server/obs/process_stats.h"
#include "server/slab_fd_store.h"
#include "spdlog/spdlog.h"

namespace kvd {
namespace {

// Host memory, adopting the slabs systemd's fd store kept from the previous process (then every
// worker's mapping stays valid), and storing the slabs for the next one.
// `adopted` is set to whether any memory was kept.
absl::StatusOr<std::unique_ptr<DeviceArena>> MakeHostArena(const std::vector<PoolGeometry>& pools, bool* adopted) {
  KVD_ASSIGN_OR_RETURN(std::unique_ptr<HostArena> arena, HostArena::Create(pools, TakeOfferedSlabs(pools)));
  *adopted = arena->adopted() > 0;
  if (arena->adopted() > 0) {
    spdlog::warn("kept the KV memory of {} slab(s) from systemd's fd store; the cache starts empty "
                 "(workers keep their mappings)", arena->adopted());
  }
  if (const int stored = StoreSlabFds(*arena); stored > 0) {
    spdlog::info("stored {} slab(s) in systemd's fd store (FileDescriptorStoreMax= must allow them)", stored);
  }
  return arena;
}

// The arena made of every slab a predecessor handed over (server/handoff.h): VMM slabs on CUDA
// when the pools use allocator vmm, else memfds. INTERNAL unless every slab was adopted.
absl::StatusOr<std::unique_ptr<DeviceArena>> AdoptArena(const std::vector<PoolGeometry>& pools,
                                                        std::vector<OfferedSlab> slabs) {
  const size_t offered = slabs.size();
  int adopted = 0;
  std::unique_ptr<DeviceArena> arena;
  const bool vmm = std::any_of(pools.begin(), pools.end(),
                               [](const PoolGeometry& g) { return g.allocator == PoolAllocator::kVmm; });
  if (vmm) {
#if KVD_HAVE_CUDA
    KVD_ASSIGN_OR_RETURN(std::unique_ptr<CudaArena> cuda, CudaArena::Create(pools, std::move(slabs)));
    adopted = cuda->adopted();
    arena = std::move(cuda);
#else
    return absl::FailedPreconditionError("handoff: the pools are CUDA VMM memory and this kvd was built without CUDA");
#endif
  } else {
    KVD_ASSIGN_OR_RETURN(std::unique_ptr<HostArena> host, HostArena::Create(pools, std::move(slabs)));
    adopted = host->adopted();
    (void)StoreSlabFds(*host);
    arena = std::move(host);
  }
  if (static_cast<size_t>(adopted) != offered || arena->slabs().size() != offered) {
    return absl::InternalError(absl::StrCat("handoff: adopted ", adopted, " of ", offered, " slabs handed over"));
  }
  return arena;
}

// The arena for `backend`: host, cuda, or auto (cuda when a GPU is usable, else host with one
// warning). A cuda request without a usable GPU fails with the CUDA error named.
absl::StatusOr<std::unique_ptr<DeviceArena>> MakeArena(const std::string& backend,
                                                       const std::vector<PoolGeometry>& pools, bool* adopted) {
  *adopted = false;
  if (backend == "host") return MakeHostArena(pools, adopted);
#if KVD_HAVE_CUDA
  absl::Status usable = ProbeCuda();
  if (usable.ok()) return CudaArena::Create(pools);
  if (backend == "cuda") {
    return absl::FailedPreconditionError(
        absl::StrCat("--backend=cuda: ", usable.message(), "; use --backend=host or auto"));
  }
  spdlog::warn("no usable GPU ({}); --backend=auto falls back to host memory",
               std::string(usable.message()));
#else
  if (backend == "cuda") {
    return absl::FailedPreconditionError(
        "--backend=cuda: this kvd was built without the CUDA backend (no CUDA toolkit at build "
        "time); rebuild with the toolkit or use --backend=host");
  }
  spdlog::warn("--backend=auto: built without CUDA; using host memory");
#endif
  return MakeHostArena(pools, adopted);
}

// Unix sockets: insecure transport (the kernel checks peers: 0660 socket, SO_PEERCRED on the side
// socket). TCP: TLS when a certificate is configured, optionally requiring client certificates;
// plain TCP only with a warning.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const ServerOptions& so,
                                                                           bool unix_socket) {
  if (unix_socket || so.tls_cert_file.empty()) {
    if (!unix_socket) spdlog::warn("listening on TCP {} without TLS: any host that reaches it can call kvd", so.listen);
    return grpc::InsecureServerCredentials();
  }
  grpc::SslServerCredentialsOptions ssl;
  KVD_ASSIGN_OR_RETURN(std::string cert, ReadConfigFile("tls_cert_file", so.tls_cert_file));
  KVD_ASSIGN_OR_RETURN(std::string key, ReadConfigFile("tls_key_file", so.tls_key_file));
  ssl.pem_key_cert_pairs.push_back({key, cert});
  if (!so.tls_client_ca_file.empty()) {
    KVD_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadConfigFile("tls_client_ca_file", so.tls_client_ca_file));
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

absl::Status EnsureParentDir(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat("cannot create the directory of ", path, ": ", ec.message()));
  return absl::OkStatus();
}

// RESOURCE_EXHAUSTED naming the pool and the sizes when a pool cannot fit this machine's memory
// (checked before anything is allocated: a pool past it would end in std::bad_alloc or an mmap
// error that names nothing). Slabs count in full on the host backend (on auto they may be device
// memory); on any backend the engine keeps about kMetadataBytesPerBlock of host memory per block.
absl::Status CheckPoolsFitMemory(const Options& o) {
  constexpr int64_t kMetadataBytesPerBlock = 256;
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return absl::OkStatus();
  const __int128 machine = static_cast<__int128>(pages) * page;
  __int128 total = 0;
  for (const PoolGeometry& g : o.cache.pools) {
    const __int128 metadata = static_cast<__int128>(g.capacity_blocks) * kMetadataBytesPerBlock;
    const __int128 slabs = o.server.backend != "host"
                               ? 0
                               : static_cast<__int128>(g.capacity_blocks) * g.block_tokens * g.num_layers *
                                     g.bytes_per_token_per_layer * std::max<int64_t>(1, g.num_shards);
    total += metadata + slabs;
    if (metadata + slabs > machine) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "pool '%s' needs %.1f GiB of host memory (%d blocks%s); this machine has %.1f GiB: lower capacity_blocks",
          g.name, static_cast<double>(metadata + slabs) / (1 << 30), g.capacity_blocks,
          slabs > 0 ? " in host slabs" : " of bookkeeping", static_cast<double>(machine) / (1 << 30)));
    }
  }
  if (total > machine) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("the pools together need %.1f GiB of host memory; this machine has %.1f GiB: lower capacity_blocks",
                        static_cast<double>(total) / (1 << 30), static_cast<double>(machine) / (1 << 30)));
  }
  return absl::OkStatus();
}

// FAILED_PRECONDITION when a daemon answers on the Unix socket kvd is to listen on: starting
// anyway would take its name (it would serve on, unreachable, even by --takeover).
absl::Status RefuseLiveDaemon(const ServerOptions& so) {
  if (!absl::StartsWith(so.listen, "unix://")) return absl::OkStatus();
  const std::string path = so.listen.substr(7);
  if (!UnixSocketAnswers(path)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "another kvd is serving on ", so.listen, "; stop it first, or start this one with --takeover to take its place",
      " without dropping a worker"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(Options options, bool takeover, HandoffHook on_handoff) {
  options.ApplyDefaults();
  KVD_RETURN_IF_ERROR(options.Validate());
  KVD_RETURN_IF_ERROR(CheckPoolsFitMemory(options));
  if (!takeover) {
    KVD_RETURN_IF_ERROR(RefuseLiveDaemon(options.server));
    return Assemble(std::move(options), nullptr, std::move(on_handoff));
  }
  const std::string& path = options.server.handoff_socket;
  if (path.empty()) {
    return absl::InvalidArgumentError("--takeover needs a handoff socket: a Unix listen address and handoff_socket not off");
  }
  absl::StatusOr<HandoffSession> session = HandoffSession::Connect(path);
  if (absl::IsNotFound(session.status())) {
    spdlog::info("--takeover: {}; starting afresh", std::string(session.status().message()));
    KVD_RETURN_IF_ERROR(RefuseLiveDaemon(options.server));
    return Assemble(std::move(options), nullptr, std::move(on_handoff));
  }
  if (!session.ok()) return session.status();
  absl::StatusOr<HandoffReceived> taken = session->Take(MakeHello(options.cache.pools, options.server.backend));
  if (!taken.ok() && !absl::IsFailedPrecondition(taken.status())) {
    // The exchange broke. If the running kvd died with it, nothing serves: start afresh (its disk
    // tier reloads); if it lives, it serves again by itself (server/handoff.h).
    absl::SleepFor(absl::Milliseconds(200));  // a killed process takes a moment to be gone
    if (session->PeerGone()) {
      spdlog::warn("handoff: the running kvd died during the handoff ({}); starting afresh",
                   taken.status().ToString());
      return Assemble(std::move(options), nullptr, std::move(on_handoff));
    }
  }
  if (!taken.ok()) return taken.status();
  HandoffReceived received = *std::move(taken);
  spdlog::info("handoff: took over from {}: {} slab(s), {} cached block(s), {} session(s); {} live request(s) "
               "ended there (their clients see KvdRestarted)",
               received.old_build, received.slabs.size(), received.snapshot.blocks.size(),
               received.snapshot.sessions.size(), received.requests_ended);
  absl::StatusOr<std::unique_ptr<Daemon>> d = Assemble(std::move(options), &received, std::move(on_handoff));
  session->Finish(d.status());
  if (!d.ok()) {
    spdlog::error("handoff: this kvd did not start ({}); the old one serves again", d.status().ToString());
    return d;
  }
  (*d)->ListenForMetrics();
  return d;
}

void Daemon::ListenForMetrics() {
  // The predecessor closes the endpoint as it exits, just after it is told this kvd serves.
  const std::string& listen = options_.server.metrics_listen;
  absl::Status bound = metrics_->Listen(listen);
  for (int i = 0; i < 100 && !bound.ok(); ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    bound = metrics_->Listen(listen);
  }
  if (!bound.ok()) spdlog::error("metrics: {}; serving without /metrics", bound.ToString());
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Resume(std::unique_ptr<Daemon> stopped, bool keep_index,
                                                       HandoffHook on_handoff) {
  // The stopped daemon's sockets and slabs, as a successor would receive them (copies of the
  // descriptors: the stopped daemon closes its own when it goes).
  HandoffReceived own;
  own.listen_fd = UniqueFd(::fcntl(stopped->handed_listen_.get(), F_DUPFD_CLOEXEC, 0));
  own.side_fd = UniqueFd(::fcntl(stopped->handed_side_.get(), F_DUPFD_CLOEXEC, 0));
  for (const SlabDescriptor& d : stopped->arena_->slabs()) {
    own.slabs.push_back({d.pool, d.shard, UniqueFd(::fcntl(d.fd, F_DUPFD_CLOEXEC, 0)), d.memory_id});
  }
  if (keep_index) own.snapshot = std::move(stopped->handed_snapshot_);
  absl::StatusOr<std::unique_ptr<Daemon>> d = Assemble(stopped->options_, &own, std::move(on_handoff));
  stopped.reset();
  if (d.ok()) (*d)->ListenForMetrics();
  return d;
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Assemble(Options options, HandoffReceived* received,
                                                         HandoffHook on_handoff) {
  std::unique_ptr<Daemon> d(new Daemon(std::move(options)));
  d->adopted_sockets_ = received != nullptr;
  const ServerOptions& so = d->options_.server;

  KVD_ASSIGN_OR_RETURN(d->cache_, KvCache::Create(d->options_.cache, SystemClock::Get()));
  bool adopted = received != nullptr;
  if (received != nullptr) {
    // The predecessor's slabs, every one of them: their bytes are the cache being imported.
    KVD_ASSIGN_OR_RETURN(d->arena_, AdoptArena(d->options_.cache.pools, std::move(received->slabs)));
  } else {
    KVD_ASSIGN_OR_RETURN(d->arena_, MakeArena(so.backend, d->options_.cache.pools, &adopted));
  }
  if (d->options_.router_events.enabled()) {
    // Before Load: a warm restart's reload is announced to routers too.
    RouterEventsOptions ro = d->options_.router_events;
    ro.device_medium = d->arena_->backend() == "cuda" ? "GPU" : "CPU";
    for (const PoolGeometry& g : d->options_.cache.pools) ro.pools.push_back(g.name);
    KVD_ASSIGN_OR_RETURN(d->router_events_, RouterEventPublisher::Start(std::move(ro)));
    d->router_events_->Attach(d->cache_.get());
  }
  if (d->options_.tiers.enabled()) {
    // Load before serving: health turns SERVING only once a warm restart's state is indexed.
    // Checkpoints are restored into memory only below: never into blocks the snapshot or a fence
    // holds on adopted memory.
    KVD_ASSIGN_OR_RETURN(d->tiers_, TierStore::Open(d->options_.tiers, d->arena_.get(), d->cache_.get()));
    KVD_RETURN_IF_ERROR(d->tiers_->Load(/*restore_checkpoints=*/!adopted));
  }
  // Adopted memory may still be written by workers of the process that had it (docs/security.md,
  // "Leases and fencing"): what they may write stays fenced until they re-attach quiesced or a
  // lease TTL has passed. A snapshot says which blocks; otherwise every free block is fenced, for
  // the lease those workers were promised (the predecessor's, when it said; else this config's).
  absl::Duration promised_ttl = so.lease_ttl;
  if (received != nullptr && received->snapshot.lease_ttl > absl::ZeroDuration()) {
    promised_ttl = received->snapshot.lease_ttl;
  }
  bool fenced_all = false;
  if (received != nullptr) {
    // After Load, whose "all cleared" routers must hear first; the blocks are announced anew.
    KVD_ASSIGN_OR_RETURN(int64_t indexed, d->cache_->ImportSnapshot(received->snapshot));
    spdlog::info("handoff: {} cached block(s) indexed where they lie; nothing copied; {} fence(s) kept", indexed,
                 received->snapshot.fences.size());
    fenced_all = !received->snapshot.fences_known;
  } else {
    fenced_all = adopted;
  }
  if (fenced_all) {
    const int64_t n = d->cache_->FenceFreeBlocks(promised_ttl);
    spdlog::warn("kept memory whose writers are unknown: {} block(s) are fenced for the lease TTL ({}); new "
                 "requests wait for them", n, absl::FormatDuration(promised_ttl));
  }
  if (d->tiers_ != nullptr && adopted) {
    if (fenced_all) {
      d->restore_checkpoints_pending_ = true;  // once the fence is lifted (ReapLapsedLeases)
    } else {
      d->tiers_->RestoreCheckpoints();
    }
  }
  if (d->tiers_ != nullptr) {
    d->cache_->SetEvictionSink(d->tiers_.get());
    if (d->options_.cache.demote_reserve > 0) d->mover_ = std::make_unique<DemotionMover>(d->cache_.get());
  }
  if (d->options_.transfer.enabled()) {
    KVD_ASSIGN_OR_RETURN(d->transfer_, Transfer::Start(d->options_.transfer, d->cache_.get(), d->cache_.get(), d->arena_.get()));
  }
  d->workers_ = std::make_unique<AttachmentRegistry>(SystemClock::Get(), so.lease_ttl);
  // A successor binds the metrics address only once its predecessor has let it go (Start).
  KVD_ASSIGN_OR_RETURN(d->metrics_, Metrics::Start(received != nullptr ? "" : so.metrics_listen, d->cache_.get(),
                                                   [w = d->workers_.get()] { return static_cast<int64_t>(w->size()); },
                                                   d->arena_->backend(),
                                                   d->tiers_.get(), d->router_events_.get()));
  if (d->transfer_ != nullptr) d->metrics_->AddCollectable(d->transfer_->metrics_registry());
  KVD_RETURN_IF_ERROR(EnsureParentDir(so.side_socket));
  gid_t socket_gid = getegid();  // the sockets' group: socket_group, else kvd's own
  if (!so.socket_group.empty()) {
    KVD_ASSIGN_OR_RETURN(socket_gid, ResolveGroup(so.socket_group));
  }
  d->access_ = AccessPolicy(std::vector<uid_t>(so.allowed_uids.begin(), so.allowed_uids.end()),
                            std::vector<gid_t>(so.allowed_gids.begin(), so.allowed_gids.end()), socket_gid);
  KVD_ASSIGN_OR_RETURN(d->side_, SlabSideChannel::Start(so.side_socket, d->arena_.get(), d->workers_.get(),
                                                        &d->access_,
                                                        received != nullptr ? std::move(received->side_fd) : UniqueFd()));
  d->service_ = std::make_unique<KvdService>(d->cache_.get(), d->workers_.get(), d->arena_.get(),
                                             d->metrics_.get(), so.side_socket, so.lease_ttl,
                                             d->tiers_.get(), d->transfer_ != nullptr ? d->transfer_->puller() : nullptr);
  d->service_->set_on_serving([raw = d.get()](bool serving) {
    if (raw->server_ != nullptr) raw->server_->GetHealthCheckService()->SetServingStatus(serving);
  });

  const bool unix_socket = absl::StartsWith(so.listen, "unix://");
  if (unix_socket) KVD_RETURN_IF_ERROR(EnsureParentDir(so.listen.substr(7)));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // Connections that hold descriptors without working: idle ones are closed (clients reconnect
  // on their next call) and dead peers are found by keepalive pings.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                             static_cast<int>(absl::ToInt64Milliseconds(so.max_connection_idle)));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 30'000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10'000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  int port = 0;
  KVD_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> creds, ServerCredentials(so, unix_socket));
  if (unix_socket) {
    // kvd accepts on the socket itself, to know each connection's peer (PeerListener): the
    // allow-list, roles and worker ids bound to their process all need it.
    if (received != nullptr) {
      KVD_ASSIGN_OR_RETURN(d->peers_, PeerListener::Adopt(std::move(received->listen_fd)));
    } else {
      KVD_ASSIGN_OR_RETURN(d->peers_, PeerListener::Bind(so.listen.substr(7)));
      d->bound_listen_ = true;
    }
    d->service_->set_access(&d->access_, d->peers_.get());
  } else {
    builder.AddListeningPort(so.listen, creds, unix_socket ? nullptr : &port);
  }
  builder.SetMaxReceiveMessageSize(static_cast<int>(so.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(so.max_message_bytes));
  builder.RegisterService(d->service_.get());
  // With an allow-list, reflection answers only peers it admits; health answers everyone
  // (probes). Without one every peer that can open the 0660 socket is trusted, and the
  // interceptor, which costs every RPC (docs/performance.md), is left out.
  if (d->access_.enabled()) {
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(std::make_unique<AccessInterceptorFactory>(d->service_.get()));
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
  }
  // Create the socket file without world access from the start (no window before
  // the chmod below); umask is process-wide, and nothing else creates files during start-up.
  const mode_t old_umask = ::umask(0117);
  d->server_ = builder.BuildAndStart();
  ::umask(old_umask);
  if (d->server_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", so.listen));
  }
  // Step lanes once the service's access is set; before the first worker can attach.
  d->side_->set_lane_handler([svc = d->service_.get()](int fd, const PeerCredentials& peer, const std::string& worker,
                                                       const std::atomic<bool>& stop) {
    svc->ServeStepLane(fd, peer, worker, stop);
  });
  if (d->peers_ != nullptr) d->peers_->Start(d->server_.get());
  if (unix_socket) {
    // Only the daemon's user and group may connect; the side socket also checks SO_PEERCRED.
    ::chmod(so.listen.substr(7).c_str(), 0660);
    if (!so.socket_group.empty()) {
      KVD_ASSIGN_OR_RETURN(gid_t gid, ResolveGroup(so.socket_group));
      for (const std::string& path : {so.listen.substr(7), so.side_socket}) {
        if (::chown(path.c_str(), static_cast<uid_t>(-1), gid) != 0) {
          return absl::PermissionDeniedError(absl::StrCat("socket_group: chown ", path, ": ", std::strerror(errno)));
        }
      }
    }
  } else if (port > 0 && absl::EndsWith(so.listen, ":0")) {
    d->options_.server.listen = absl::StrCat(so.listen.substr(0, so.listen.size() - 1), port);
  }
  d->reaper_ = std::thread([raw = d.get()] { raw->ReapLapsedLeases(); });
  if (on_handoff != nullptr && !so.handoff_socket.empty() && d->peers_ != nullptr) {  // Unix listen only
    HandoffListener::Hooks hooks;
    hooks.check = [raw = d.get()](const HandoffHello& hello) {
      return CheckSuccessor(hello, raw->arena_->backend(), raw->arena_->slabs(), raw->options_.cache.pools);
    };
    hooks.stop = [raw = d.get()] { return raw->StopForHandoff(); };
    hooks.finished = std::move(on_handoff);
    KVD_ASSIGN_OR_RETURN(d->handoff_,
                         HandoffListener::Start(so.handoff_socket, std::move(hooks), /*successor=*/received != nullptr));
  }
  spdlog::info("kvd serving on {} (backend {}, {} pools, side socket {}, metrics port {})",
               d->options_.server.listen, d->arena_->backend(), d->options_.cache.pools.size(),
               so.side_socket, d->metrics_->port());
  return d;
}

void Daemon::ReapLapsedLeases() {
  const absl::Duration period =
      std::min(absl::Seconds(1), options_.server.lease_ttl / 4);
  while (!stop_reaper_.WaitForNotificationWithTimeout(period)) {
    for (const WorkerId& w : workers_->TakeLapsed()) service_->WorkerGone(w, "lease lapsed");
    LiftDueFences();
    if (tiers_ != nullptr && tiers_->idle_demotion()) {
      // Idle demotion: G1 blocks unused for idle_demote_after leave for G2 (KvCache::Gc evicts
      // them through the eviction sink), and G2's idle blocks go on to G3.
      cache_->Gc(tiers_->options().idle_demote_after);
      tiers_->DemoteIdle();
    }
  }
}

void Daemon::LiftDueFences() {
  const int64_t lifted = LiftFencesOfEndedWriters(*cache_);
  const int64_t still = cache_->ExpireFences();
  if (restore_checkpoints_pending_ && still == 0 && tiers_ != nullptr) {
    restore_checkpoints_pending_ = false;
    tiers_->RestoreCheckpoints();  // before waking admission: a resume waiting for room finds them
  }
  if (lifted > 0 || still != fenced_blocks_) service_->PokeAdmission();
  fenced_blocks_ = still;
}

absl::Status Daemon::Probe(absl::Duration timeout) const {
  (void)cache_->Report();
  if (!absl::StartsWith(options_.server.listen, "unix://")) return absl::OkStatus();
  auto stub = v1::Kvd::NewStub(grpc::CreateChannel(options_.server.listen, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
  v1::PingResponse resp;
  const grpc::Status s = stub->Ping(&ctx, v1::PingRequest(), &resp);
  if (!s.ok()) {
    return absl::UnavailableError(absl::StrCat("Ping through ", options_.server.listen, " failed: ", s.error_message()));
  }
  return absl::OkStatus();
}

void Daemon::StartDrain() { service_->StartDraining(); }

int64_t Daemon::Drain(absl::Duration timeout, const std::function<bool()>& interrupted) {
  absl::MutexLock lock(&lifecycle_mu_);
  if (handed_over_) return 0;  // a successor serves; nothing here to drain
  service_->StartDraining(/*final=*/true);
  const absl::Time deadline = SystemClock::Get()->Now() + timeout;
  int64_t live = cache_->Report().live_requests;
  while (live > 0 && SystemClock::Get()->Now() < deadline) {
    if (interrupted && interrupted()) {
      spdlog::warn("drain interrupted: stopping with {} requests live", live);
      return live;
    }
    absl::SleepFor(absl::Milliseconds(20));
    live = cache_->Report().live_requests;
  }
  spdlog::info("drained: {} requests still live", live);
  if (tiers_ != nullptr && !tiers_->options().disk_dir.empty() && tiers_->options().flush_on_drain) {
    absl::StatusOr<FlushResult> r = tiers_->Flush();
    if (r.ok() && r->durable) {
      spdlog::info("flushed on drain: {} records written, {} already durable, {:.3f}s",
                   r->written_blocks, r->already_durable, r->seconds);
    } else {
      spdlog::error("flush on drain is not durable: {}",
                    r.ok() ? r->error : std::string(r.status().message()));
    }
  }
  return live;
}

absl::StatusOr<HandoffOffer> Daemon::StopForHandoff() {
  absl::MutexLock lock(&lifecycle_mu_);
  handed_over_ = true;  // from here on the sockets are the successor's, whatever happens
  if (!stop_reaper_.HasBeenNotified()) stop_reaper_.Notify();
  if (reaper_.joinable()) reaper_.join();
  // Stop accepting; connections made from now on wait in the sockets' backlog for the successor.
  if (peers_ != nullptr) handed_listen_ = peers_->Release();
  handed_side_ = side_->Release();
  if (!handed_listen_.valid() || !handed_side_.valid()) {
    return absl::FailedPreconditionError("this kvd does not own its listening sockets (not a Unix listen address)");
  }
  // New work is refused (UNAVAILABLE: clients retry against the successor) and admission waits
  // end; calls in flight get 100 ms to finish, then are cancelled — Attach streams too, and
  // workers re-attach to the successor.
  service_->StartDraining(/*final=*/true);
  service_->BeginHandoff();  // the streams Shutdown cancels must not release what EndAllFenced fences
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  if (tiers_ != nullptr) tiers_->Quiesce();
  // Pulls in flight finish; the peer listener's port goes to the successor.
  transfer_.reset();
  HandoffOffer offer;
  // Live requests end as interrupted; what they owned stays fenced for their workers, which may
  // still be writing it, and crosses to the successor that way (kv_cache_fences.cc).
  offer.requests_ended = cache_->EndAllFenced(options_.server.lease_ttl, workers_->Pids());
  // The disk tier and the router events' ports go to the successor: close them before it opens
  // them. The metrics endpoint stays up (closing it takes civetweb half a second) but reads
  // nothing; the successor binds its address once this process has let it go (Start).
  metrics_->DetachSources();
  router_events_.reset();
  if (tiers_ != nullptr) {
    mover_.reset();
    cache_->SetEvictionSink(nullptr);
    tiers_.reset();  // finishes queued disk writes: the successor's Load reads a settled manifest
  }
  offer.listen_fd = handed_listen_.get();
  offer.side_fd = handed_side_.get();
  offer.slabs = arena_->slabs();
  offer.snapshot = cache_->ExportSnapshot();
  offer.snapshot.lease_ttl = options_.server.lease_ttl;
  handed_snapshot_ = offer.snapshot;
  spdlog::info("handoff: stopped; handing over {} cached block(s), {} slab(s); {} live request(s) ended",
               offer.snapshot.blocks.size(), offer.slabs.size(), offer.requests_ended);
  return offer;
}

Daemon::~Daemon() {
  // Dependency order: nothing is destroyed while something that calls into it still runs.
  handoff_.reset();  // waits for a handoff in progress
  if (!stop_reaper_.HasBeenNotified()) stop_reaper_.Notify();
  if (reaper_.joinable()) reaper_.join();
  peers_.reset();  // stop accepting first
  side_.reset();   // and cut the step lanes, which call into the service and the metrics
  if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  // Promotions, object reads and flushes finish RPCs from the store's threads: let them finish
  // while the server lives (Shutdown has stopped new calls).
  if (tiers_ != nullptr) tiers_->Quiesce();
  transfer_.reset();  // pulls finish their RPCs, peers' leases are released
  server_.reset();
  metrics_.reset();        // the exposer reads the tiers, the events publisher and the cache
  router_events_.reset();  // stops listening to the cache
  if (tiers_ != nullptr) {
    mover_.reset();
    cache_->SetEvictionSink(nullptr);
    tiers_.reset();  // finishes queued disk work while the cache and arena still live
  }
  bool handed_over = false;
  {
    absl::MutexLock lock(&lifecycle_mu_);
    handed_over = handed_over_;
  }
  if (absl::StartsWith(options_.server.listen, "unix://") && bound_listen_ && !handed_over && !adopted_sockets_) {
    std::error_code ec;
    std::filesystem::remove(options_.server.listen.substr(7), ec);
  }
}

}  // namespace kvd
