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
// Destroyed, it ends the stream as a worker that is done does (half-close), which kvd tells from
// a stream that broke (Break: cancelled, as a client whose acks are late cancels it), whose
// blocks it keeps fenced.
struct RawAttachment {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::AttachRequest, v1::AttachResponse>> stream;
  v1::Attached attached;
  bool broken = false;
  void Break() {
    broken = true;
    ctx.TryCancel();
  }
  ~RawAttachment() {
    if (!broken && stream->WritesDone()) {
      v1::AttachResponse ignored;
      while (stream->Read(&ignored)) {
      }
    }
    ctx.TryCancel();
  }
};

// `previous_worker_id` and `quiesced`: the hello of a re-attach (Hello in kvd.proto).
inline std::unique_ptr<RawAttachment> AttachByHand(v1::Kvd::Stub& stub, const std::string& event_handle = "",
                                                  pid_t pid = getpid(), const std::string& previous_worker_id = "",
                                                  bool quiesced = false) {
  auto a = std::make_unique<RawAttachment>();
  a->stream = stub.Attach(&a->ctx);
  v1::AttachRequest hello;
  hello.mutable_hello()->set_pid(pid);
  hello.mutable_hello()->set_cuda_event_handle(event_handle);
  hello.mutable_hello()->set_previous_worker_id(previous_worker_id);
  hello.mutable_hello()->set_quiesced(quiesced);
  v1::AttachResponse resp;
  REQUIRE(a->stream->Write(hello));
  REQUIRE(a->stream->Read(&resp));
  a->attached = resp.attached();
  return a;
}

}  // namespace kvd::testing
