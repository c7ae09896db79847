#include "server/core/pressure_monitor.h"

#include <catch2/catch.hpp>

namespace kvd {
namespace {

TEST_CASE("Pressure rises at the enter thresholds and falls only past the exit ones", "[core][pressure]") {
  PressureMonitor m(PressureOptions{});
  REQUIRE_FALSE(m.Update(0.5));
  REQUIRE(m.level() == PressureLevel::kNormal);
  REQUIRE(m.Update(0.10));
  REQUIRE(m.level() == PressureLevel::kHigh);
  REQUIRE_FALSE(m.Update(0.17));  // between high_enter and high_exit: stays high
  REQUIRE(m.level() == PressureLevel::kHigh);
  REQUIRE(m.Update(0.01));
  REQUIRE(m.level() == PressureLevel::kCritical);
  REQUIRE_FALSE(m.Update(0.06));  // below critical_exit: stays critical
  REQUIRE(m.Update(0.10));
  REQUIRE(m.level() == PressureLevel::kHigh);
  REQUIRE(m.Update(0.30));
  REQUIRE(m.level() == PressureLevel::kNormal);
}

TEST_CASE("Pressure thresholds are validated", "[core][pressure]") {
  PressureOptions o;
  o.high_enter = 0.01;
  REQUIRE_FALSE(o.Validate().ok());
  REQUIRE(PressureOptions{}.Validate().ok());
}

}  // namespace
}  // namespace kvd
