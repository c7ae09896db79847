#include "server/rpc/ended_writers.h"

#include <sys/types.h>

#include "server/core/kv_cache.h"
#include "server/obs/process_stats.h"

namespace kvd {

int64_t LiftFencesOfEndedWriters(KvCache& cache) {
  int64_t lifted = 0;
  for (uint32_t pid : cache.FencedPids()) {
    if (ProcessGone(static_cast<pid_t>(pid))) lifted += cache.LiftFencesOfGone(pid);
  }
  return lifted;
}

}  // namespace kvd
