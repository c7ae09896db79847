// LogSafe: a client-supplied string as it may appear in a log line. Control characters and
// non-ASCII bytes are escaped (a newline cannot forge a line) and the result is bounded (a
// megabyte name cannot flood the log). Every client string that reaches spdlog goes through it.
#pragma once

#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvd {

inline std::string LogSafe(absl::string_view s, size_t max_bytes = 128) {
  if (s.size() <= max_bytes) return absl::CHexEscape(s);
  return absl::StrCat(absl::CHexEscape(s.substr(0, max_bytes)), "...(", s.size(), " bytes)");
}

}  // namespace kvd
