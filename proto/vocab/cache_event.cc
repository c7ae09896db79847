#include "proto/vocab/cache_event.h"

namespace kvd {

std::string CacheEventKindName(CacheEventKind kind) {
  switch (kind) {
    case CacheEventKind::kStored: return "stored";
    case CacheEventKind::kRemoved: return "removed";
    case CacheEventKind::kCleared: return "cleared";
  }
  return "unknown";
}

}  // namespace kvd
