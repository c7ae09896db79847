// Clock is the single source of time for kvd's core: TTLs, leases and recency all read it, so
// tests advance a FakeClock instead of sleeping. Implementations are thread-safe.
#pragma once

#include <atomic>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvd {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
};

// Wall-clock time from absl::Now(). Stateless; `Get()` returns a process-wide instance.
class SystemClock final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
  static SystemClock* Get() {
    static SystemClock clock;
    return &clock;
  }
};

// A clock that moves only when told to. Thread-safe.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1'700'000'000))
      : nanos_(absl::ToUnixNanos(start)) {}
  absl::Time Now() const override { return absl::FromUnixNanos(nanos_.load()); }
  void Advance(absl::Duration d) { nanos_.fetch_add(absl::ToInt64Nanoseconds(d)); }

 private:
  std::atomic<int64_t> nanos_;
};

}  // namespace kvd
