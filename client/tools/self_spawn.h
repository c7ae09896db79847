// Running copies of the current binary as helper processes (benchmark workers, an IPC opener),
// with their standard output captured: the tools re-execute themselves with a --child flag.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvd::tools {

struct SpawnedChild {
  pid_t pid = -1;
  int stdout_fd = -1;  // read end of the child's stdout; owned by the caller until Collect
};

// Starts /proc/self/exe with argv[1..] = `args` (argv[0] = `argv0`).
absl::StatusOr<SpawnedChild> SpawnSelf(const std::string& argv0, const std::vector<std::string>& args);

struct ChildResult {
  std::string out;
  bool ok = false;  // exited with status 0
};
// Reads the child's stdout to the end, closes it and waits for the child.
ChildResult Collect(SpawnedChild& child);

}  // namespace kvd::tools
