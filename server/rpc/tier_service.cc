// KvdService: the tier RPCs (Flush, Close, Prefetch, idle demotion, saved prefixes, objects).
// Anything that touches the disk finishes later, from the tier store's threads.
#include <memory>

#include "absl/strings/str_cat.h"
#include "proto/convert.h"
#include "proto/vocab/status_macros.h"
#include "server/rpc/kvd_service_unary.h"

namespace kvd {
namespace {

// Writes precomputed batches, then finishes. Deletes itself when done.
class BatchWriter final : public grpc::ServerWriteReactor<v1::SavedPrefixBatch> {
 public:
  BatchWriter(std::vector<v1::SavedPrefixBatch> batches, const absl::Status& status)
      : batches_(std::move(batches)), status_(status) {
    Next();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the reader went away"));
      return;
    }
    Next();
  }
  void OnDone() override { delete this; }

 private:
  void Next() {
    if (!status_.ok() || next_ == batches_.size()) {
      Finish(ToGrpcStatus(status_));
      return;
    }
    StartWrite(&batches_[next_++]);
  }
  std::vector<v1::SavedPrefixBatch> batches_;
  size_t next_ = 0;
  absl::Status status_;
};

constexpr size_t kPrefixesPerBatch = 256;

}  // namespace

absl::Status KvdService::RequireTiers(bool disk) const {
  if (tiers_ == nullptr) {
    return absl::FailedPreconditionError("kvd runs without tiers (configure tiers.host_bytes or tiers.disk_dir)");
  }
  if (disk && tiers_->options().disk_dir.empty()) {
    return absl::FailedPreconditionError("kvd runs without a disk tier (tiers.disk_dir)");
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* KvdService::Flush(grpc::CallbackServerContext* ctx,
                                            const v1::FlushRequest*, v1::FlushResponse* resp) {
  const auto start = std::chrono::steady_clock::now();
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::Status s = Authorize(ctx, "Flush");
  if (s.ok()) s = RequireTiers(/*disk=*/true);
  if (s.ok()) {
    s = tiers_->FlushAsync([this, reactor, resp, start](FlushResult r) {
      ToProto(r, resp);
      FinishRpc(reactor, "Flush", start, absl::OkStatus());
    });
  }
  if (!s.ok()) FinishRpc(reactor, "Flush", start, s);
  return reactor;
}

grpc::ServerUnaryReactor* KvdService::Close(grpc::CallbackServerContext* ctx,
                                            const v1::CloseRequest*, v1::CloseResponse* resp) {
  const auto start = std::chrono::steady_clock::now();
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const auto clear = [this, resp] {
    resp->set_cleared_blocks(cache_->ClearCache());
    if (tiers_ != nullptr) tiers_->DropMemory();
  };
  absl::Status s = Authorize(ctx, "Close");
  if (s.ok()) s = RequireTiers(/*disk=*/false);
  if (s.ok()) {
    if (const int64_t live = cache_->Report().live_requests; live > 0) {
      s = absl::FailedPreconditionError(absl::StrCat(live, " requests are live: Close needs every request ended (drain first)"));
    }
  }
  if (s.ok() && !tiers_->options().disk_dir.empty()) {
    s = tiers_->FlushAsync([this, reactor, resp, start, clear](FlushResult r) {
      ToProto(r, resp->mutable_flush());
      clear();  // even when the flush failed: Close ends the cache's life in memory
      FinishRpc(reactor, "Close", start, absl::OkStatus());
    });
    if (s.ok()) return reactor;
  } else if (s.ok()) {
    clear();
  }
  FinishRpc(reactor, "Close", start, s);
  return reactor;
}

grpc::ServerUnaryReactor* KvdService::Prefetch(grpc::CallbackServerContext* ctx,
                                               const v1::PrefetchRequest* req,
                                               v1::PrefetchResponse* resp) {
  const auto start = std::chrono::steady_clock::now();
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const auto answer = [resp](const PrefetchInfo& info) {
    resp->set_handle(info.handle);
    resp->set_found_blocks(info.found_blocks);
    resp->set_loading_blocks(info.loading_blocks);
  };
  absl::Status s = Authorize(ctx, "Prefetch");
  if (s.ok()) s = RequireTiers(false);
  if (s.ok()) s = CheckWorker(ctx, req->worker_id(), "").status();
  if (s.ok() && req->tokens().empty()) s = absl::InvalidArgumentError("tokens are required");
  if (s.ok()) {
    const Namespace ns = FromProto(req->namespace_());
    const std::vector<Token> tokens = TokensFromProto(req->tokens());
    const WorkerId owner(req->worker_id());
    // A hybrid pool's units go up into G1 (off this thread); the answer waits for them.
    absl::StatusOr<bool> units = tiers_->PrefetchUnits(ns, tokens, owner, [this, reactor, start, answer](PrefetchInfo info) {
      answer(info);
      FinishRpc(reactor, "Prefetch", start, absl::OkStatus());
    });
    if (units.ok() && *units) return reactor;
    s = units.status();
    if (s.ok()) {
      absl::StatusOr<PrefetchInfo> info = tiers_->Prefetch(ns, tokens, owner);
      s = info.status();
      if (s.ok()) answer(*info);
    }
  }
  FinishRpc(reactor, "Prefetch", start, s);
  return reactor;
}

grpc::ServerUnaryReactor* KvdService::ReleasePrefetch(grpc::CallbackServerContext* ctx,
                                                      const v1::ReleasePrefetchRequest* req,
                                                      v1::ReleasePrefetchResponse*) {
  return Unary(ctx, "ReleasePrefetch", [&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(RequireTiers(false));
    KVD_RETURN_IF_ERROR(CheckWorker(ctx, req->worker_id(), "").status());
    return tiers_->ReleasePrefetch(req->handle(), WorkerId(req->worker_id()));
  });
}

grpc::ServerUnaryReactor* KvdService::StopIdleDemotion(grpc::CallbackServerContext* ctx,
                                                       const v1::StopIdleDemotionRequest*,
                                                       v1::StopIdleDemotionResponse*) {
  return Unary(ctx, "StopIdleDemotion", [&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(RequireTiers(false));
    tiers_->StopIdleDemotion();
    return absl::OkStatus();
  });
}

grpc::ServerWriteReactor<v1::SavedPrefixBatch>* KvdService::SavedPrefixes(
    grpc::CallbackServerContext* ctx, const v1::SavedPrefixesRequest*) {
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = Authorize(ctx, "SavedPrefixes");
  if (s.ok()) s = RequireTiers(/*disk=*/true);
  std::vector<v1::SavedPrefixBatch> batches;
  if (s.ok()) {
    for (const SavedPrefix& p : tiers_->SavedPrefixes()) {
      if (batches.empty() || static_cast<size_t>(batches.back().prefixes_size()) == kPrefixesPerBatch) {
        batches.emplace_back();
      }
      v1::SavedPrefix* out = batches.back().add_prefixes();
      ToProtoRedacted(p.ns, out->mutable_namespace_());
      out->mutable_tokens()->Add(p.tokens.begin(), p.tokens.end());
    }
  }
  metrics_->ObserveRpc("SavedPrefixes", s.code(),
                       std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return new BatchWriter(std::move(batches), s);
}

grpc::ServerUnaryReactor* KvdService::PutObject(grpc::CallbackServerContext* ctx,
                                                const v1::PutObjectRequest* req,
                                                v1::PutObjectResponse*) {
  return Unary(ctx, "PutObject", [&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(RequireTiers(false));
    return tiers_->PutObject(FromProto(req->namespace_()), req->key(), req->data());
  });
}

grpc::ServerUnaryReactor* KvdService::GetObject(grpc::CallbackServerContext* ctx,
                                                const v1::GetObjectRequest* req,
                                                v1::GetObjectResponse* resp) {
  const auto start = std::chrono::steady_clock::now();
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::Status s = Authorize(ctx, "GetObject");
  if (s.ok()) s = RequireTiers(false);
  if (!s.ok()) {
    FinishRpc(reactor, "GetObject", start, s);
    return reactor;
  }
  tiers_->GetObject(FromProto(req->namespace_()), req->key(),
                    [this, reactor, resp, start](absl::StatusOr<std::string> data) {
                      if (data.ok()) resp->set_data(*std::move(data));
                      FinishRpc(reactor, "GetObject", start, data.status());
                    });
  return reactor;
}

grpc::ServerUnaryReactor* KvdService::DeleteObject(grpc::CallbackServerContext* ctx,
                                                   const v1::DeleteObjectRequest* req,
                                                   v1::DeleteObjectResponse*) {
  return Unary(ctx, "DeleteObject", [&]() -> absl::Status {
    KVD_RETURN_IF_ERROR(RequireTiers(false));
    return tiers_->DeleteObject(FromProto(req->namespace_()), req->key());
  });
}

}  // namespace kvd
