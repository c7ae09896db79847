// PressureMonitor turns "how many KV bytes can still be had" into a level with hysteresis, so
// workers can slow down before memory runs out without flapping at a threshold.
//
// available = min(budget - reserved, free + reclaimable) as a fraction of the budget. The level
// rises to kHigh below `high_enter` and to kCritical below `critical_enter`; it falls back only
// once `available` exceeds the matching `*_exit` threshold.
// Thread-compatible: the caller serializes access.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "proto/vocab/pressure_level.h"

namespace kvd {

struct PressureOptions {
  double high_enter = 0.15;      // enter kHigh when available fraction drops below this
  double high_exit = 0.20;       // leave kHigh when it rises above this
  double critical_enter = 0.05;  // enter kCritical below this
  double critical_exit = 0.08;   // leave kCritical above this
  absl::Status Validate() const;
};

class PressureMonitor {
 public:
  explicit PressureMonitor(PressureOptions options) : options_(options) {}
  // Feeds a new reading; returns true when the level changed.
  bool Update(double available_fraction);
  PressureLevel level() const { return level_; }
  double available_fraction() const { return available_; }

 private:
  PressureOptions options_;
  PressureLevel level_ = PressureLevel::kNormal;
  double available_ = 1.0;
};

}  // namespace kvd
