// InterprocessEvent orders GPU work between processes without a host sync.
//
// The ordering contract of kvd (docs/api.md, "Publish is host-synchronized"): when Publish, End
// or Checkpoint reaches kvd, the bytes it names are in memory. The client library keeps it: a
// worker records its event on the stream that wrote the KV (Client::RecordWrites), and the
// library synchronizes the event before it sends the publish. Readers may still wait on a
// publisher's event on their own stream (no host sync), which costs nothing once it has run.
// Every call selects the event's device through ScopedCudaDevice.
// Create() makes a cudaEventInterprocess | cudaEventDisableTiming event and exports its 64-byte
// handle (cudaIpcGetEventHandle); another process Open()s the handle. Streams are opaque
// pointers (cudaStream_t) so no CUDA type leaves gpu/.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace kvd {

class InterprocessEvent {
 public:
  static absl::StatusOr<InterprocessEvent> Create(int device);
  static absl::StatusOr<InterprocessEvent> Open(int device, const std::string& handle);
  InterprocessEvent(InterprocessEvent&& o) noexcept;
  InterprocessEvent& operator=(InterprocessEvent&& o) noexcept;
  InterprocessEvent(const InterprocessEvent&) = delete;
  InterprocessEvent& operator=(const InterprocessEvent&) = delete;
  ~InterprocessEvent();

  // The exported handle (64 bytes), to pass to readers.
  const std::string& handle() const { return handle_; }
  // Records the event on `stream` (after the writes to publish).
  absl::Status Record(void* stream);
  // Makes `stream` wait for the last recorded point, without blocking the host.
  absl::Status StreamWait(void* stream);
  // Blocks the calling thread until the last recorded point has run (the host-synchronized
  // publish of docs/api.md).
  absl::Status Synchronize();

 private:
  InterprocessEvent(void* event, int device, std::string handle)
      : event_(event), device_(device), handle_(std::move(handle)) {}
  void Destroy();
  void* event_ = nullptr;  // cudaEvent_t
  int device_ = -1;
  std::string handle_;
};

}  // namespace kvd
