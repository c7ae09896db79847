#include "server/transfer/peer_puller.h"

#include <xxhash.h>

#include <chrono>
#include <deque>
#include <functional>
#include <memory>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gpu/slab_layout.h"
#include "proto/convert.h"
#include "proto/grpc_status.h"
#include "proto/vocab/status_macros.h"
#include "server/obs/log_safe.h"
#include "server/transfer/peer_service.h"
#include "spdlog/spdlog.h"

namespace kvd {
namespace {

// A gRPC deadline for a monotonic one: the time left, from now on the wall clock.
std::chrono::system_clock::time_point GrpcDeadline(std::chrono::steady_clock::time_point deadline) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(deadline - std::chrono::steady_clock::now());
}

template <typename T>
absl::Status Same(const char* field, const T& local, const T& offered) {
  if (local == offered) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("the peer's pool differs in ", field, ": ", offered, " there, ", local, " here"));
}

// Reads blocks [0, n) of `lease` from the peer, up to kReadsInFlight Reads of `per_read` blocks
// in flight, and hands each answer to `take` on this thread, in order, while later ones are on the
// wire. An answer shorter than asked is followed by a Read of the rest before anything later is
// taken. On any error (a Read's, or take's) the Reads still in flight are cancelled and waited
// for: when this returns, no callback refers to anything of the caller's.
constexpr int kReadsInFlight = 4;

absl::Status ReadLease(peer::v1::Peer::Stub* stub, uint64_t lease, int64_t n, int64_t per_read,
                       std::chrono::steady_clock::time_point deadline,
                       const std::function<absl::Status(const peer::v1::ReadResponse&)>& take, std::string* cause,
                       int64_t* reads) {
  struct Read {
    int64_t first = 0;
    int64_t count = 0;
    grpc::ClientContext ctx;
    peer::v1::ReadRequest req;
    peer::v1::ReadResponse resp;
    grpc::Status status;
    bool done = false;
  };
  // Shared with the callbacks, which may outlive this frame by a moment only as far as mu's own
  // unlock: the state is freed by whichever of them lets go of it last.
  struct State {
    absl::Mutex mu;
  };
  auto state = std::make_shared<State>();
  std::deque<std::unique_ptr<Read>> flight;
  auto issue = [&](int64_t first, int64_t count) {
    auto r = std::make_unique<Read>();
    r->first = first;
    r->count = count;
    r->ctx.set_deadline(GrpcDeadline(deadline));
    r->req.set_lease(lease);
    r->req.set_first(first);
    r->req.set_count(count);
    Read* raw = r.get();
    flight.push_back(std::move(r));
    ++*reads;
    stub->async()->Read(&raw->ctx, &raw->req, &raw->resp, [state, raw](grpc::Status s) {
      absl::MutexLock lock(&state->mu);
      raw->status = std::move(s);
      raw->done = true;
    });
  };
  auto wait = [&](Read* r) {
    absl::MutexLock lock(&state->mu);
    state->mu.Await(absl::Condition(&r->done));
  };
  absl::Status result;
  int64_t next = 0;
  while (result.ok() && (next < n || !flight.empty())) {
    while (next < n && static_cast<int>(flight.size()) < kReadsInFlight) {
      const int64_t count = std::min(per_read, n - next);
      issue(next, count);
      next += count;
    }
    std::unique_ptr<Read> r = std::move(flight.front());
    flight.pop_front();
    wait(r.get());
    int64_t first = r->first;
    int64_t left = r->count;
    while (result.ok() && left > 0) {
      if (!r->status.ok()) {
        *cause = r->status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ? "timeout" : "transfer";
        result = absl::Status(FromGrpcStatus(r->status).code(), absl::StrCat("Read: ", r->status.error_message()));
        break;
      }
      const int64_t got = r->resp.blocks_size();
      if (got == 0 || got > left) {
        *cause = "bounds";
        result = absl::OutOfRangeError(
            absl::StrCat("the peer answered ", got, " blocks for blocks [", first, ", ", first + left, ")"));
        break;
      }
      result = take(r->resp);
      first += got;
      left -= got;
      if (result.ok() && left > 0) {  // a short answer: the rest of it before anything later
        r = std::make_unique<Read>();
        r->ctx.set_deadline(GrpcDeadline(deadline));
        r->req.set_lease(lease);
        r->req.set_first(first);
        r->req.set_count(left);
        ++*reads;
        r->status = stub->Read(&r->ctx, r->req, &r->resp);
      }
    }
  }
  for (auto& r : flight) r->ctx.TryCancel();
  for (auto& r : flight) wait(r.get());
  return result;
}

}  // namespace

absl::Status CheckOfferedGeometry(const PoolGeometry& g, const peer::v1::Geometry& o) {
  KVD_RETURN_IF_ERROR(Same("model_fingerprint", absl::StrCat("'", g.model_fingerprint, "'"), absl::StrCat("'", o.model_fingerprint(), "'")));
  KVD_RETURN_IF_ERROR(Same("block_tokens", int64_t{g.block_tokens}, int64_t{o.block_tokens()}));
  KVD_RETURN_IF_ERROR(Same("num_layers", int64_t{g.num_layers}, int64_t{o.num_layers()}));
  KVD_RETURN_IF_ERROR(Same("bytes_per_token_per_layer", g.bytes_per_token_per_layer, o.bytes_per_token_per_layer()));
  // A hybrid pool's capacity is its groups' split, which may differ between nodes: its units'
  // meaning is in the groups compared below.
  if (!g.hybrid()) KVD_RETURN_IF_ERROR(Same("capacity_blocks", g.capacity_blocks, o.capacity_blocks()));
  KVD_RETURN_IF_ERROR(Same("num_shards", int64_t{g.num_shards}, int64_t{o.num_shards()}));
  KVD_RETURN_IF_ERROR(Same("layout", PoolLayoutName(g.layout), o.layout()));
  KVD_RETURN_IF_ERROR(Same("kv.dtype", g.kv.dtype, o.kv_dtype()));
  KVD_RETURN_IF_ERROR(Same("kv.kv_heads", int64_t{g.kv.kv_heads}, int64_t{o.kv_heads()}));
  KVD_RETURN_IF_ERROR(Same("kv.head_dim", int64_t{g.kv.head_dim}, int64_t{o.head_dim()}));
  KVD_RETURN_IF_ERROR(Same("kv.arrangement", g.kv.arrangement, o.kv_arrangement()));
  // A hybrid pool's groups, one by one: what every unit means (docs/hybrid.md §2.9, "peers").
  if (static_cast<int>(g.groups.size()) != o.groups_size()) {
    std::vector<std::string> there;
    for (const peer::v1::GroupGeometry& k : o.groups()) there.push_back(k.name());
    std::vector<std::string> here;
    for (const KvGroup& k : g.groups) here.push_back(k.name);
    return absl::FailedPreconditionError(absl::StrCat("the peer's pool differs in its KV groups: [",
                                                      absl::StrJoin(there, ", "), "] there, [",
                                                      absl::StrJoin(here, ", "), "] here"));
  }
  for (int i = 0; i < o.groups_size(); ++i) {
    const KvGroup& k = g.groups[static_cast<size_t>(i)];
    const peer::v1::GroupGeometry& x = o.groups(i);
    const auto field = [&](const char* name) { return absl::StrCat("group '", k.name, "' (groups[", i, "]) field ", name); };
    const auto same = [&](const char* name, const auto& here, const auto& there) {
      return Same(field(name).c_str(), here, there);
    };
    const int64_t bytes_per_token = k.attention() ? (k.bytes_per_token != 0 ? k.bytes_per_token : g.bytes_per_token_per_layer) : 0;
    KVD_RETURN_IF_ERROR(same("name", absl::StrCat("'", k.name, "'"), absl::StrCat("'", x.name(), "'")));
    KVD_RETURN_IF_ERROR(same("kind", KvGroupKindName(k.kind), x.kind()));
    KVD_RETURN_IF_ERROR(same("layers", absl::StrJoin(k.layers, ","), absl::StrJoin(x.layers(), ",")));
    KVD_RETURN_IF_ERROR(same("bytes_per_token", bytes_per_token, x.bytes_per_token()));
    KVD_RETURN_IF_ERROR(same("bytes_per_state", k.bytes_per_state, x.bytes_per_state()));
    KVD_RETURN_IF_ERROR(same("window", int64_t{k.window}, int64_t{x.window()}));
    KVD_RETURN_IF_ERROR(same("chunk", int64_t{k.chunk}, int64_t{x.chunk()}));
    KVD_RETURN_IF_ERROR(same("checkpoint_every_blocks", int64_t{k.checkpoint_every_blocks},
                             int64_t{x.checkpoint_every_blocks()}));
    KVD_RETURN_IF_ERROR(same("checkpoint_at_end", std::string(!k.attention() && k.checkpoint_at_end ? "true" : "false"),
                             std::string(x.checkpoint_at_end() ? "true" : "false")));
  }
  return absl::OkStatus();
}

PeerPuller::PeerPuller(const TransferOptions& options, TierPort* cache, PeerPort* units, const DeviceArena* arena,
                       TransferMetrics* metrics)
    : options_(options), cache_(cache), units_(units), arena_(arena), metrics_(metrics) {}

std::unique_ptr<PeerPuller> PeerPuller::Create(const TransferOptions& options, TierPort* cache, PeerPort* units,
                                               const DeviceArena* arena, TransferMetrics* metrics,
                                               const grpc::SslCredentialsOptions& ssl) {
  std::unique_ptr<PeerPuller> p(new PeerPuller(options, cache, units, arena, metrics));
  // A Read answers up to PeerService::kMaxReadBytes, or one block (component) where it is larger.
  int64_t largest = PeerService::kMaxReadBytes;
  for (const PoolGeometry& g : arena->geometries()) largest = std::max(largest, LargestUnitBytes(g));
  for (const TransferPeer& peer : options.peers) {
    grpc::ChannelArguments args;
    // The peer is who its certificate says: its name, whatever address reaches it.
    args.SetSslTargetNameOverride(peer.name);
    args.SetMaxReceiveMessageSize(static_cast<int>(std::min<int64_t>(largest + (1 << 20), INT32_MAX)));
    Channel& c = p->peers_[peer.name];
    c.stub = peer::v1::Peer::NewStub(grpc::CreateCustomChannel(peer.address, grpc::SslCredentials(ssl), args));
    c.pulls = std::make_unique<Executor>(static_cast<int>(options.pull_threads));
  }
  return p;
}

PeerPuller::~PeerPuller() {
  stopping_.store(true);  // pulls still queued answer at once; those running finish
  for (auto& [name, c] : peers_) c.pulls.reset();
}

absl::Status PeerPuller::CheckPeer(const std::string& peer) const {
  if (peers_.contains(peer)) return absl::OkStatus();
  std::vector<std::string> names;
  for (const TransferPeer& p : options_.peers) names.push_back(p.name);
  return absl::InvalidArgumentError(absl::StrCat("peer '", LogSafe(peer), "' is not configured (transfer.peers: ",
                                                 names.empty() ? "none" : absl::StrJoin(names, ", "), ")"));
}

void PeerPuller::ReleaseLater(peer::v1::Peer::Stub* stub, uint64_t lease) {
  if (lease == 0) return;
  struct Call {
    grpc::ClientContext ctx;
    peer::v1::ReleaseRequest req;
    peer::v1::ReleaseResponse resp;
  };
  auto* call = new Call;
  call->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  call->req.set_lease(lease);
  stub->async()->Release(&call->ctx, &call->req, &call->resp, [call](grpc::Status) { delete call; });
}

bool PeerPuller::Pull(const std::string& peer, const RequestId& id, const RequestSpec& spec, PoolId pool,
                      int64_t cached_tokens, std::vector<BlockIndex> table, PullDone done) {
  const int32_t bt = arena_->geometries()[pool].block_tokens;
  const int64_t max_blocks = (static_cast<int64_t>(spec.prompt.size()) - 1) / bt;  // leave one token to compute
  auto it = peers_.find(peer);
  if (cached_tokens / bt >= max_blocks || it == peers_.end()) return false;
  Channel& channel = it->second;
  // The deadline counts from here: time queued behind other pulls is part of it.
  const Clock::time_point deadline = Clock::now() + absl::ToChronoNanoseconds(options_.pull_timeout);
  if (channel.pulls->pending() >= options_.pull_threads + kQueuedPerPeer) {
    metrics_->Pull("shed");
    spdlog::warn("peer transfer: pull of request {} from {} shed: {} pulls from that peer are queued already",
                 LogSafe(id.value()), LogSafe(peer), kQueuedPerPeer);
    done(absl::ResourceExhaustedError(absl::StrCat("peer ", peer, " has ", kQueuedPerPeer, " pulls queued")));
    return true;
  }
  peer::v1::Peer::Stub* stub = channel.stub.get();
  channel.pulls->Submit([this, stub, peer, id, spec, pool, cached_tokens, deadline, table = std::move(table),
                         done = std::move(done)] {
    const Clock::time_point start = Clock::now();
    std::string cause = "timeout";
    uint64_t lease = 0;
    absl::StatusOr<int64_t> r =
        stopping_.load()       ? absl::StatusOr<int64_t>(absl::UnavailableError("kvd is stopping"))
        : start >= deadline    ? absl::StatusOr<int64_t>(absl::DeadlineExceededError("the pull waited its whole deadline in the queue"))
                               : RunPull(stub, id, spec, pool, cached_tokens, table, deadline, &cause, &lease);
    if (stopping_.load() && !r.ok()) cause = "offer";
    metrics_->Pull(cause);
    if (r.ok() && *r > cached_tokens) {
      const int64_t blocks = (*r - cached_tokens) / arena_->geometries()[pool].block_tokens;
      // A hybrid pool's unit: its components' bytes (every group's units it carried).
      const PoolGeometry& g = arena_->geometries()[pool];
      int64_t bytes = blocks * g.block_bytes_all_shards();
      if (g.hybrid()) {
        bytes = 0;
        for (const UnitPart& part : UnitLayout(g, cached_tokens / g.block_tokens, *r / g.block_tokens)) {
          bytes += UnitPartBytes(g, part.group);
        }
      }
      metrics_->Pulled(blocks, bytes,
                       std::chrono::duration<double>(Clock::now() - start).count());
    } else if (!r.ok()) {
      spdlog::warn("peer transfer: pull of request {} from {} failed ({}): {}; its worker computes those blocks",
                   LogSafe(id.value()), LogSafe(peer), cause, LogSafe(r.status().ToString(), 256));
    }
    done(std::move(r));
    // After the answer: a peer that does not answer Release costs the request nothing.
    ReleaseLater(stub, lease);
  });
  return true;
}

absl::StatusOr<int64_t> PeerPuller::RunPull(peer::v1::Peer::Stub* stub, const RequestId& id, const RequestSpec& spec,
                                            PoolId pool, int64_t cached_tokens, const std::vector<BlockIndex>& table,
                                            Clock::time_point deadline, std::string* cause, uint64_t* lease) {
  const PoolGeometry& g = arena_->geometries()[pool];
  const int32_t bt = g.block_tokens;
  const int64_t skip = cached_tokens / bt;
  int64_t want = (static_cast<int64_t>(spec.prompt.size()) - 1) / bt - skip;
  const int64_t block_bytes = g.block_bytes_all_shards();
  *cause = "offer";
  if (g.hybrid()) {
    // Only a fresh acquire of a hybrid pool with a full group takes a unit.
    absl::StatusOr<int64_t> horizon = units_->PullHorizon(id);
    if (!horizon.ok()) {
      *cause = "request_gone";
      return horizon.status();
    }
    want = *horizon - skip;
    if (want <= 0) {
      *cause = "nothing";
      return cached_tokens;
    }
  }

  peer::v1::OfferRequest req;
  ToProto(spec.ns, req.mutable_namespace_());
  for (Token t : spec.prompt) req.add_tokens(t);
  req.set_skip_blocks(skip);
  req.set_max_blocks(want);
  req.set_lease_ms(absl::ToInt64Milliseconds(options_.lease));
  peer::v1::OfferResponse offer;
  const Clock::time_point started = Clock::now();
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(GrpcDeadline(deadline));
    grpc::Status s = stub->Offer(&ctx, req, &offer);
    *lease = offer.lease();
    if (!s.ok()) {
      if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) *cause = "timeout";
      return absl::Status(FromGrpcStatus(s).code(), absl::StrCat("Offer: ", s.error_message()));
    }
  }
  const int64_t n = offer.checksums_size();
  if (n == 0 && offer.blocks_size() == 0) {
    *cause = "nothing";
    return cached_tokens;
  }
  // Everything the peer answered is checked before anything is read: what this kvd writes, and
  // where, it computes from its own geometry and the request's own blocks alone.
  *cause = "geometry";
  KVD_RETURN_IF_ERROR(CheckOfferedGeometry(g, offer.geometry()));
  if (g.hybrid()) return PullUnit(stub, id, pool, skip, want, offer, deadline, cause);
  *cause = "bounds";
  if (n > want || offer.blocks_size() != n) {
    return absl::OutOfRangeError(absl::StrCat("the peer offered ", offer.blocks_size(), " blocks with ", n,
                                              " checksums for at most ", want, " blocks asked"));
  }
  if (skip + n > static_cast<int64_t>(table.size())) {
    return absl::OutOfRangeError(absl::StrCat("the request's table holds ", table.size(), " blocks, not ", skip + n));
  }

  const std::vector<BlockIndex> targets(table.begin() + skip, table.begin() + skip + n);
  if (absl::Status pinned = cache_->PinBlocks(id, targets); !pinned.ok()) {
    *cause = "request_gone";
    return pinned;
  }
  // Read answers whole blocks in order; each is checked (size, checksum) before a byte of it is
  // written into the request's own block, so a wrong answer changes nothing here.
  const Clock::time_point offered = Clock::now();
  int64_t done = 0;
  int64_t reads = 0;
  // Each block is checked (size, checksum) before a byte of it is written into the request's own
  // block, so a wrong answer changes nothing here.
  auto take = [&](const peer::v1::ReadResponse& data) -> absl::Status {
    for (const std::string& bytes : data.blocks()) {
      if (static_cast<int64_t>(bytes.size()) != block_bytes) {
        *cause = "bounds";
        return absl::OutOfRangeError(absl::StrCat("the peer answered block ", skip + done, " of the prompt with ",
                                                  bytes.size(), " bytes, not ", block_bytes));
      }
      if (XXH3_64bits(bytes.data(), bytes.size()) != offer.checksums(static_cast<int>(done))) {
        *cause = "checksum";
        return absl::DataLossError(absl::StrCat("block ", skip + done, " of the prompt (peer block ",
                                                offer.blocks(static_cast<int>(done)), ") fails its checksum"));
      }
      *cause = "transfer";
      KVD_RETURN_IF_ERROR(arena_->WriteBlock(pool, targets[done], reinterpret_cast<const uint8_t*>(bytes.data())));
      ++done;
    }
    return absl::OkStatus();
  };
  const int64_t per_read = std::max<int64_t>(1, PeerService::kMaxReadBytes / block_bytes);
  absl::Status got = ReadLease(stub, offer.lease(), n, per_read, deadline, take, cause, &reads);
  const Clock::time_point read = Clock::now();
  if (got.ok()) {
    *cause = "request_gone";
    got = cache_->AdoptPromoted(id, (skip + n) * bt);
    if (got.ok()) *cause = "pulled";
  }
  cache_->UnpinBlocks(pool, targets);
  if (!got.ok()) return got;
  using Ms = std::chrono::milliseconds;
  spdlog::debug("peer transfer: pulled {} blocks ({} MiB, {} reads) of request {}: offer {} ms, reads and "
                "checksums {} ms, publish {} ms", n, n * block_bytes >> 20, reads, LogSafe(id.value()),
                std::chrono::duration_cast<Ms>(offered - started).count(),
                std::chrono::duration_cast<Ms>(read - offered).count(),
                std::chrono::duration_cast<Ms>(Clock::now() - read).count());
  return (skip + n) * bt;
}

absl::StatusOr<int64_t> PeerPuller::PullUnit(peer::v1::Peer::Stub* stub, const RequestId& id, PoolId pool,
                                              int64_t skip, int64_t want, const peer::v1::OfferResponse& offer,
                                              Clock::time_point deadline, std::string* cause) {
  const PoolGeometry& g = arena_->geometries()[pool];
  const int32_t bt = g.block_tokens;
  // Which components come, and where each goes, follow from this node's geometry and the offered
  // depth alone (UnitLayout); the peer's answers supply bytes, each checked before it is written.
  *cause = "bounds";
  const int64_t d = offer.depth_blocks();
  if (d <= skip || d > skip + want) {
    return absl::OutOfRangeError(absl::StrCat("the peer offered a unit of depth ", d, " past block ", skip,
                                              " for at most ", skip + want));
  }
  const std::vector<UnitPart> layout = UnitLayout(g, skip, d);
  const int64_t n = static_cast<int64_t>(layout.size());
  if (offer.checksums_size() != n || offer.blocks_size() != n) {
    return absl::OutOfRangeError(absl::StrCat("the peer offered ", offer.blocks_size(), " components with ",
                                              offer.checksums_size(), " checksums for a unit of depth ", d,
                                              " past block ", skip, ", which has ", n));
  }
  absl::StatusOr<PeerPort::UnitTargets> targets = units_->PinUnitTargets(id, d);
  if (!targets.ok()) {
    *cause = "request_gone";
    return targets.status();
  }
  int64_t done = 0;
  int64_t reads = 0;
  auto take = [&](const peer::v1::ReadResponse& data) -> absl::Status {
    for (const std::string& bytes : data.blocks()) {
      const UnitPart& part = layout[static_cast<size_t>(done)];
      const std::string& group = g.groups[static_cast<size_t>(part.group)].name;
      const int64_t expected = UnitPartBytes(g, part.group);
      if (static_cast<int64_t>(bytes.size()) != expected) {
        *cause = "bounds";
        return absl::OutOfRangeError(absl::StrCat("the peer answered group '", group, "''s component at block ",
                                                  part.position, " with ", bytes.size(), " bytes, not ", expected));
      }
      if (XXH3_64bits(bytes.data(), bytes.size()) != offer.checksums(static_cast<int>(done))) {
        *cause = "checksum";
        return absl::DataLossError(absl::StrCat("group '", group, "''s component at block ", part.position,
                                                " (peer unit ", offer.blocks(static_cast<int>(done)),
                                                ") fails its checksum"));
      }
      *cause = "transfer";
      KVD_RETURN_IF_ERROR(arena_->WriteBlock(pool, targets->blocks[static_cast<size_t>(done)],
                                             reinterpret_cast<const uint8_t*>(bytes.data())));
      ++done;
    }
    return absl::OkStatus();
  };
  const int64_t per_read = std::max<int64_t>(1, PeerService::kMaxReadBytes / LargestUnitBytes(g));
  absl::Status got = ReadLease(stub, offer.lease(), n, per_read, deadline, take, cause, &reads);
  // Published as one unit with its checkpoints, or not at all (the request stays at its hit); the
  // targets are unpinned either way.
  absl::Status adopted = units_->FinishUnitPull(id, pool, d, *targets, /*written=*/got.ok());
  if (!got.ok()) return got;
  if (!adopted.ok()) {
    *cause = "request_gone";
    return adopted;
  }
  *cause = "pulled";
  spdlog::debug("peer transfer: pulled a unit of {} components ({} reads) of request {}: blocks [{}, {})", n, reads,
                LogSafe(id.value()), skip, d);
  return d * bt;
}

int64_t LargestUnitBytes(const PoolGeometry& g) {
  int64_t largest = g.hybrid() ? 0 : g.block_bytes_all_shards();
  for (int i = 0; i < static_cast<int>(g.groups.size()); ++i) largest = std::max(largest, UnitPartBytes(g, i));
  return largest;
}

}  // namespace kvd
