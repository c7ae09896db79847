// SlabSideChannel serves slab file descriptors to attached workers over a Unix socket next to
// the gRPC socket (the host backend's data-plane handshake).
//
// Protocol (messages framed by gpu/fd_passing.h): the worker sends its one-time slab token; the
// daemon checks the peer with SO_PEERCRED (AttachmentRegistry::RedeemToken) and answers
// "OK <n>", then n messages "<pool> <shard> <size_bytes>" each carrying one fd; or "ERR <reason>"
// and closes. One dedicated thread; each connection has a short I/O timeout so a stalled peer
// cannot hold it.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "gpu/device_arena.h"
#include "gpu/unique_fd.h"
#include "server/rpc/access_policy.h"
#include "server/rpc/attachments.h"

namespace kvd {

class SlabSideChannel {
 public:
  // Listens on `path` (mode 0660). `arena`, `registry` and `policy` (may be null) are borrowed
  // and must outlive this; peers `policy` refuses get "ERR" and nothing else.
  static absl::StatusOr<std::unique_ptr<SlabSideChannel>> Start(const std::string& path,
                                                                const DeviceArena* arena,
                                                                AttachmentRegistry* registry,
                                                                const AccessPolicy* policy = nullptr);
  ~SlabSideChannel();  // stops the thread and removes the socket file
  const std::string& path() const { return path_; }

 private:
  SlabSideChannel(std::string path, UniqueFd listen_fd, UniqueFd wake_read, UniqueFd wake_write,
                  const DeviceArena* arena, AttachmentRegistry* registry, const AccessPolicy* policy);
  void Loop();
  void Serve(int conn);

  std::string path_;
  UniqueFd listen_fd_;
  UniqueFd wake_read_;
  UniqueFd wake_write_;
  const DeviceArena* arena_;
  AttachmentRegistry* registry_;
  const AccessPolicy* policy_;
  std::thread thread_;
};

}  // namespace kvd
