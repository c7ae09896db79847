#include "server/transfer/transfer.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/vocab/status_macros.h"
#include "server/config_values.h"
#include "spdlog/spdlog.h"

namespace kvd {

absl::StatusOr<std::unique_ptr<Transfer>> Transfer::Start(const TransferOptions& options, TierPort* cache,
                                                          PeerPort* units, const DeviceArena* arena) {
  std::unique_ptr<Transfer> t(new Transfer());
  t->metrics_ = std::make_unique<TransferMetrics>();
  // This node's certificate and key and the peers' CA, read once: presented as the server to
  // pullers and as the client to the peers this node pulls from.
  KVD_ASSIGN_OR_RETURN(std::string cert, ReadConfigFile("transfer.tls_cert_file", options.tls_cert_file));
  KVD_ASSIGN_OR_RETURN(std::string key, ReadConfigFile("transfer.tls_key_file", options.tls_key_file));
  KVD_ASSIGN_OR_RETURN(std::string ca, ReadConfigFile("transfer.tls_ca_file", options.tls_ca_file));
  grpc::SslCredentialsOptions client{ca, key, cert};
  t->puller_ = PeerPuller::Create(options, cache, units, arena, t->metrics_.get(), client);
  t->service_ = std::make_unique<PeerService>(cache, units, arena, options, t->metrics_.get());

  grpc::SslServerCredentialsOptions ssl(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  ssl.pem_root_certs = ca;
  ssl.pem_key_cert_pairs.push_back({key, cert});
  grpc::ServerBuilder builder;
  int largest = 0;  // a Read's answer: up to kMaxReadBytes, or one block (or unit) where one is larger
  for (const PoolGeometry& g : arena->geometries()) {
    largest = static_cast<int>(std::min<int64_t>(
        INT32_MAX, std::max({int64_t{largest}, PeerService::kMaxReadBytes, LargestUnitBytes(g)}) + (1 << 20)));
  }
  builder.SetMaxSendMessageSize(largest);
  int port = 0;
  builder.AddListeningPort(options.listen, grpc::SslServerCredentials(ssl), &port);
  builder.RegisterService(t->service_.get());
  t->server_ = builder.BuildAndStart();
  if (t->server_ == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("transfer.listen: cannot serve peers on ", options.listen));
  }
  t->bound_ = absl::StrCat(options.listen.substr(0, options.listen.rfind(':')), ":", port);
  spdlog::info("peer transfer: serving peers on {} (mutual TLS), pulling from {} configured peers", t->bound_,
               options.peers.size());
  return t;
}

Transfer::~Transfer() {
  // The server before the service it calls; the service's leases go back; pulls finish last.
  if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  server_.reset();
  service_.reset();
  puller_.reset();
}

}  // namespace kvd
