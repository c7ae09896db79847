#include "server/handoff.h"

#include <fcntl.h>
#include <signal.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gpu/fd_passing.h"
#include "server/obs/process_stats.h"
#include "gpu/slab_layout.h"
#include "kvd/handoff/v1/handoff.pb.h"
#include "proto/convert.h"
#include "proto/vocab/status_macros.h"
#include "server/build_info.h"
#include "server/slab_fd_store.h"
#include "spdlog/spdlog.h"

namespace kvd {
namespace {

namespace pb = ::kvd::handoff::v1;

// Small messages (Hello, Answer, Package, Done); the snapshot travels in a memfd.
constexpr size_t kMaxMessageBytes = size_t{1} << 20;
// SCM_MAX_FD: the most descriptors one message may carry (two sockets and the snapshot besides).
constexpr size_t kMaxFds = 253;
constexpr int kHelloTimeoutSeconds = 10;
// The successor loads the disk tier's headers before it serves: give it time.
constexpr int kDoneTimeoutSeconds = 300;

void SetReceiveTimeout(int fd, int seconds) {
  timeval tv{seconds, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
}

absl::Status SendProto(int fd, const google::protobuf::MessageLite& m, absl::Span<const int> fds = {}) {
  return SendMessage(fd, m.SerializeAsString(), fds);
}

template <typename M>
absl::StatusOr<M> ReceiveProto(int fd, std::vector<UniqueFd>* fds = nullptr) {
  absl::StatusOr<ReceivedMessage> msg = ReceiveMessage(fd, kMaxMessageBytes, fds != nullptr ? kMaxFds : 0);
  if (!msg.ok()) return msg.status();
  M m;
  if (!m.ParseFromString(msg->payload)) {
    return absl::InvalidArgumentError(absl::StrCat("not a handoff ", m.GetTypeName(), " message"));
  }
  if (fds != nullptr) *fds = std::move(msg->fds);
  return m;
}

void ToProto(const CacheSnapshot& in, pb::Snapshot* out) {
  for (const Namespace& ns : in.namespaces) ::kvd::ToProto(ns, out->add_namespaces());
  out->mutable_blocks()->Reserve(static_cast<int>(in.blocks.size()));
  for (const CacheSnapshot::Block& b : in.blocks) {
    pb::Block* p = out->add_blocks();
    p->set_pool(b.pool);
    p->set_index(b.index);
    p->set_parent(b.parent);
    p->set_ns(b.ns);
    p->set_last_use(b.last_use);
    p->set_reused(b.reused);
    p->mutable_tokens()->Add(b.tokens.begin(), b.tokens.end());
    p->mutable_components()->Add(b.components.begin(), b.components.end());
    p->set_tail_checkpoints(b.tail_checkpoints);
  }
  for (const CacheSnapshot::Session& s : in.sessions) {
    pb::Session* p = out->add_sessions();
    p->set_id(s.id.value());
    p->set_worker(s.worker.value());
    if (s.salt.has_value()) p->set_cache_salt(*s.salt);
    for (int64_t b : s.protected_blocks) p->add_protected_blocks(b);
    p->set_expires_unix_ns(absl::ToUnixNanos(s.expires_at));
  }
  for (const CacheSnapshot::Checkpoint& c : in.checkpoints) {
    pb::Checkpoint* p = out->add_checkpoints();
    p->set_id(c.id.value());
    p->set_ns(c.ns);
    p->mutable_tokens()->Add(c.tokens.begin(), c.tokens.end());
    p->set_engine_state(c.engine_state);
    p->mutable_blocks()->Add(c.blocks.begin(), c.blocks.end());
    p->mutable_cached()->Add(c.cached.begin(), c.cached.end());
    p->set_expires_unix_ns(absl::ToUnixNanos(c.expires_at));
    for (const CacheSnapshot::Checkpoint::Group& g : c.groups) {
      pb::CheckpointGroup* pg = p->add_groups();
      pg->set_first_block_position(g.first);
      pg->mutable_blocks()->Add(g.blocks.begin(), g.blocks.end());
      for (bool cached : g.cached) pg->add_cached(cached);
      if (g.slot != CacheSnapshot::kNoComponent) pg->set_slot(g.slot);
    }
  }
  for (const CacheSnapshot::Fence& f : in.fences) {
    pb::Fence* p = out->add_fences();
    p->set_pid(f.pid);
    p->set_pool(f.pool);
    p->mutable_blocks()->Add(f.blocks.begin(), f.blocks.end());
    p->set_until_unix_ns(absl::ToUnixNanos(absl::Now() + f.remaining));
    p->set_attachment(f.attachment.value());
    p->set_remaining_ns(absl::ToInt64Nanoseconds(f.remaining));
  }
  out->set_fences_known(in.fences_known);
  out->set_lease_ttl_ms(absl::ToInt64Milliseconds(in.lease_ttl));
}

CacheSnapshot FromProto(const pb::Snapshot& in) {
  CacheSnapshot out;
  for (const v1::Namespace& n : in.namespaces()) out.namespaces.push_back(::kvd::FromProto(n));
  out.blocks.reserve(in.blocks_size());
  for (const pb::Block& p : in.blocks()) {
    CacheSnapshot::Block& b = out.blocks.emplace_back();
    b.pool = p.pool();
    b.index = p.index();
    b.parent = p.parent();
    b.ns = p.ns();
    b.last_use = p.last_use();
    b.reused = p.reused();
    b.tokens.assign(p.tokens().begin(), p.tokens().end());
    b.components.assign(p.components().begin(), p.components().end());
    b.tail_checkpoints = p.tail_checkpoints();
  }
  for (const pb::Session& p : in.sessions()) {
    CacheSnapshot::Session& s = out.sessions.emplace_back();
    s.id = SessionId(p.id());
    if (p.has_cache_salt()) s.salt = p.cache_salt();
    s.worker = WorkerId(p.worker());
    s.protected_blocks.assign(p.protected_blocks().begin(), p.protected_blocks().end());
    s.expires_at = absl::FromUnixNanos(p.expires_unix_ns());
  }
  for (const pb::Checkpoint& p : in.checkpoints()) {
    CacheSnapshot::Checkpoint& c = out.checkpoints.emplace_back();
    c.id = RequestId(p.id());
    c.ns = p.ns();
    c.tokens.assign(p.tokens().begin(), p.tokens().end());
    c.engine_state = p.engine_state();
    c.blocks.assign(p.blocks().begin(), p.blocks().end());
    c.cached.assign(p.cached().begin(), p.cached().end());
    c.expires_at = absl::FromUnixNanos(p.expires_unix_ns());
    for (const pb::CheckpointGroup& pg : p.groups()) {
      CacheSnapshot::Checkpoint::Group& g = c.groups.emplace_back();
      g.first = pg.first_block_position();
      g.blocks.assign(pg.blocks().begin(), pg.blocks().end());
      g.cached.assign(pg.cached().begin(), pg.cached().end());
      if (pg.has_slot()) g.slot = pg.slot();
    }
  }
  for (const pb::Fence& p : in.fences()) {
    CacheSnapshot::Fence& f = out.fences.emplace_back();
    f.pid = p.pid();
    f.pool = p.pool();
    f.blocks.assign(p.blocks().begin(), p.blocks().end());
    f.attachment = WorkerId(p.attachment());
    // An older predecessor sends its wall-clock deadline only: the best this process can read of it.
    f.remaining = p.remaining_ns() > 0 ? absl::Nanoseconds(p.remaining_ns())
                                       : absl::FromUnixNanos(p.until_unix_ns()) - absl::Now();
  }
  out.fences_known = in.fences_known();
  out.lease_ttl = absl::Milliseconds(in.lease_ttl_ms());
  return out;
}

// The snapshot, serialized into a sealed memfd (it may be far larger than a socket message).
absl::StatusOr<std::pair<UniqueFd, int64_t>> SnapshotMemfd(const CacheSnapshot& snapshot) {
  pb::Snapshot p;
  ToProto(snapshot, &p);
  const std::string bytes = p.SerializeAsString();
  UniqueFd fd(::memfd_create("kvd-handoff-snapshot", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return absl::InternalError(absl::StrCat("memfd_create: ", std::strerror(errno)));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd.get(), bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return absl::InternalError(absl::StrCat("writing the snapshot: ", std::strerror(errno)));
    done += static_cast<size_t>(w);
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0) {
    return absl::InternalError(absl::StrCat("sealing the snapshot: ", std::strerror(errno)));
  }
  return std::make_pair(std::move(fd), static_cast<int64_t>(bytes.size()));
}

absl::StatusOr<CacheSnapshot> ReadSnapshot(int fd, int64_t expected) {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size != expected || expected < 0) {
    return absl::InvalidArgumentError(absl::StrCat("the snapshot is not the ", expected, " bytes announced"));
  }
  if (expected == 0) return CacheSnapshot{};
  void* p = ::mmap(nullptr, static_cast<size_t>(expected), PROT_READ, MAP_PRIVATE, fd, 0);
  if (p == MAP_FAILED) return absl::InternalError(absl::StrCat("mmap of the snapshot: ", std::strerror(errno)));
  pb::Snapshot s;
  const bool parsed = s.ParseFromArray(p, static_cast<int>(expected));
  ::munmap(p, static_cast<size_t>(expected));
  if (!parsed) return absl::InvalidArgumentError("the snapshot does not parse");
  return FromProto(s);
}

}  // namespace

void HandoffFaultPoint(const char* step) {
  const char* fault = std::getenv("KVD_TEST_HANDOFF_FAULT");
  if (fault != nullptr && std::strcmp(fault, step) == 0) {
    spdlog::warn("KVD_TEST_HANDOFF_FAULT: killed at {}", step);
    ::kill(::getpid(), SIGKILL);
  }
}

std::string DescribePools(const std::vector<PoolGeometry>& pools) {
  std::vector<std::string> lines;
  for (const PoolGeometry& g : pools) {
    lines.push_back(absl::StrCat(g.name, ": ", g.block_tokens, "-token blocks, ", g.num_layers, " layers, ",
                                 g.bytes_per_token_per_layer, " B/token/layer, ", g.capacity_blocks, " blocks, ",
                                 g.num_shards, " shard(s), ", PoolLayoutName(g.layout),
                                 g.model_fingerprint.empty() ? "" : absl::StrCat(", model_fingerprint '", g.model_fingerprint, "'")));
  }
  return absl::StrJoin(lines, "; ");
}

HandoffHello MakeHello(const std::vector<PoolGeometry>& pools, const std::string& backend) {
  HandoffHello h;
  for (PoolId p = 0; p < pools.size(); ++p) {
    const int64_t bytes = SlabLayout(pools[p]).slab_bytes();
    for (int32_t shard = 0; shard < pools[p].num_shards; ++shard) {
      h.slabs.push_back(SlabFdName(pools[p], p, static_cast<uint32_t>(shard), bytes));
    }
  }
  h.build = BuildInfo();
  h.pools = DescribePools(pools);
  h.backend = backend;
  return h;
}

absl::Status CheckSuccessor(const HandoffHello& hello, const std::string& backend,
                            const std::vector<SlabDescriptor>& slabs, const std::vector<PoolGeometry>& pools) {
  if (hello.protocol != kHandoffProtocol) {
    return absl::FailedPreconditionError(absl::StrCat("handoff protocol ", hello.protocol, " (", hello.build,
                                                      ") differs from this kvd's ", kHandoffProtocol,
                                                      ": restart instead of handing over"));
  }
  if (backend != "host") {
    for (const SlabDescriptor& d : slabs) {
      if (!d.cuda_vmm || d.fd < 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "pool '", pools[d.pool].name, "' is cudaMalloc memory (allocator ipc), which cannot be handed to "
            "another process: restart instead, or configure allocator: vmm"));
      }
    }
  }
  if ((backend == "host" && hello.backend == "cuda") || (backend == "cuda" && hello.backend == "host")) {
    return absl::FailedPreconditionError(absl::StrCat("this kvd's memory is ", backend, ", the new one is configured for ",
                                                      hello.backend, ": restart instead"));
  }
  std::vector<std::string> mine;
  for (const SlabDescriptor& d : slabs) {
    mine.push_back(SlabFdName(pools[d.pool], d.pool, d.shard, SlabLayout(pools[d.pool]).slab_bytes()));
  }
  if (mine != hello.slabs) {
    return absl::FailedPreconditionError(absl::StrCat("the pools differ: this kvd has [", DescribePools(pools),
                                                      "], the new one [", hello.pools,
                                                      "]; a changed pool needs a restart"));
  }
  if (mine.size() + 3 > kMaxFds) {
    return absl::FailedPreconditionError(absl::StrCat(mine.size(), " slabs are more than one handoff carries (",
                                                      kMaxFds - 3, ")"));
  }
  return absl::OkStatus();
}

// ---- the running kvd's end ----

absl::StatusOr<std::unique_ptr<HandoffListener>> HandoffListener::Start(const std::string& path, Hooks hooks,
                                                                        bool successor) {
  absl::StatusOr<UniqueFd> fd = ListenUnix(path, 0600, successor);
  if (!fd.ok()) return fd.status();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return absl::InternalError(absl::StrCat("stat ", path, ": ", std::strerror(errno)));
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return absl::InternalError("pipe2 failed");
  return std::unique_ptr<HandoffListener>(new HandoffListener(path, std::move(*fd), UniqueFd(pipe_fds[0]),
                                                              UniqueFd(pipe_fds[1]), std::move(hooks), st.st_ino));
}

HandoffListener::HandoffListener(std::string path, UniqueFd listen_fd, UniqueFd wake_read, UniqueFd wake_write,
                                 Hooks hooks, uint64_t inode)
    : path_(std::move(path)),
      listen_fd_(std::move(listen_fd)),
      wake_read_(std::move(wake_read)),
      wake_write_(std::move(wake_write)),
      hooks_(std::move(hooks)),
      inode_(inode) {
  thread_ = std::thread([this] { Loop(); });
}

HandoffListener::~HandoffListener() {
  const char b = 'x';
  (void)!::write(wake_write_.get(), &b, 1);
  if (thread_.joinable()) thread_.join();
  struct stat st {};
  if (::stat(path_.c_str(), &st) == 0 && st.st_ino == inode_) ::unlink(path_.c_str());
}

void HandoffListener::Loop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_.get(), POLLIN, 0}, {wake_read_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("handoff socket: poll failed: {}", std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    UniqueFd conn(::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!conn.valid()) continue;
    if (Serve(conn.get())) return;  // handed over (or stopped trying): no second successor
  }
}

bool HandoffListener::Serve(int conn) {
  absl::StatusOr<PeerCredentials> peer = GetPeerCredentials(conn);
  if (!peer.ok() || (peer->uid != ::geteuid() && peer->uid != 0)) {
    spdlog::warn("handoff socket: refused a peer that is neither kvd's user nor root (uid {})",
                 peer.ok() ? static_cast<int64_t>(peer->uid) : -1);
    return false;
  }
  SetReceiveTimeout(conn, kHelloTimeoutSeconds);
  absl::StatusOr<pb::Hello> hello_pb = ReceiveProto<pb::Hello>(conn);
  pb::Answer answer;
  answer.set_build(BuildInfo());
  if (!hello_pb.ok()) {
    spdlog::warn("handoff socket: pid {} sent no valid Hello ({}); still serving", peer->pid,
                 hello_pb.status().ToString());
    answer.set_error(absl::StrCat("expected a Hello: ", hello_pb.status().message()));
    (void)SendProto(conn, answer);
    return false;
  }
  HandoffHello hello;
  hello.protocol = hello_pb->protocol();
  hello.build = hello_pb->build();
  hello.slabs.assign(hello_pb->slabs().begin(), hello_pb->slabs().end());
  hello.pools = hello_pb->pools();
  hello.backend = hello_pb->backend();
  if (absl::Status ok = hooks_.check(hello); !ok.ok()) {
    spdlog::warn("handoff: refused pid {} ({}): {}; still serving", peer->pid, hello.build, std::string(ok.message()));
    answer.set_error(std::string(ok.message()));
    (void)SendProto(conn, answer);
    return false;
  }
  answer.set_ok(true);
  if (absl::Status s = SendProto(conn, answer); !s.ok()) {
    spdlog::warn("handoff: pid {} left before the answer ({}); still serving", peer->pid, s.ToString());
    return false;
  }
  HandoffFaultPoint("after-answer");
  spdlog::warn("handoff: handing over to pid {} ({}): stopping", peer->pid, hello.build);
  absl::StatusOr<HandoffOffer> offer = hooks_.stop();
  const auto finish = [this](absl::Status s, HandoffNext next) {
    hooks_.finished(std::move(s), next);
    return true;
  };
  if (!offer.ok()) return finish(offer.status(), HandoffNext::kResumeWithIndex);
  HandoffFaultPoint("after-stop");
  absl::StatusOr<std::pair<UniqueFd, int64_t>> snapshot = SnapshotMemfd(offer->snapshot);
  if (!snapshot.ok()) return finish(snapshot.status(), HandoffNext::kResumeWithIndex);
  pb::Package package;
  std::vector<int> fds = {offer->listen_fd, offer->side_fd, snapshot->first.get()};
  for (const SlabDescriptor& d : offer->slabs) {
    pb::Slab* s = package.add_slabs();
    s->set_pool(d.pool);
    s->set_shard(d.shard);
    s->set_size_bytes(d.size_bytes);
    s->set_memory_id(d.memory_id);
    fds.push_back(d.fd);
  }
  package.set_snapshot_bytes(snapshot->second);
  package.set_requests_ended(offer->requests_ended);
  // A package that did not go out whole is unusable to the successor (the payload is read only
  // after its descriptors): the memory is still only this kvd's.
  if (absl::Status s = SendProto(conn, package, fds); !s.ok()) return finish(s, HandoffNext::kResumeWithIndex);
  HandoffFaultPoint("after-package");
  SetReceiveTimeout(conn, kDoneTimeoutSeconds);
  absl::StatusOr<pb::Done> done = ReceiveProto<pb::Done>(conn);
  if (!done.ok()) {
    // Gone (crashed, killed) — or alive and silent, which may mean serving: only the first may
    // be resumed from.
    bool gone = ProcessGone(peer->pid);
    for (int i = 0; i < 20 && !gone; ++i) {  // a dying process closes its sockets before it is gone
      ::usleep(50'000);
      gone = ProcessGone(peer->pid);
    }
    return finish(absl::UnavailableError(absl::StrCat("the new kvd (pid ", peer->pid, ") did not confirm: ",
                                                      done.status().message(), gone ? "; it is gone" : "; it still runs")),
                  gone ? HandoffNext::kResumeEmpty : HandoffNext::kExit);
  }
  if (!done->ok()) {
    return finish(absl::AbortedError(absl::StrCat("the new kvd failed to start: ", done->error())),
                  HandoffNext::kResumeEmpty);
  }
  return finish(absl::OkStatus(), HandoffNext::kExit);
}

// ---- the successor's end ----

absl::StatusOr<HandoffSession> HandoffSession::Connect(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) return absl::InvalidArgumentError(absl::StrCat("socket path too long: ", path));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (errno == ENOENT || errno == ECONNREFUSED) {
      return absl::NotFoundError(absl::StrCat("no kvd listens on ", path));
    }
    return absl::UnavailableError(absl::StrCat("connect ", path, ": ", std::strerror(errno)));
  }
  absl::StatusOr<PeerCredentials> peer = GetPeerCredentials(fd.get());
  // Only kvd's own user (or root) hands over memory and sockets: another user's process bound to
  // the handoff path would feed this kvd whatever it likes.
  if (!peer.ok() || (peer->uid != ::geteuid() && peer->uid != 0)) {
    return absl::PermissionDeniedError(absl::StrCat("the process on ", path, " runs as uid ",
                                                    peer.ok() ? std::to_string(peer->uid) : "?", ", not kvd's (",
                                                    ::geteuid(), ") or root: no handoff from it"));
  }
  return HandoffSession(std::move(fd), peer->pid);
}

namespace {

// INVALID_ARGUMENT unless `fd` is a listening stream socket of `family`.
absl::Status CheckListening(int fd, int family, const char* what) {
  const auto option = [fd](int name) {
    int value = -1;
    socklen_t n = sizeof(value);
    return ::getsockopt(fd, SOL_SOCKET, name, &value, &n) == 0 ? value : -1;
  };
  if (option(SO_ACCEPTCONN) != 1 || option(SO_DOMAIN) != family || option(SO_TYPE) != SOCK_STREAM) {
    return absl::InvalidArgumentError(absl::StrCat("the handed-over ", what, " is not a listening Unix stream socket"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<HandoffReceived> HandoffSession::Take(const HandoffHello& hello) {
  pb::Hello h;
  h.set_protocol(hello.protocol);
  h.set_build(hello.build);
  for (const std::string& s : hello.slabs) h.add_slabs(s);
  h.set_pools(hello.pools);
  h.set_backend(hello.backend);
  SetReceiveTimeout(fd_.get(), kHelloTimeoutSeconds);
  if (absl::Status s = SendProto(fd_.get(), h); !s.ok()) return s;
  HandoffFaultPoint("after-hello");
  absl::StatusOr<pb::Answer> answer = ReceiveProto<pb::Answer>(fd_.get());
  if (!answer.ok()) return answer.status();
  if (!answer->ok()) {
    return absl::FailedPreconditionError(absl::StrCat("the running kvd (", answer->build(),
                                                      ") refused the handoff: ", answer->error()));
  }
  // The old kvd now shuts its server down and quiesces its disk tier: allow it the time.
  SetReceiveTimeout(fd_.get(), kDoneTimeoutSeconds);
  std::vector<UniqueFd> fds;
  absl::StatusOr<pb::Package> package = ReceiveProto<pb::Package>(fd_.get(), &fds);
  if (!package.ok()) return package.status();
  if (fds.size() != 3 + static_cast<size_t>(package->slabs_size())) {
    return absl::InvalidArgumentError(absl::StrCat("the package carries ", fds.size(), " descriptors for ",
                                                   package->slabs_size(), " slabs"));
  }
  KVD_RETURN_IF_ERROR(CheckListening(fds[0].get(), AF_UNIX, "gRPC socket"));
  KVD_RETURN_IF_ERROR(CheckListening(fds[1].get(), AF_UNIX, "side socket"));
  // The snapshot must be immutable before it is read: sealed against writes and resizing.
  constexpr int kSnapshotSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE;
  if (const int seals = ::fcntl(fds[2].get(), F_GET_SEALS); seals < 0 || (seals & kSnapshotSeals) != kSnapshotSeals) {
    return absl::InvalidArgumentError("the handed-over snapshot is not a sealed memfd");
  }
  HandoffReceived out;
  out.listen_fd = std::move(fds[0]);
  out.side_fd = std::move(fds[1]);
  out.old_build = answer->build();
  out.requests_ended = package->requests_ended();
  KVD_ASSIGN_OR_RETURN(out.snapshot, ReadSnapshot(fds[2].get(), package->snapshot_bytes()));
  HandoffFaultPoint("after-package");
  for (int i = 0; i < package->slabs_size(); ++i) {
    out.slabs.push_back({package->slabs(i).pool(), package->slabs(i).shard(), std::move(fds[3 + i]),
                         package->slabs(i).memory_id()});
  }
  return out;
}

bool HandoffSession::PeerGone() const { return ProcessGone(peer_); }

void HandoffSession::Finish(const absl::Status& serving) {
  HandoffFaultPoint("before-done");
  pb::Done done;
  done.set_ok(serving.ok());
  done.set_error(std::string(serving.message()));
  (void)SendProto(fd_.get(), done);
  fd_.Reset();
}

}  // namespace kvd
