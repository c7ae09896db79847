#include "proto/vocab/pressure_level.h"

namespace kvd {

std::string PressureLevelName(PressureLevel level) {
  switch (level) {
    case PressureLevel::kNormal: return "normal";
    case PressureLevel::kHigh: return "high";
    case PressureLevel::kCritical: return "critical";
  }
  return "unknown";
}

}  // namespace kvd
