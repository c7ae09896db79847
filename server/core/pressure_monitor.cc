#include "server/core/pressure_monitor.h"

namespace kvd {


absl::Status PressureOptions::Validate() const {
  if (!(0 < critical_enter && critical_enter <= critical_exit && critical_exit <= high_enter &&
        high_enter <= high_exit && high_exit < 1)) {
    return absl::InvalidArgumentError(
        "pressure thresholds must satisfy 0 < critical_enter <= critical_exit <= high_enter <= "
        "high_exit < 1");
  }
  return absl::OkStatus();
}

bool PressureMonitor::Update(double available_fraction) {
  available_ = available_fraction;
  PressureLevel next = level_;
  switch (level_) {
    case PressureLevel::kNormal:
      if (available_ < options_.critical_enter) next = PressureLevel::kCritical;
      else if (available_ < options_.high_enter) next = PressureLevel::kHigh;
      break;
    case PressureLevel::kHigh:
      if (available_ < options_.critical_enter) next = PressureLevel::kCritical;
      else if (available_ > options_.high_exit) next = PressureLevel::kNormal;
      break;
    case PressureLevel::kCritical:
      if (available_ > options_.high_exit) next = PressureLevel::kNormal;
      else if (available_ > options_.critical_exit) next = PressureLevel::kHigh;
      break;
  }
  bool changed = next != level_;
  level_ = next;
  return changed;
}

}  // namespace kvd
