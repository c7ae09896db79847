// AccessInterceptor: the allow-list for the services kvd does not implement itself. gRPC's
// reflection service is registered into every server by its library; this interceptor cancels
// its calls from peers the allow-list refuses, before they are answered. Health stays open to
// everyone (probes); the Kvd service checks its callers itself (KvdService::Authorize).
#pragma once

#include <memory>

#include <grpcpp/support/server_interceptor.h>

#include "server/rpc/kvd_service.h"

namespace kvd {

class AccessInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit AccessInterceptorFactory(const KvdService* service) : service_(service) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override;

 private:
  const KvdService* const service_;  // borrowed; outlives the server
};

}  // namespace kvd
