// Clock is the single source of time for kvd's core: TTLs, leases and recency all read it, so
// tests advance a FakeClock instead of sleeping. Implementations are thread-safe.
#pragma once

#include <atomic>
#include <chrono>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvd {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
};

// Monotonic time that reads like wall time: the wall clock once, when the clock is made, advanced
// by the monotonic clock since. Every TTL, lease and recency in kvd is a difference of two of its
// readings, so an NTP step or settimeofday never expires a lease early or keeps a session late;
// times reported to clients (session expiry) stay close to wall time. `Get()` returns a
// process-wide instance; the constructor takes the two sources so that tests can step the wall.
class SystemClock final : public Clock {
 public:
  using Source = absl::Time (*)();
  static absl::Time MonotonicNow() {
    return absl::UnixEpoch() + absl::FromChrono(std::chrono::steady_clock::now().time_since_epoch());
  }
  explicit SystemClock(Source wall = &absl::Now, Source monotonic = &MonotonicNow)
      : monotonic_(monotonic), anchor_wall_(wall()), anchor_monotonic_(monotonic()) {}
  absl::Time Now() const override { return anchor_wall_ + (monotonic_() - anchor_monotonic_); }
  static SystemClock* Get() {
    static SystemClock clock;
    return &clock;
  }

 private:
  const Source monotonic_;
  const absl::Time anchor_wall_;
  const absl::Time anchor_monotonic_;
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
