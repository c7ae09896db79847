// A worker attachment made by hand over a raw gRPC stub, for tests that need what the client
// library hides (the worker id, the slab token, a hello of their choosing).
#pragma once

#include <unistd.h>

#include <memory>
#include <string>

#include <catch2/catch.hpp>

#include <grpcpp/grpcpp.h>

#include "kvd/v1/kvd.grpc.pb.h"

namespace kvd::testing {

// An attachment made by hand over a raw stub (the client library hides these details).
struct RawAttachment {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::AttachRequest, v1::AttachResponse>> stream;
  v1::Attached attached;
  ~RawAttachment() { ctx.TryCancel(); }
};

inline std::unique_ptr<RawAttachment> AttachByHand(v1::Kvd::Stub& stub, const std::string& event_handle = "",
                                                  pid_t pid = getpid()) {
  auto a = std::make_unique<RawAttachment>();
  a->stream = stub.Attach(&a->ctx);
  v1::AttachRequest hello;
  hello.mutable_hello()->set_pid(pid);
  hello.mutable_hello()->set_cuda_event_handle(event_handle);
  v1::AttachResponse resp;
  REQUIRE(a->stream->Write(hello));
  REQUIRE(a->stream->Read(&resp));
  a->attached = resp.attached();
  return a;
}

}  // namespace kvd::testing
