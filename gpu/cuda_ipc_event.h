// InterprocessEvent orders GPU work between processes without a host sync.
//
// The ordering contract of kvd (docs/architecture.md): a worker makes the KV it wrote visible
// before it publishes — by synchronizing the stream that wrote it, or by recording an
// interprocess event on that stream and letting readers wait on the event on their own streams.
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

 private:
  InterprocessEvent(void* event, int device, std::string handle)
      : event_(event), device_(device), handle_(std::move(handle)) {}
  void* event_ = nullptr;  // cudaEvent_t
  int device_ = -1;
  std::string handle_;
};

}  // namespace kvd
