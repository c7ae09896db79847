// PressureLevel: how close the node is to running out of KV memory, as the engine reports it and
// WatchPressure streams it (server/core/pressure_monitor.h computes it).
#pragma once

#include <string>

namespace kvd {

enum class PressureLevel { kNormal = 0, kHigh = 1, kCritical = 2 };
std::string PressureLevelName(PressureLevel level);

}  // namespace kvd
