#include "server/build_info.h"

#include "absl/strings/str_cat.h"

namespace kvd {

std::string BuildInfo(const std::string& program) {
  return absl::StrCat(program, " ", KVD_VERSION, " (commit ", KVD_BUILD_COMMIT, ", CUDA runtime ",
                      KVD_CUDA_RUNTIME, ")");
}

}  // namespace kvd
