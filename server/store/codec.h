// Codecs for blocks stored on the disk tier (G3), and the checksum every stored block carries.
//
// The codec is chosen per tier in the configuration and recorded in each block's header, so a
// daemon restarted with another setting still reads what the old one wrote. A block that does not
// shrink is stored uncompressed (and its header says so).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvd {

enum class Codec : uint8_t { kNone = 0, kLz4 = 1, kZstd = 2 };

// "none", "lz4", "zstd".
std::string CodecName(Codec codec);
// INVALID_ARGUMENT for anything else.
absl::StatusOr<Codec> ParseCodec(absl::string_view name);

// Encodes `raw` with `codec` into `out` (replacing its contents) and returns the codec actually
// used: kNone when compression would not save bytes.
Codec Compress(Codec codec, absl::Span<const uint8_t> raw, std::string* out);
// Decodes `stored` into exactly `raw_length` bytes at `out`. DATA_LOSS when the bytes do not
// decode to that length; INVALID_ARGUMENT for an unknown codec.
absl::Status Decompress(Codec codec, absl::Span<const uint8_t> stored, uint8_t* out,
                        int64_t raw_length);

// XXH3-64 of the bytes: the per-block checksum of stored data.
uint64_t Checksum(const void* data, size_t size);

}  // namespace kvd
