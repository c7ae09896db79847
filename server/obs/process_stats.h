// What the daemon's own process uses, read from /proc/self at scrape time: the standard
// Prometheus process_* metrics, so that memory kvd holds outside the KV budget is visible.
#pragma once

#include <sys/types.h>

#include <cstdint>

namespace kvd {

struct ProcessStats {
  int64_t resident_bytes = 0;
  int64_t virtual_bytes = 0;
  int64_t open_fds = 0;
  int64_t max_fds = 0;
  double cpu_seconds = 0;
  double start_time_seconds = 0;  // since the Unix epoch: a restart changes it
};

// Fields that cannot be read stay 0.
ProcessStats ReadProcessStats();

// Whether process `pid` has ended (no such process, a zombie, or exiting: PF_EXITING set): it can
// write nothing more.
// Reads /proc: never under a lock that guards anything else.
bool ProcessGone(pid_t pid);

}  // namespace kvd
