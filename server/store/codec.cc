#include "server/store/codec.h"

#include <lz4.h>
#include <xxhash.h>
#include <zstd.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvd {
namespace {

constexpr int kZstdLevel = 1;  // KV is high-entropy: level 1 keeps most of the gain at far less CPU

}  // namespace

std::string CodecName(Codec codec) {
  switch (codec) {
    case Codec::kNone: return "none";
    case Codec::kLz4: return "lz4";
    case Codec::kZstd: return "zstd";
  }
  return absl::StrCat("codec(", static_cast<int>(codec), ")");
}

absl::StatusOr<Codec> ParseCodec(absl::string_view name) {
  if (name == "none") return Codec::kNone;
  if (name == "lz4") return Codec::kLz4;
  if (name == "zstd") return Codec::kZstd;
  return absl::InvalidArgumentError(absl::StrCat("unknown codec '", name, "' (none, lz4, zstd)"));
}

Codec Compress(Codec codec, absl::Span<const uint8_t> raw, std::string* out) {
  const char* src = reinterpret_cast<const char*>(raw.data());
  size_t written = 0;
  switch (codec) {
    case Codec::kNone:
      break;
    case Codec::kLz4: {
      out->resize(static_cast<size_t>(LZ4_compressBound(static_cast<int>(raw.size()))));
      const int n = LZ4_compress_default(src, out->data(), static_cast<int>(raw.size()),
                                         static_cast<int>(out->size()));
      written = n > 0 ? static_cast<size_t>(n) : 0;
      break;
    }
    case Codec::kZstd: {
      out->resize(ZSTD_compressBound(raw.size()));
      const size_t n = ZSTD_compress(out->data(), out->size(), src, raw.size(), kZstdLevel);
      written = ZSTD_isError(n) ? 0 : n;
      break;
    }
  }
  if (codec == Codec::kNone || written == 0 || written >= raw.size()) {
    out->assign(src, raw.size());
    return Codec::kNone;
  }
  out->resize(written);
  return codec;
}

absl::Status Decompress(Codec codec, absl::Span<const uint8_t> stored, uint8_t* out,
                        int64_t raw_length) {
  const char* src = reinterpret_cast<const char*>(stored.data());
  switch (codec) {
    case Codec::kNone:
      if (static_cast<int64_t>(stored.size()) != raw_length) break;
      std::memcpy(out, src, stored.size());
      return absl::OkStatus();
    case Codec::kLz4: {
      const int n = LZ4_decompress_safe(src, reinterpret_cast<char*>(out),
                                        static_cast<int>(stored.size()), static_cast<int>(raw_length));
      if (n != raw_length) break;
      return absl::OkStatus();
    }
    case Codec::kZstd: {
      const size_t n = ZSTD_decompress(out, static_cast<size_t>(raw_length), src, stored.size());
      if (ZSTD_isError(n) || static_cast<int64_t>(n) != raw_length) break;
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown codec ", static_cast<int>(codec), " in a block header"));
  }
  return absl::DataLossError(absl::StrCat(CodecName(codec), " data does not decode to ",
                                          raw_length, " bytes"));
}

uint64_t Checksum(const void* data, size_t size) { return XXH3_64bits(data, size); }

}  // namespace kvd
