// KvdService::ServeStepLane: a worker's steps over one connection of the side socket, without
// gRPC's per-call cost (docs/api.md, "The step lane").
//
// Frames, each way: a 4-byte little-endian length, then that many bytes. A request frame holds a
// StepRequest; an answer frame holds a 4-byte little-endian status code, then the StepResponse
// (code 0) or the status message. One step at a time: the next frame is read once the answer
// to this one is written. A step is applied exactly as Step applies it (RunStep), so a worker may
// send the same seq again over gRPC after the lane broke and gets the same answer.
//
// A peer that starts a frame must finish it within kLaneFrameDeadline, and take an answer within
// the same (SO_SNDTIMEO), or the lane is closed; between frames a lane may idle for as long as
// its worker does.
//
// Threads: this runs on the side socket's thread for this connection. RunStep may answer on
// another thread (a start's admission); the answer is handed over in a CallState that either side
// may be the last to hold, so the lane can stop (handoff, shutdown) while a start still waits.
#include <endian.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "gpu/fd_passing.h"
#include "server/obs/log_safe.h"
#include "server/rpc/kvd_service.h"
#include "spdlog/spdlog.h"

namespace kvd {
namespace {

constexpr uint32_t kMaxLaneFrame = 4u << 20;  // larger steps go over gRPC (the client knows)
// How long a frame may take to arrive once its length did, and an answer to be taken.
constexpr absl::Duration kLaneFrameDeadline = absl::Seconds(5);
// How often a lane waiting for a step's answer looks whether it must stop (handoff, shutdown).
constexpr absl::Duration kLaneStopCheck = absl::Milliseconds(100);

// Reads exactly `n` bytes; false at EOF, on an error or a shut-down socket.
bool ReadFull(int fd, char* out, size_t n) {
  while (n > 0) {
    const ssize_t r = ::read(fd, out, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    out += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// Reads a frame's `len` bytes, all within `limit` of its header: a peer that starts a frame and
// goes silent holds no thread past that, and memory only for the bytes it sent.
// The usual frame came whole with its header and is taken by one recv, without a poll first; the
// buffer is never more than one 64 KiB chunk ahead of what arrived.
bool ReadBody(int fd, uint32_t len, absl::Duration limit, std::string* out) {
  constexpr size_t kChunk = 64 << 10;
  out->clear();
  absl::Time deadline = absl::InfiniteFuture();  // set at the first wait
  while (out->size() < len) {
    const size_t have = out->size();
    out->resize(have + std::min<size_t>(kChunk, len - have));
    const ssize_t r = ::recv(fd, out->data() + have, out->size() - have, MSG_DONTWAIT);
    out->resize(have + static_cast<size_t>(std::max<ssize_t>(r, 0)));
    if (r > 0) continue;
    if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return false;
    if (errno == EINTR) continue;
    if (deadline == absl::InfiniteFuture()) deadline = absl::Now() + limit;
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    pollfd p{fd, POLLIN, 0};
    const int ready = left_ms > 0 ? ::poll(&p, 1, static_cast<int>(left_ms)) : 0;
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return false;
  }
  return true;
}

bool WriteFull(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t w = ::send(fd, data, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    data += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// One send: the 8-byte header and the body serialized in place behind it.
bool WriteAnswer(int fd, absl::Status status, const v1::StepResponse* resp) {
  constexpr size_t kHead = 2 * sizeof(uint32_t);
  std::string frame(kHead, '\0');
  if (status.ok()) {
    const size_t n = resp->ByteSizeLong();
    frame.resize(kHead + n);
    if (!resp->SerializeToArray(frame.data() + kHead, static_cast<int>(n))) {
      status = absl::InternalError("step answer did not serialize");
    }
  }
  if (!status.ok()) {
    frame.resize(kHead);
    frame.append(status.message().data(), status.message().size());
  }
  const uint32_t head[2] = {htole32(static_cast<uint32_t>(frame.size() - kHead + 4)),
                            htole32(static_cast<uint32_t>(status.code()))};
  std::memcpy(frame.data(), head, kHead);
  return WriteFull(fd, frame.data(), frame.size());
}

// One step's request and answer, shared by the lane's thread and RunStep's `done`.
struct CallState {
  v1::StepRequest req;
  v1::StepResponse resp;
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
};

}  // namespace

void KvdService::ServeStepLane(int fd, const PeerCredentials& peer, const std::string& worker_id,
                               const std::atomic<bool>& stop) {
  absl::StatusOr<Caller> caller = IdentifyPeer(peer);
  absl::Status opened = caller.ok() ? CheckWorker(*caller, worker_id) : caller.status();
  if (!opened.ok()) {
    spdlog::warn("side socket: refused a step lane: {}", LogSafe(opened.ToString(), 512));
    (void)SendMessage(fd, absl::StrCat("ERR ", opened.message()), {});
    return;
  }
  if (!SendMessage(fd, "OK", {}).ok()) return;
  // An answer the peer does not take within this fails the write and closes the lane.
  const timeval send_limit{absl::ToInt64Seconds(kLaneFrameDeadline), 0};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &send_limit, sizeof(send_limit));
  int64_t steps = 0;
  while (!stop.load()) {
    char head[4];
    if (!ReadFull(fd, head, sizeof(head))) break;
    const auto start = std::chrono::steady_clock::now();
    uint32_t len = 0;
    std::memcpy(&len, head, sizeof(len));
    len = le32toh(len);
    if (len > kMaxLaneFrame) {  // the stream cannot be trusted past a length kvd will not read
      (void)WriteAnswer(fd, absl::ResourceExhaustedError(absl::StrCat(
                                "step lane: a frame of ", len, " bytes; at most ", kMaxLaneFrame,
                                " (send larger steps over gRPC); the lane is closed")),
                        nullptr);
      break;
    }
    auto call = std::make_shared<CallState>();
    std::string body;
    if (!ReadBody(fd, len, kLaneFrameDeadline, &body)) {
      spdlog::debug("step lane of worker {}: a frame of {} bytes did not arrive whole within {}s; closed",
                    LogSafe(worker_id, 256), len, absl::ToInt64Seconds(kLaneFrameDeadline));
      break;
    }
    absl::Status refused;
    if (!call->req.ParseFromString(body)) {
      refused = absl::InvalidArgumentError(absl::StrCat("step lane: a frame of ", len, " bytes is not a StepRequest"));
    } else if (call->req.worker_id() != worker_id) {
      refused = absl::InvalidArgumentError(absl::StrCat("step lane of worker ", LogSafe(worker_id, 256),
                                                        ": a step names worker '",
                                                        LogSafe(call->req.worker_id(), 256), "'"));
    }
    if (!refused.ok()) {
      metrics_->ObserveRpc("Step", refused.code(), 0);
      if (!WriteAnswer(fd, refused, nullptr)) break;
      continue;
    }
    RunStep(caller, call->req, &call->resp, [call](const absl::Status& s) {
      absl::MutexLock lock(&call->mu);
      call->status = s;
      call->done = true;
    });
    absl::Status status;
    {
      absl::MutexLock lock(&call->mu);
      while (!call->done && !stop.load()) {
        call->mu.AwaitWithTimeout(absl::Condition(&call->done), kLaneStopCheck);
      }
      if (!call->done) break;  // stopping: the answer, when it comes, goes nowhere
      status = call->status;
    }
    metrics_->ObserveRpc("Step", status.code(),
                         std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    if (!status.ok()) spdlog::debug("Step (lane) -> {}", LogSafe(status.ToString(), 512));
    if (!WriteAnswer(fd, status, &call->resp)) break;
    ++steps;
  }
  spdlog::debug("step lane of worker {} (pid {}) closed after {} steps", LogSafe(worker_id, 256), peer.pid, steps);
}

}  // namespace kvd
