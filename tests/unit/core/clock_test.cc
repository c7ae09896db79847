// SystemClock: durations come from the monotonic clock, so a step of the wall clock (NTP,
// settimeofday) moves no TTL or lease.
#include "server/core/clock.h"

#include <catch2/catch.hpp>

namespace kvd {
namespace {

absl::Time g_wall = absl::FromUnixSeconds(1'800'000'000);
absl::Time g_mono = absl::FromUnixSeconds(5);
absl::Time Wall() { return g_wall; }
absl::Time Mono() { return g_mono; }

TEST_CASE("SystemClock reads wall time once and then follows the monotonic clock", "[clock]") {
  SystemClock clock(&Wall, &Mono);
  REQUIRE(clock.Now() == g_wall);
  g_mono += absl::Seconds(3);
  REQUIRE(clock.Now() == g_wall + absl::Seconds(3));
  // The wall clock steps an hour forward, then a day back: a lease of 30 s is still 30 s away.
  const absl::Time lease_expires = clock.Now() + absl::Seconds(30);
  g_wall += absl::Hours(1);
  REQUIRE(clock.Now() < lease_expires);
  g_wall -= absl::Hours(25);
  g_mono += absl::Seconds(29);
  REQUIRE(clock.Now() < lease_expires);
  g_mono += absl::Seconds(2);
  REQUIRE(clock.Now() > lease_expires);
}

TEST_CASE("The process-wide SystemClock is close to wall time and never goes back", "[clock]") {
  const absl::Time a = SystemClock::Get()->Now();
  REQUIRE(absl::AbsDuration(a - absl::Now()) < absl::Minutes(1));
  REQUIRE(SystemClock::Get()->Now() >= a);
}

}  // namespace
}  // namespace kvd
