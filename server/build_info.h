// What a kvd binary is: version, the commit it was configured from (at cmake time), and the CUDA
// runtime it links ("none" without the toolkit). Shown by `kvd --version`, `kvdctl version` and
// ReportResponse.build.
#pragma once

#include <string>

namespace kvd {

// "kvd 0.1.0 (commit 1a2b3c4d5e6f, CUDA runtime 13.0)"; `program` replaces "kvd".
std::string BuildInfo(const std::string& program = "kvd");

}  // namespace kvd
