#include "server/transfer/peer_puller.h"

#include <chrono>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gpu/slab_layout.h"
#include "proto/convert.h"
#include "proto/grpc_status.h"
#include "proto/vocab/status_macros.h"
#include "server/obs/log_safe.h"
#include "server/transfer/block_checksum.h"
#include "spdlog/spdlog.h"

namespace kvd {
namespace {

std::chrono::system_clock::time_point Chrono(absl::Time t) { return absl::ToChronoTime(t); }

// The most blocks one read spans: small enough that blocks complete (and are verified) while
// later reads are in flight, large enough that a read is megabytes on real geometries.
constexpr int64_t kChunkBlocks = 32;

// Reads per block: one per row (layer, on the layer-major layout) per shard.
int64_t local_rows_per_block(const SlabLayout& layout, const PoolGeometry& g) {
  return layout.Block(0).rows * g.num_shards;
}

template <typename T>
absl::Status Same(const char* field, const T& local, const T& offered) {
  if (local == offered) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("the peer's pool differs in ", field, ": ", offered, " there, ", local, " here"));
}

}  // namespace

absl::Status CheckOfferedGeometry(const PoolGeometry& g, const peer::v1::Geometry& o) {
  KVD_RETURN_IF_ERROR(Same("block_tokens", int64_t{g.block_tokens}, int64_t{o.block_tokens()}));
  KVD_RETURN_IF_ERROR(Same("num_layers", int64_t{g.num_layers}, int64_t{o.num_layers()}));
  KVD_RETURN_IF_ERROR(Same("bytes_per_token_per_layer", g.bytes_per_token_per_layer, o.bytes_per_token_per_layer()));
  KVD_RETURN_IF_ERROR(Same("capacity_blocks", g.capacity_blocks, o.capacity_blocks()));
  KVD_RETURN_IF_ERROR(Same("num_shards", int64_t{g.num_shards}, int64_t{o.num_shards()}));
  KVD_RETURN_IF_ERROR(Same("layout", PoolLayoutName(g.layout), o.layout()));
  KVD_RETURN_IF_ERROR(Same("kv.dtype", g.kv.dtype, o.kv_dtype()));
  KVD_RETURN_IF_ERROR(Same("kv.kv_heads", int64_t{g.kv.kv_heads}, int64_t{o.kv_heads()}));
  KVD_RETURN_IF_ERROR(Same("kv.head_dim", int64_t{g.kv.head_dim}, int64_t{o.head_dim()}));
  return Same("kv.arrangement", g.kv.arrangement, o.kv_arrangement());
}

PeerPuller::PeerPuller(const TransferOptions& options, TierPort* cache, const DeviceArena* arena, UcxNode* node,
                       TransferMetrics* metrics)
    : options_(options), cache_(cache), arena_(arena), node_(node), metrics_(metrics) {}

std::unique_ptr<PeerPuller> PeerPuller::Create(const TransferOptions& options, TierPort* cache,
                                                               const DeviceArena* arena, UcxNode* node,
                                                               TransferMetrics* metrics,
                                                               const grpc::SslCredentialsOptions& ssl) {
  std::unique_ptr<PeerPuller> p(new PeerPuller(options, cache, arena, node, metrics));
  for (const TransferPeer& peer : options.peers) {
    grpc::ChannelArguments args;
    // The peer is who its certificate says: its name, whatever address reaches it.
    args.SetSslTargetNameOverride(peer.name);
    p->peers_[peer.name].stub =
        peer::v1::Peer::NewStub(grpc::CreateCustomChannel(peer.address, grpc::SslCredentials(ssl), args));
  }
  p->pulls_ = std::make_unique<Executor>(static_cast<int>(options.pull_threads));
  return p;
}

PeerPuller::~PeerPuller() {
  stopping_.store(true);  // pulls still queued answer at once; those running finish
  pulls_.reset();
}

absl::Status PeerPuller::CheckPeer(const std::string& peer) const {
  if (peers_.contains(peer)) return absl::OkStatus();
  std::vector<std::string> names;
  for (const TransferPeer& p : options_.peers) names.push_back(p.name);
  return absl::InvalidArgumentError(absl::StrCat("peer '", LogSafe(peer), "' is not configured (transfer.peers: ",
                                                 names.empty() ? "none" : absl::StrJoin(names, ", "), ")"));
}

bool PeerPuller::Pull(const std::string& peer, const RequestId& id, const RequestSpec& spec, PoolId pool,
                      int64_t cached_tokens, std::vector<BlockIndex> table, PullDone done) {
  const int32_t bt = arena_->geometries()[pool].block_tokens;
  const int64_t max_blocks = (static_cast<int64_t>(spec.prompt.size()) - 1) / bt;  // leave one token to compute
  if (cached_tokens / bt >= max_blocks || !peers_.contains(peer)) return false;
  pulls_->Submit([this, peer, id, spec, pool, cached_tokens, table = std::move(table), done = std::move(done)] {
    const absl::Time start = absl::Now();
    std::string cause = "offer";
    absl::StatusOr<int64_t> r = stopping_.load()
                                    ? absl::StatusOr<int64_t>(absl::UnavailableError("kvd is stopping"))
                                    : RunPull(peer, id, spec, pool, cached_tokens, table, &cause);
    metrics_->Pull(cause);
    if (r.ok() && *r > cached_tokens) {
      const int64_t blocks = (*r - cached_tokens) / arena_->geometries()[pool].block_tokens;
      metrics_->Pulled(blocks, blocks * arena_->geometries()[pool].block_bytes_all_shards(),
                       absl::ToDoubleSeconds(absl::Now() - start));
    } else if (!r.ok()) {
      spdlog::warn("peer transfer: pull of request {} from {} failed ({}): {}; its worker computes those blocks",
                   LogSafe(id.value()), LogSafe(peer), cause, LogSafe(r.status().ToString(), 256));
    }
    done(std::move(r));
  });
  return true;
}

absl::StatusOr<int64_t> PeerPuller::RunPull(const std::string& peer, const RequestId& id, const RequestSpec& spec,
                                            PoolId pool, int64_t cached_tokens, const std::vector<BlockIndex>& table,
                                            std::string* cause) {
  const absl::Time deadline = absl::Now() + options_.pull_timeout;
  const PoolGeometry& g = arena_->geometries()[pool];
  const int32_t bt = g.block_tokens;
  const int64_t skip = cached_tokens / bt;
  const int64_t want = (static_cast<int64_t>(spec.prompt.size()) - 1) / bt - skip;
  *cause = "offer";
  KVD_RETURN_IF_ERROR(node_->Transferable(pool));
  peer::v1::Peer::Stub* stub = peers_.at(peer).stub.get();

  peer::v1::OfferRequest req;
  ToProto(spec.ns, req.mutable_namespace_());
  for (Token t : spec.prompt) req.add_tokens(t);
  req.set_skip_blocks(skip);
  req.set_max_blocks(want);
  req.set_lease_ms(absl::ToInt64Milliseconds(options_.lease));
  peer::v1::OfferResponse offer;
  const absl::Time started = absl::Now();
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Chrono(deadline));
    grpc::Status s = stub->Offer(&ctx, req, &offer);
    if (!s.ok()) return absl::Status(FromGrpcStatus(s).code(), absl::StrCat("Offer: ", s.error_message()));
  }
  // Whatever happens next, the peer's lease goes back (or expires if the peer cannot be reached).
  auto release = [&] {
    if (offer.lease() == 0) return;
    grpc::ClientContext ctx;
    ctx.set_deadline(Chrono(absl::Now() + absl::Seconds(2)));
    peer::v1::ReleaseRequest rel;
    rel.set_lease(offer.lease());
    peer::v1::ReleaseResponse ignored;
    (void)stub->Release(&ctx, rel, &ignored);
  };
  const int64_t n = offer.blocks_size();
  if (n == 0) {
    *cause = "nothing";
    return cached_tokens;
  }
  // Everything the peer answered is checked before any read: what this kvd writes, and where, it
  // computes from its own geometry and the request's own blocks alone.
  absl::Status valid = [&]() -> absl::Status {
    *cause = "geometry";
    KVD_RETURN_IF_ERROR(CheckOfferedGeometry(g, offer.geometry()));
    *cause = "bounds";
    if (n > want || offer.checksums_size() != n) {
      return absl::OutOfRangeError(absl::StrCat("the peer offered ", n, " blocks with ", offer.checksums_size(),
                                                " checksums for at most ", want, " blocks asked"));
    }
    if (skip + n > static_cast<int64_t>(table.size())) {
      return absl::OutOfRangeError(absl::StrCat("the request's table holds ", table.size(), " blocks, not ", skip + n));
    }
    for (uint32_t b : offer.blocks()) {
      if (b >= g.capacity_blocks) {
        return absl::OutOfRangeError(absl::StrCat("the peer offered block ", b, ", past the pool's ", g.capacity_blocks));
      }
    }
    const int64_t slab_bytes = SlabLayout(g).slab_bytes();
    if (offer.slabs_size() != g.num_shards) {
      return absl::OutOfRangeError(absl::StrCat("the peer offered ", offer.slabs_size(), " slabs for ", g.num_shards, " shards"));
    }
    for (int i = 0; i < offer.slabs_size(); ++i) {
      const peer::v1::Slab& s = offer.slabs(i);
      if (s.shard() != static_cast<uint32_t>(i) || s.size_bytes() != slab_bytes || s.rkey().empty()) {
        return absl::OutOfRangeError(absl::StrCat("the peer's slab ", i, " is shard ", s.shard(), " of ", s.size_bytes(),
                                                  " bytes with a ", s.rkey().size(), "-byte key; expected shard ", i,
                                                  " of ", slab_bytes, " bytes"));
      }
    }
    if (offer.ucx_address().empty()) return absl::InvalidArgumentError("the peer sent no UCX address");
    return absl::OkStatus();
  }();
  if (!valid.ok()) {
    release();
    return valid;
  }

  const std::vector<BlockIndex> targets(table.begin() + skip, table.begin() + skip + n);
  if (absl::Status pinned = cache_->PinBlocks(id, targets); !pinned.ok()) {
    *cause = "request_gone";
    release();
    return pinned;
  }
  // One read per row of each run of blocks consecutive on both sides: a row of block b+1 follows
  // the same row of block b in either layout (gpu/slab_layout.h). Runs are cut at kChunkBlocks so
  // that blocks complete, and are verified, while later ones are still in flight.
  const SlabLayout layout(g);
  std::vector<UcxNode::Read> reads;
  std::vector<std::pair<int64_t, int64_t>> read_blocks;  // per read: its first block and count
  std::vector<std::string> rkeys;
  for (const peer::v1::Slab& s : offer.slabs()) rkeys.push_back(s.rkey());
  for (int64_t i = 0; i < n;) {
    int64_t run = 1;
    while (i + run < n && run < kChunkBlocks &&
           offer.blocks(static_cast<int>(i + run)) == offer.blocks(static_cast<int>(i + run - 1)) + 1 &&
           targets[i + run] == targets[i + run - 1] + 1) {
      ++run;
    }
    const StridedBlock remote = layout.Block(offer.blocks(static_cast<int>(i)));
    const StridedBlock local = layout.Block(targets[i]);
    for (uint32_t shard = 0; shard < static_cast<uint32_t>(g.num_shards); ++shard) {
      for (int64_t row = 0; row < local.rows; ++row) {
        reads.push_back(UcxNode::Read{
            shard, node_->local_base(pool, shard) + local.slab_offset + row * local.slab_pitch,
            offer.slabs(static_cast<int>(shard)).address() + static_cast<uint64_t>(remote.slab_offset + row * remote.slab_pitch),
            run * local.row_bytes});
        read_blocks.emplace_back(i, run);
      }
    }
    i += run;
  }
  // Each block is verified as soon as its last row lands; the first mismatch ends the transfer.
  std::vector<int64_t> rows_left(static_cast<size_t>(n), local_rows_per_block(layout, g));
  std::vector<uint8_t> scratch;
  int64_t verified_blocks = 0;
  auto verify = [&](size_t read) -> absl::Status {
    const auto [first, count] = read_blocks[read];
    for (int64_t i = first; i < first + count; ++i) {
      if (--rows_left[static_cast<size_t>(i)] != 0) continue;
      KVD_ASSIGN_OR_RETURN(uint64_t sum, BlockChecksum(*arena_, pool, targets[i], &scratch));
      if (sum != offer.checksums(static_cast<int>(i))) {
        return absl::DataLossError(absl::StrCat("block ", skip + i, " of the prompt (peer block ",
                                                offer.blocks(static_cast<int>(i)), ") fails its checksum"));
      }
      ++verified_blocks;
    }
    return absl::OkStatus();
  };
  const absl::Time offered = absl::Now();
  absl::Status got = node_->Get(offer.ucx_address(), pool, rkeys, reads, deadline, verify);
  const absl::Time read = absl::Now();
  release();  // the bytes are here (or will never be): the peer's pins can go
  if (absl::IsInternal(got)) {
    // Reads may still land: these blocks stay pinned for good rather than be handed to anyone.
    spdlog::error("peer transfer: {}; {} blocks of pool '{}' are kept out of use", got.ToString(), n, g.name);
    *cause = "transfer";
    return got;
  }
  absl::Status verified = got;
  if (absl::IsDataLoss(got)) {
    *cause = "checksum";
  } else if (!got.ok()) {
    *cause = absl::IsDeadlineExceeded(got) ? "timeout" : absl::IsInvalidArgument(got) ? "remote_key" : "transfer";
  } else if (verified_blocks != n) {  // every read completed, so every block was checked
    *cause = "checksum";
    verified = absl::InternalError(absl::StrCat(verified_blocks, " of ", n, " pulled blocks were verified"));
  }
  if (verified.ok()) {
    *cause = "request_gone";
    verified = cache_->AdoptPromoted(id, (skip + n) * bt);
    if (verified.ok()) *cause = "pulled";
  }
  cache_->UnpinBlocks(pool, targets);
  if (!verified.ok()) return verified;
  spdlog::debug("peer transfer: pulled {} blocks ({} MiB, {} reads) of request {} from {}: offer {} ms, reads and "
                "checksums {} ms, publish and release {} ms", n, n * g.block_bytes_all_shards() >> 20, reads.size(),
                LogSafe(id.value()), LogSafe(peer), absl::ToInt64Milliseconds(offered - started),
                absl::ToInt64Milliseconds(read - offered), absl::ToInt64Milliseconds(absl::Now() - read));
  return (skip + n) * bt;
}

}  // namespace kvd
