#include "server/rpc/access_interceptor.h"

#include "absl/strings/match.h"
#include "server/obs/log_safe.h"
#include "spdlog/spdlog.h"

namespace kvd {
namespace {

class AccessInterceptor final : public grpc::experimental::Interceptor {
 public:
  AccessInterceptor(grpc::experimental::ServerRpcInfo* info, const KvdService* service)
      : info_(info), service_(service) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      const absl::string_view method = info_->method() != nullptr ? info_->method() : "";
      if (absl::StartsWith(method, "/grpc.reflection.")) {
        grpc::ServerContextBase* ctx = info_->server_context();
        if (absl::StatusOr<KvdService::Caller> caller = service_->Identify(ctx->peer()); !caller.ok()) {
          spdlog::debug("reflection refused: {}", LogSafe(caller.status().ToString(), 256));
          ctx->TryCancel();
        }
      }
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* const info_;
  const KvdService* const service_;
};

}  // namespace

grpc::experimental::Interceptor* AccessInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new AccessInterceptor(info, service_);
}

}  // namespace kvd
