#include "proto/vocab/cache_types.h"

namespace kvd {

std::string EvictReasonName(EvictReason reason) {
  switch (reason) {
    case EvictReason::kCapacity: return "capacity";
    case EvictReason::kBoundary: return "boundary";
    case EvictReason::kGc: return "gc";
    case EvictReason::kClear: return "clear";
  }
  return "unknown";
}

}  // namespace kvd
