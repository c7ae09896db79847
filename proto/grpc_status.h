// The one place where absl::Status and grpc::Status are converted (DESIGN.md §4). Codes map 1:1
// (both follow google.rpc.Code); the message is kept.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace kvd {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace kvd
