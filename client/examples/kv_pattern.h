// The deterministic "KV" the example worker writes: byte j of token slot (token, position, layer)
// is a function of those four values alone, so any process can verify a block written by another.
#pragma once

#include <cstdint>

#include "proto/vocab/types.h"

namespace kvd::example {

inline uint8_t KvByte(Token token, int64_t position, int32_t layer, int64_t j) {
  uint64_t x = (static_cast<uint64_t>(token) << 32) ^ (static_cast<uint64_t>(position) << 12) ^
               static_cast<uint64_t>(layer) ^ (static_cast<uint64_t>(j >> 3) << 48);
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return static_cast<uint8_t>(x >> (8 * (j & 7)));
}

// The token the example "model" generates after `previous`.
inline Token NextToken(Token previous) {
  return static_cast<Token>((uint64_t{previous} * 1103515245u + 12345u) % 50000u);
}

}  // namespace kvd::example
