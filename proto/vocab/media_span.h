// MediaSpan: a multimodal item of a prompt (an image, an audio clip) with the prompt positions its
// placeholder tokens take, [offset, offset + length). It travels inside Namespace::media_keys as
// the entry "mm@<offset>+<length>:<identifier>", so every place that stores a namespace (record
// headers, Redis digests, a handoff) keeps the positions without a format change, and the
// namespace's identity covers them. Router events read them back to give each block the extra
// keys vLLM's prefix cache gives it: (identifier, offset - block start) for each item the block
// overlaps (server/events/router_hash.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace kvd {

struct MediaSpan {
  std::string identifier;
  int64_t offset = 0;
  int64_t length = 0;
  // Whether the item takes any of the prompt positions [start, end).
  bool Overlaps(int64_t start, int64_t end) const { return length > 0 && offset < end && start < offset + length; }
};

std::string PositionedMediaKey(const MediaSpan& span);
// The span a PositionedMediaKey entry names; nullopt for any other media key.
std::optional<MediaSpan> ParsePositionedMediaKey(absl::string_view key);

}  // namespace kvd
