#include "server/config_values.h"

#include <cmath>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace kvd {
namespace {

constexpr std::pair<const char*, double> kUnits[] = {
    {"b", 1.0},
    {"kib", 1024.0}, {"mib", 1024.0 * 1024}, {"gib", 1024.0 * 1024 * 1024}, {"tib", 1024.0 * 1024 * 1024 * 1024},
    {"kb", 1e3}, {"mb", 1e6}, {"gb", 1e9}, {"tb", 1e12},
};

// 1 for K, 2 for M, 3 for G, 4 for T; 0 for anything else.
int PrefixRank(char prefix) {
  const size_t i = absl::string_view("KMGT").find(prefix);
  return i == absl::string_view::npos ? 0 : static_cast<int>(i) + 1;
}

absl::Status NotA(absl::string_view what, absl::string_view key, absl::string_view text, absl::string_view forms) {
  return absl::InvalidArgumentError(absl::StrCat(key, ": '", text, "' is not a ", what, ": ", forms));
}

}  // namespace

absl::StatusOr<int64_t> ParseSize(absl::string_view key, absl::string_view text) {
  constexpr absl::string_view kForms =
      "expected bytes as a whole number or a number with a unit (KiB, MiB, GiB, TiB, KB, MB, GB, TB), "
      "e.g. 8GiB";
  absl::string_view s = absl::StripAsciiWhitespace(text);
  int64_t whole = 0;
  if (absl::SimpleAtoi(s, &whole)) {
    if (whole < 0) return NotA("size", key, text, kForms);
    return whole;
  }
  // Split the number from the unit: the unit is the trailing run of letters.
  size_t letters = s.size();
  while (letters > 0 && absl::ascii_isalpha(static_cast<unsigned char>(s[letters - 1]))) --letters;
  absl::string_view written_unit = s.substr(letters);
  // "Gb", "MiB" spelled "Mib": an upper-case prefix before a lower-case b reads as bits, and a
  // guess of 8x is worse than a refusal.
  if (written_unit.size() >= 2 && written_unit.back() == 'b' && PrefixRank(written_unit[0]) > 0) {
    constexpr const char* kBitNames[] = {"kilobits", "megabits", "gigabits", "terabits"};
    const int rank = PrefixRank(written_unit[0]);
    const std::string number_text(absl::StripAsciiWhitespace(s.substr(0, letters)));
    return absl::InvalidArgumentError(absl::StrCat(
        key, ": '", text, "' is ambiguous: ", written_unit, " reads as ", kBitNames[rank - 1], "; write ",
        number_text, written_unit.substr(0, 1), "B (10^", 3 * rank, " bytes) or ", number_text,
        written_unit.substr(0, 1), "iB (2^", 10 * rank, " bytes)"));
  }
  const std::string unit = absl::AsciiStrToLower(written_unit);
  absl::string_view number = absl::StripAsciiWhitespace(s.substr(0, letters));
  double value = 0;
  if (unit.empty() || number.empty() || !absl::SimpleAtod(number, &value) || !std::isfinite(value) ||
      value < 0 || absl::StartsWith(number, "-")) {
    return NotA("size", key, text, kForms);
  }
  for (const auto& [name, scale] : kUnits) {
    if (unit != name) continue;
    const double bytes = value * scale;
    if (bytes > 9.2e18) return NotA("size", key, text, "larger than 8 EiB");
    if (bytes != std::floor(bytes)) return NotA("size", key, text, "not a whole number of bytes");
    return static_cast<int64_t>(bytes);
  }
  return NotA("size", key, text, kForms);
}

absl::StatusOr<absl::Duration> ParseDurationValue(absl::string_view key, absl::string_view text) {
  constexpr absl::string_view kForms =
      "expected seconds as a number (e.g. 30, 0.5) or a duration with units (e.g. 500ms, 30s, 5m, 1h30m)";
  absl::string_view s = absl::StripAsciiWhitespace(text);
  double seconds = 0;
  if (absl::SimpleAtod(s, &seconds)) {
    if (!std::isfinite(seconds)) return NotA("duration", key, text, kForms);
    return absl::Seconds(seconds);
  }
  absl::Duration d;
  if (s.empty() || !absl::ParseDuration(s, &d) || d == absl::InfiniteDuration() || d == -absl::InfiniteDuration()) {
    return NotA("duration", key, text, kForms);
  }
  return d;
}

absl::StatusOr<std::string> NormalizeListen(absl::string_view key, absl::string_view text) {
  constexpr absl::string_view kForms =
      "expected a Unix socket (unix:///abs/path, unix:/abs/path or /abs/path) or HOST:PORT";
  absl::string_view s = text;
  absl::string_view path;
  if (absl::ConsumePrefix(&s, "unix://") || absl::ConsumePrefix(&s, "unix:") || absl::StartsWith(s, "/")) {
    path = s;
    if (!absl::StartsWith(path, "/") || path.size() < 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(key, ": '", text, "': a Unix socket path must be absolute (", kForms, ")"));
    }
    return absl::StrCat("unix://", path);
  }
  // HOST:PORT, the host possibly a bracketed IPv6 address.
  const size_t colon = s.rfind(':');
  uint32_t port = 0;
  if (colon == absl::string_view::npos || colon == 0 || !absl::SimpleAtoi(s.substr(colon + 1), &port) ||
      port > 65535 || absl::StrContains(s, "/")) {
    return absl::InvalidArgumentError(absl::StrCat(key, ": '", text, "' is neither: ", kForms));
  }
  return std::string(text);
}

absl::StatusOr<std::string> ReadConfigFile(absl::string_view key, const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(key, ": cannot read ", path));
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace kvd
