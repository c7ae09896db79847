// Client: the calls of the contract an engine uses besides requests and steps (prefetch,
// objects, sessions). Thin wrappers: convert, call, convert back.
#include "client/client.h"
#include "client/client_impl.h"

namespace kvd::client {

absl::StatusOr<PrefetchResult> Client::Prefetch(const Namespace& ns, absl::Span<const Token> tokens) {
  v1::PrefetchRequest req;
  req.set_worker_id(impl_->Worker().value());
  ToProto(ns, req.mutable_namespace_());
  req.mutable_tokens()->Add(tokens.begin(), tokens.end());
  KVD_ASSIGN_OR_RETURN(v1::PrefetchResponse r, impl_->Call<v1::PrefetchResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->Prefetch(ctx, req, resp);
  }));
  return PrefetchResult{r.handle(), r.found_blocks(), r.loading_blocks()};
}

absl::Status Client::ReleasePrefetch(uint64_t handle) {
  v1::ReleasePrefetchRequest req;
  req.set_worker_id(impl_->Worker().value());
  req.set_handle(handle);
  return impl_->Call<v1::ReleasePrefetchResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->ReleasePrefetch(ctx, req, resp);
  }).status();
}

absl::Status Client::PutObject(const Namespace& ns, const std::string& key, const std::string& data) {
  v1::PutObjectRequest req;
  ToProto(ns, req.mutable_namespace_());
  req.set_key(key);
  req.set_data(data);
  return impl_->Call<v1::PutObjectResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->PutObject(ctx, req, resp);
  }).status();
}

absl::StatusOr<std::string> Client::GetObject(const Namespace& ns, const std::string& key) {
  v1::GetObjectRequest req;
  ToProto(ns, req.mutable_namespace_());
  req.set_key(key);
  KVD_ASSIGN_OR_RETURN(v1::GetObjectResponse r, impl_->Call<v1::GetObjectResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->GetObject(ctx, req, resp);
  }));
  return std::move(*r.mutable_data());
}

absl::Status Client::DeleteObject(const Namespace& ns, const std::string& key) {
  v1::DeleteObjectRequest req;
  ToProto(ns, req.mutable_namespace_());
  req.set_key(key);
  return impl_->Call<v1::DeleteObjectResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->DeleteObject(ctx, req, resp);
  }).status();
}

absl::StatusOr<std::vector<SessionInfo>> Client::ListSessions() {
  KVD_ASSIGN_OR_RETURN(v1::ListSessionsResponse r, impl_->Call<v1::ListSessionsResponse>([&](auto* ctx, auto* resp) {
    return impl_->stub()->ListSessions(ctx, v1::ListSessionsRequest(), resp);
  }));
  std::vector<SessionInfo> out;
  for (const v1::SessionInfo& s : r.sessions()) out.push_back(FromProto(s));
  return out;
}

}  // namespace kvd::client
