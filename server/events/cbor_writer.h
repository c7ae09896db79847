// CborWriter appends canonical CBOR (RFC 8949 §4.2.1: shortest-form integer heads, definite
// lengths) for the few types router block hashes need: unsigned and negative integers, byte and
// text strings, arrays and null. It encodes exactly what Python's cbor2.dumps(x, canonical=True)
// produces for ints, bytes, str, tuples/lists and None.
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvd {

class CborWriter {
 public:
  void Uint(uint64_t v) { Head(0, v); }
  void Int(int64_t v) {
    if (v >= 0) {
      Head(0, static_cast<uint64_t>(v));
    } else {
      Head(1, static_cast<uint64_t>(-(v + 1)));
    }
  }
  void Bytes(absl::Span<const uint8_t> b) {
    Head(2, b.size());
    out_.append(reinterpret_cast<const char*>(b.data()), b.size());
  }
  void Text(absl::string_view s) {
    Head(3, s.size());
    out_.append(s.data(), s.size());
  }
  // Starts an array of `n` items; the caller writes them next.
  void Array(uint64_t n) { Head(4, n); }
  void Null() { out_.push_back(static_cast<char>(0xf6)); }

  const std::string& data() const { return out_; }
  void Clear() { out_.clear(); }

 private:
  // The initial byte (major type, additional info) and the argument in its shortest form.
  void Head(uint8_t major, uint64_t v);

  std::string out_;
};

}  // namespace kvd
