#include "proto/vocab/media_span.h"

#include "absl/strings/strip.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvd {
namespace {
constexpr absl::string_view kPrefix = "mm@";
}  // namespace

std::string PositionedMediaKey(const MediaSpan& span) {
  return absl::StrCat(kPrefix, span.offset, "+", span.length, ":", span.identifier);
}

std::optional<MediaSpan> ParsePositionedMediaKey(absl::string_view key) {
  if (!absl::ConsumePrefix(&key, kPrefix)) return std::nullopt;
  const size_t plus = key.find('+');
  const size_t colon = key.find(':');
  if (plus == absl::string_view::npos || colon == absl::string_view::npos || plus > colon) return std::nullopt;
  MediaSpan span;
  if (!absl::SimpleAtoi(key.substr(0, plus), &span.offset) ||
      !absl::SimpleAtoi(key.substr(plus + 1, colon - plus - 1), &span.length) || span.offset < 0 || span.length < 0) {
    return std::nullopt;
  }
  span.identifier = std::string(key.substr(colon + 1));
  return span;
}

}  // namespace kvd
