#include "server/transfer/peer_service.h"

#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <algorithm>
#include <memory>

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

constexpr int64_t kMaxLeaseMs = 60'000;

void ToProto(const PoolGeometry& g, peer::v1::Geometry* out) {
  out->set_block_tokens(g.block_tokens);
  out->set_num_layers(g.num_layers);
  out->set_bytes_per_token_per_layer(g.bytes_per_token_per_layer);
  out->set_capacity_blocks(g.capacity_blocks);
  out->set_num_shards(g.num_shards);
  out->set_layout(PoolLayoutName(g.layout));
  out->set_kv_dtype(g.kv.dtype);
  out->set_kv_heads(g.kv.kv_heads);
  out->set_head_dim(g.kv.head_dim);
  out->set_kv_arrangement(g.kv.arrangement);
  out->set_model_fingerprint(g.model_fingerprint);
  for (const KvGroup& k : g.groups) {
    peer::v1::GroupGeometry* o = out->add_groups();
    o->set_name(k.name);
    o->set_kind(KvGroupKindName(k.kind));
    o->mutable_layers()->Add(k.layers.begin(), k.layers.end());
    o->set_bytes_per_token(k.attention() ? (k.bytes_per_token != 0 ? k.bytes_per_token : g.bytes_per_token_per_layer) : 0);
    o->set_bytes_per_state(k.bytes_per_state);
    o->set_window(k.window);
    o->set_chunk(k.chunk);
    o->set_checkpoint_every_blocks(k.checkpoint_every_blocks);
    o->set_checkpoint_at_end(k.attention() ? false : k.checkpoint_at_end);
  }
}

std::string Asn1Text(const ASN1_STRING* s) {
  return std::string(reinterpret_cast<const char*>(ASN1_STRING_get0_data(s)), static_cast<size_t>(ASN1_STRING_length(s)));
}

}  // namespace

absl::StatusOr<std::vector<std::string>> PeerNames(const std::string& pem) {
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), BIO_free);
  if (bio == nullptr) return absl::ResourceExhaustedError("BIO_new_mem_buf");
  std::unique_ptr<X509, decltype(&X509_free)> cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr), X509_free);
  if (cert == nullptr) return absl::InvalidArgumentError("the peer's certificate is not PEM X.509");
  std::vector<std::string> dns, uris;
  std::unique_ptr<GENERAL_NAMES, void (*)(GENERAL_NAMES*)> sans(
      static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert.get(), NID_subject_alt_name, nullptr, nullptr)),
      [](GENERAL_NAMES* n) { GENERAL_NAMES_free(n); });
  for (int i = 0; sans != nullptr && i < sk_GENERAL_NAME_num(sans.get()); ++i) {
    const GENERAL_NAME* n = sk_GENERAL_NAME_value(sans.get(), i);
    if (n->type == GEN_DNS) dns.push_back(Asn1Text(n->d.dNSName));
    if (n->type == GEN_URI) uris.push_back(absl::StrCat("uri:", Asn1Text(n->d.uniformResourceIdentifier)));
  }
  // The CN names the holder only where the certificate has no subjectAltName of any kind (RFC
  // 6125 6.4.4 falls back to it without DNS names; kvd is stricter: a certificate that carries
  // identities of other kinds is not also named by its CN).
  if (sans == nullptr || sk_GENERAL_NAME_num(sans.get()) == 0) {
    const X509_NAME* subject = X509_get_subject_name(cert.get());
    for (int i = X509_NAME_get_index_by_NID(subject, NID_commonName, -1); i >= 0;
         i = X509_NAME_get_index_by_NID(subject, NID_commonName, i)) {
      dns.push_back(Asn1Text(X509_NAME_ENTRY_get_data(X509_NAME_get_entry(subject, i))));
    }
  }
  dns.insert(dns.end(), uris.begin(), uris.end());
  return dns;
}

PeerService::PeerService(TierPort* cache, PeerPort* units, const DeviceArena* arena, const TransferOptions& options,
                         TransferMetrics* metrics)
    : cache_(cache),
      units_(units),
      arena_(arena),
      options_(options),
      allowed_([&] {
        const std::vector<std::string> names = options.AllowedNames();
        return absl::flat_hash_set<std::string>(names.begin(), names.end());
      }()),
      metrics_(metrics) {
  reaper_ = std::thread([this] { ReapLoop(); });
}

PeerService::~PeerService() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  reaper_.join();
  Expire(/*all=*/true);
}

int64_t PeerService::leases() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(leases_.size());
}

absl::StatusOr<std::string> PeerService::Authenticate(const grpc::CallbackServerContext* ctx) const {
  // The names come from the verified certificate itself, not from gRPC's flattened properties
  // (which mix every subjectAltName kind with the CN).
  std::vector<std::string> names;
  if (const std::shared_ptr<const grpc::AuthContext> auth = ctx->auth_context(); auth != nullptr && auth->IsPeerAuthenticated()) {
    for (const grpc::string_ref& v : auth->FindPropertyValues("x509_pem_cert")) {
      absl::StatusOr<std::vector<std::string>> parsed = PeerNames(std::string(v.data(), v.size()));
      if (parsed.ok()) names.insert(names.end(), parsed->begin(), parsed->end());
    }
  }
  for (const std::string& n : names) {
    if (allowed_.contains(n)) return n;
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "this kvd serves peers named in transfer.allowed_peers only; the caller's certificate names ",
      names.empty() ? std::string("nobody") : absl::StrJoin(names, ", ")));
}

grpc::ServerUnaryReactor* PeerService::Offer(grpc::CallbackServerContext* ctx, const peer::v1::OfferRequest* req,
                                             peer::v1::OfferResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  Expire(/*all=*/false);
  absl::StatusOr<std::string> peer = Authenticate(ctx);
  absl::Status status = peer.ok() ? DoOffer(*peer, *req, resp) : peer.status();
  if (!peer.ok()) {
    metrics_->Offer("unauthenticated");
    spdlog::warn("peer transfer: refused an Offer from {}: {}", LogSafe(ctx->peer()), LogSafe(status.ToString(), 256));
  } else if (!status.ok()) {
    metrics_->Offer(absl::StatusCodeToString(status.code()));
  } else {
    metrics_->Offer(resp->blocks().empty() ? "nothing" : "offered", resp->blocks_size());
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

absl::Status PeerService::DoOffer(const std::string& peer, const peer::v1::OfferRequest& req,
                                  peer::v1::OfferResponse* resp) {
  if (req.tokens().empty()) return absl::InvalidArgumentError("tokens is empty");
  if (req.lease_ms() <= 0 || req.lease_ms() > kMaxLeaseMs) {
    return absl::InvalidArgumentError(absl::StrCat("lease_ms must be in (0, ", kMaxLeaseMs, "], not ", req.lease_ms()));
  }
  if (req.skip_blocks() < 0 || req.max_blocks() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("skip_blocks and max_blocks must be >= 0, not ", req.skip_blocks(),
                                                   " and ", req.max_blocks()));
  }
  const Namespace ns = FromProto(req.namespace_());
  const std::vector<PoolGeometry>& pools = cache_->pools();
  auto it = std::find_if(pools.begin(), pools.end(), [&](const PoolGeometry& g) { return g.name == ns.pool; });
  if (it == pools.end()) return absl::NotFoundError(absl::StrCat("no pool '", ns.pool, "' on this kvd"));
  const PoolId pool = static_cast<PoolId>(it - pools.begin());
  {
    absl::MutexLock lock(&mu_);
    if (static_cast<int64_t>(leases_.size()) + reserved_ >= options_.max_leases) {
      return absl::ResourceExhaustedError(absl::StrCat("this kvd holds ", options_.max_leases,
                                                       " leases for peers already (transfer.max_leases)"));
    }
    ++reserved_;
  }
  const std::vector<Token> tokens = TokensFromProto(req.tokens());
  // A hybrid pool's hit is a unit of every group's components (peer_port.h); other pools' a run
  // of blocks. Both are pinned, hashed and leased alike.
  int64_t depth = 0;
  absl::StatusOr<TierPort::PinnedPrefix> pinned = [&]() -> absl::StatusOr<TierPort::PinnedPrefix> {
    if (!it->hybrid()) return cache_->PinPrefix(ns, tokens, req.skip_blocks(), req.max_blocks());
    KVD_ASSIGN_OR_RETURN(PeerPort::PinnedUnit unit, units_->PinHybridUnit(ns, tokens, req.skip_blocks(), req.max_blocks()));
    depth = unit.depth;
    return TierPort::PinnedPrefix{unit.pool, std::move(unit.components), std::move(unit.serials)};
  }();
  std::vector<uint64_t> sums;
  if (pinned.ok() && !pinned->blocks.empty()) {
    // Kept checksums first; the rest are computed without any lock (the pins keep the bytes
    // immutable) and kept.
    const auto key = [pool](BlockIndex b) { return uint64_t{pool} << 32 | b; };
    sums.assign(pinned->blocks.size(), 0);
    std::vector<bool> known(pinned->blocks.size(), false);
    {
      absl::MutexLock lock(&sums_mu_);
      for (size_t i = 0; i < pinned->blocks.size(); ++i) {
        auto it = sums_.find(key(pinned->blocks[i]));
        // A serial 0 (a hybrid unit's window block or checkpoint) is hashed each time.
        if (it != sums_.end() && pinned->serials[i] != 0 && it->second.first == pinned->serials[i]) {
          sums[i] = it->second.second;
          known[i] = true;
        }
      }
    }
    std::vector<uint8_t> scratch;
    absl::Status hashed;
    for (size_t i = 0; i < pinned->blocks.size() && hashed.ok(); ++i) {
      if (known[i]) continue;
      absl::StatusOr<uint64_t> sum = BlockChecksum(*arena_, pool, pinned->blocks[i], &scratch);
      if (!sum.ok()) hashed = sum.status();
      else sums[i] = *sum;
    }
    if (!hashed.ok()) {
      cache_->UnpinBlocks(pool, pinned->blocks);
      pinned = hashed;
    } else {
      absl::MutexLock lock(&sums_mu_);
      for (size_t i = 0; i < pinned->blocks.size(); ++i) {
        if (!known[i] && pinned->serials[i] != 0) sums_[key(pinned->blocks[i])] = {pinned->serials[i], sums[i]};
      }
    }
  }
  absl::MutexLock lock(&mu_);
  --reserved_;
  KVD_RETURN_IF_ERROR(pinned.status());
  if (pinned->blocks.empty()) return absl::OkStatus();  // nothing cached past skip_blocks
  const uint64_t id = next_lease_++;
  resp->set_lease(id);
  resp->set_depth_blocks(depth);
  ToProto(pools[pool], resp->mutable_geometry());
  for (size_t i = 0; i < pinned->blocks.size(); ++i) {
    resp->add_blocks(pinned->blocks[i]);
    resp->add_checksums(sums[i]);
  }
  leases_[id] = Lease{pool, std::move(pinned->blocks), Clock::now() + std::chrono::milliseconds(req.lease_ms()), peer};
  metrics_->SetLeases(static_cast<int64_t>(leases_.size()));
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* PeerService::Read(grpc::CallbackServerContext* ctx, const peer::v1::ReadRequest* req,
                                            peer::v1::ReadResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<std::string> peer = Authenticate(ctx);
  absl::Status status = peer.ok() ? DoRead(*peer, *req, resp) : peer.status();
  if (!status.ok()) {
    resp->Clear();
    metrics_->Read(absl::StatusCodeToString(status.code()));
    spdlog::warn("peer transfer: refused a Read from {}: {}", LogSafe(ctx->peer()), LogSafe(status.ToString(), 256));
  } else {
    metrics_->Read("read", resp->blocks_size());
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

absl::Status PeerService::DoRead(const std::string& peer, const peer::v1::ReadRequest& req,
                                 peer::v1::ReadResponse* resp) {
  const auto not_found = [&] {
    return absl::NotFoundError(absl::StrCat("no lease ", req.lease(), " held by ", peer, " (released or expired)"));
  };
  PoolId pool = 0;
  std::vector<BlockIndex> blocks;
  {
    absl::MutexLock lock(&mu_);
    auto it = leases_.find(req.lease());
    // Another peer's lease is as unknown as none: nothing says it exists.
    if (it == leases_.end() || it->second.peer != peer || it->second.expires <= Clock::now()) return not_found();
    const int64_t held = static_cast<int64_t>(it->second.blocks.size());
    if (req.first() < 0 || req.first() >= held || req.count() <= 0) {
      return absl::OutOfRangeError(absl::StrCat("lease ", req.lease(), " holds blocks [0, ", held, "); first ",
                                                req.first(), " count ", req.count(), " is not among them"));
    }
    pool = it->second.pool;
    // Whole blocks (a hybrid unit's components, each its group's size) up to kMaxReadBytes, at
    // least one.
    const PoolGeometry& g = arena_->geometries()[pool];
    const int64_t last = std::min(held, req.first() + req.count());
    int64_t bytes = 0;
    for (int64_t i = req.first(); i < last; ++i) {
      const BlockIndex b = it->second.blocks[static_cast<size_t>(i)];
      bytes += UnitPartBytes(g, g.hybrid() ? g.GroupOf(b) : 0);
      if (bytes > kMaxReadBytes && i > req.first()) break;
      blocks.push_back(b);
    }
  }
  // The pins keep these blocks' bytes as they were cached while the lease holds; whether it held
  // throughout is checked after the copy.
  const PoolGeometry& g = arena_->geometries()[pool];
  for (BlockIndex b : blocks) {
    std::string* out = resp->add_blocks();
    out->resize(static_cast<size_t>(UnitPartBytes(g, g.hybrid() ? g.GroupOf(b) : 0)));
    KVD_RETURN_IF_ERROR(arena_->ReadBlock(pool, b, reinterpret_cast<uint8_t*>(out->data())));
  }
  // A lease released or expired during the copy may have had its blocks unpinned and reused:
  // then nothing read is answered. Unpinning follows the lease's removal from leases_, so a lease
  // still here now was pinned for the whole copy.
  absl::MutexLock lock(&mu_);
  if (!leases_.contains(req.lease())) return not_found();
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* PeerService::Release(grpc::CallbackServerContext* ctx, const peer::v1::ReleaseRequest* req,
                                               peer::v1::ReleaseResponse* /*resp*/) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<std::string> peer = Authenticate(ctx);
  if (!peer.ok()) {
    reactor->Finish(ToGrpcStatus(peer.status()));
    return reactor;
  }
  Lease lease;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    auto it = leases_.find(req->lease());
    // Only the peer that took a lease may release it.
    if (it == leases_.end() || it->second.peer != *peer) {
      status = absl::NotFoundError(absl::StrCat("no lease ", req->lease(), " held by ", *peer, " (released or expired)"));
    } else {
      lease = std::move(it->second);
      leases_.erase(it);
      metrics_->SetLeases(static_cast<int64_t>(leases_.size()));
    }
  }
  if (status.ok()) cache_->UnpinBlocks(lease.pool, lease.blocks);
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

void PeerService::Expire(bool all) {
  std::vector<Lease> gone;
  {
    absl::MutexLock lock(&mu_);
    const Clock::time_point now = Clock::now();
    for (auto it = leases_.begin(); it != leases_.end();) {
      if (all || it->second.expires <= now) {
        gone.push_back(std::move(it->second));
        leases_.erase(it++);
      } else {
        ++it;
      }
    }
    if (!gone.empty()) metrics_->SetLeases(static_cast<int64_t>(leases_.size()));
  }
  for (const Lease& l : gone) {
    if (!all) spdlog::info("peer transfer: a lease of {} blocks for {} expired unreleased", l.blocks.size(), LogSafe(l.peer));
    cache_->UnpinBlocks(l.pool, l.blocks);
  }
}

void PeerService::ReapLoop() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(200));
    if (stop_) break;
    mu_.Unlock();
    Expire(/*all=*/false);
    mu_.Lock();
  }
}

}  // namespace kvd
