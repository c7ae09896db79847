// The scalar values of kvd's configuration that carry units, parsed one way whether they come
// from the YAML file or from a flag, so that a mistake gets the same one-line message, naming the
// key, the value and what is allowed, wherever it was made.
//
//   Sizes      a whole number of bytes, or a number with a unit: KiB MiB GiB TiB (powers of 1024)
//              or KB MB GB TB (powers of 1000), B; the unit's case does not matter and a space may
//              precede it ("8GiB", "1.5 GiB", "512MB", "4096"). Never negative.
//   Durations  a number of seconds ("30", "0.5"), or absl's duration syntax with units ("500ms",
//              "30s", "5m", "1h30m"). Ranges (> 0, >= 0) are the caller's to check.
//   Listen     unix:///abs/path, unix:/abs/path or /abs/path (all become unix:///abs/path), or
//              HOST:PORT for TCP ([v6]:PORT too).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvd {

// INVALID_ARGUMENT "<key>: '<text>' is not a size: ..." naming the accepted forms.
absl::StatusOr<int64_t> ParseSize(absl::string_view key, absl::string_view text);
// INVALID_ARGUMENT "<key>: '<text>' is not a duration: ...".
absl::StatusOr<absl::Duration> ParseDurationValue(absl::string_view key, absl::string_view text);
// The canonical form (unix:///path for every Unix spelling, HOST:PORT unchanged), or
// INVALID_ARGUMENT "<key>: '<text>' is neither ...".
absl::StatusOr<std::string> NormalizeListen(absl::string_view key, absl::string_view text);

// The whole file a config key names (a PEM certificate, key or CA bundle); INVALID_ARGUMENT
// "<key>: cannot read <path>" when it cannot be read.
absl::StatusOr<std::string> ReadConfigFile(absl::string_view key, const std::string& path);

}  // namespace kvd
