// The hot handoff: a new kvd process (kvd --takeover) takes over from the running one without
// moving a byte of KV (docs/operations.md, "Upgrading kvd"). Modelled on Envoy's hot restart:
// the new process receives the old one's listening sockets over SCM_RIGHTS, so a worker that
// connects during the handoff waits in the socket's backlog instead of being refused.
//
// What crosses (proto/kvd/handoff/v1/handoff.proto states the messages and their order): the
// gRPC and side sockets' listening descriptors; every slab's memfd (the new arena adopts them, so
// the memory workers mapped stays where it is and their mappings stay valid); and a CacheSnapshot
// (server/core/cache_snapshot.h) in a sealed memfd: the index, recency, sessions and the
// checkpoints of interrupted requests. Requests that were live end as interrupted (their clients
// see KvdRestarted and admit them again, resuming from their checkpoints); the old process finishes
// its disk tier's queued writes and closes it before it hands over, and the new one reloads it.
//
// Compatibility: the two ends must speak the same kHandoffProtocol and configure the same pools
// (name, geometry, slab size and allocator: SlabFdName); on the CUDA backend every pool must use
// `allocator: vmm` (gpu/cuda_vmm.h), whose slabs are fds like the host backend's memfds. Anything else — budgets,
// policies, tiers, metrics address — may change in an upgrade. A mismatch is refused before the
// running kvd stops anything; it keeps serving and logs why, and the new process exits with the
// reason.
//
// Trust: the handoff socket is mode 0600 and the running kvd serves only a peer of its own user
// or root (SO_PEERCRED): whoever takes over gets every tenant's KV.
//
// Failure: a successor that dies before it has the package leaves the running kvd serving again
// with its cache as it was; one that dies (or reports failure) after it, leaves it serving on the
// same memory with an empty index (the successor may have written blocks); one that is alive but
// silent past the deadline leaves it exiting (both serving would hand out the same blocks). A
// running kvd that dies during the exchange leaves the successor starting afresh.
// Fault injection for tests: KVD_TEST_HANDOFF_FAULT=<step> SIGKILLs the process at that step
// (old side: after-answer, after-stop, after-package; new side: after-hello, after-package,
// before-done).
//
// Threads: HandoffListener runs one thread that serves one successor at a time; its hooks run on
// that thread. The successor's side (HandoffSession) is blocking and runs on kvd's start-up path.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu/device_arena.h"
#include "gpu/host_arena.h"
#include "gpu/unique_fd.h"
#include "proto/vocab/pool_geometry.h"
#include "server/core/cache_snapshot.h"

namespace kvd {

// Version of the handoff's messages and of CacheSnapshot's meaning; both ends must agree.
inline constexpr uint32_t kHandoffProtocol = 1;

// KVD_TEST_HANDOFF_FAULT: SIGKILLs this process when it names `step` (tests only).
void HandoffFaultPoint(const char* step);

// What a successor says about itself.
struct HandoffHello {
  uint32_t protocol = kHandoffProtocol;
  std::string build;               // BuildInfo()
  std::vector<std::string> slabs;  // SlabFdName of each slab its pools need, in arena order
  std::string pools;               // DescribePools of the same, for a refusal message
  std::string backend;             // its configured backend
};
HandoffHello MakeHello(const std::vector<PoolGeometry>& pools, const std::string& backend);
// One line per pool: name and every field that shapes its slab.
std::string DescribePools(const std::vector<PoolGeometry>& pools);
// OK when a successor that says `hello` may take over from a kvd whose arena has `backend` and
// `slabs`, for `pools`; FAILED_PRECONDITION naming the difference otherwise. CUDA arenas hand
// over only when every slab is a VMM slab (an fd); cudaMalloc memory cannot cross processes.
absl::Status CheckSuccessor(const HandoffHello& hello, const std::string& backend,
                            const std::vector<SlabDescriptor>& slabs, const std::vector<PoolGeometry>& pools);

// What the running kvd hands over. Descriptors are borrowed: they stay open in the old process
// until it exits (a copy travels).
struct HandoffOffer {
  int listen_fd = -1;
  int side_fd = -1;
  std::vector<SlabDescriptor> slabs;  // fd set
  CacheSnapshot snapshot;
  uint64_t requests_ended = 0;
};

// What the successor receives.
struct HandoffReceived {
  UniqueFd listen_fd;
  UniqueFd side_fd;
  std::vector<OfferedSlab> slabs;
  CacheSnapshot snapshot;
  uint64_t requests_ended = 0;
  std::string old_build;
};

// What the running kvd does once a handoff it stopped for has ended (HandoffListener::Hooks).
enum class HandoffNext {
  kExit,             // the successor serves (OK), or its fate is unknown (it may serve): never resume
  kResumeWithIndex,  // the package never reached the successor: serve again, cache as it was
  kResumeEmpty,      // the successor got the package and is gone or failed: serve again on the same
                     // memory with an empty index (it may have written blocks this index names)
};

// The running kvd's end.
class HandoffListener {
 public:
  struct Hooks {
    // OK when the successor may take over (CheckSuccessor); the refusal otherwise.
    std::function<absl::Status(const HandoffHello&)> check;
    // Stops serving and gathers what crosses. An error here leaves kvd stopped (it is told to
    // `finished`).
    std::function<absl::StatusOr<HandoffOffer>()> stop;
    // The outcome once the successor answered (OK: it serves now) or the exchange broke after
    // `stop`, and what this kvd should do next. Called at most once, and only after `stop`.
    std::function<void(absl::Status, HandoffNext)> finished;
  };
  // Listens on `path` (mode 0600). A dead socket file there is replaced; a live listener only
  // when `successor` (this kvd took over from the process listening there). The failing call
  // named on error.
  static absl::StatusOr<std::unique_ptr<HandoffListener>> Start(const std::string& path, Hooks hooks,
                                                                bool successor = false);
  // Stops the thread; removes the socket file unless another process has bound it since.
  ~HandoffListener();

 private:
  HandoffListener(std::string path, UniqueFd listen_fd, UniqueFd wake_read, UniqueFd wake_write,
                  Hooks hooks, uint64_t inode);
  void Loop();
  // One successor. Returns true once kvd has stopped serving for it (no more successors).
  bool Serve(int conn);

  std::string path_;
  UniqueFd listen_fd_;
  UniqueFd wake_read_;
  UniqueFd wake_write_;
  Hooks hooks_;
  uint64_t inode_ = 0;  // of the socket file this listener bound
  std::thread thread_;  // declared last: started once everything above exists
};

// The successor's end.
class HandoffSession {
 public:
  // Connects to the running kvd's handoff socket. NOT_FOUND when no kvd listens there.
  static absl::StatusOr<HandoffSession> Connect(const std::string& path);
  // Says `hello` and receives what the running kvd hands over. FAILED_PRECONDITION carrying the
  // running kvd's refusal; UNAVAILABLE or INVALID_ARGUMENT when the exchange broke.
  absl::StatusOr<HandoffReceived> Take(const HandoffHello& hello);
  // Tells the old kvd the outcome: OK once this process serves (the old one exits), else why not.
  void Finish(const absl::Status& serving);
  // Whether the running kvd's process has ended (gone or a zombie): after Take failed that way,
  // nothing else serves and the successor starts afresh.
  bool PeerGone() const;

 private:
  HandoffSession(UniqueFd fd, pid_t peer) : fd_(std::move(fd)), peer_(peer) {}
  UniqueFd fd_;
  pid_t peer_ = 0;
};

}  // namespace kvd
