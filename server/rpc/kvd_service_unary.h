// KvdService::Unary and FinishRpc: the one place where every unary RPC's status is converted,
// its latency and code recorded and its failure logged. Included by the service's .cc files only.
#pragma once

#include <chrono>

#include "proto/grpc_status.h"
#include "server/obs/log_safe.h"
#include "server/rpc/kvd_service.h"
#include "spdlog/spdlog.h"

namespace kvd {

inline void KvdService::FinishRpc(grpc::ServerUnaryReactor* reactor, const char* method,
                                  std::chrono::steady_clock::time_point start,
                                  const absl::Status& status) {
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  metrics_->ObserveRpc(method, status.code(), seconds);
  if (!status.ok()) spdlog::debug("{} -> {}", method, LogSafe(status.ToString(), 512));
  reactor->Finish(ToGrpcStatus(status));
}

template <typename Fn>
grpc::ServerUnaryReactor* KvdService::Unary(grpc::CallbackServerContext* ctx, const char* method,
                                            Fn&& fn) {
  const auto start = std::chrono::steady_clock::now();
  absl::Status status = Authorize(ctx, method);
  if (status.ok()) status = fn();
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  FinishRpc(reactor, method, start, status);
  return reactor;
}

}  // namespace kvd
