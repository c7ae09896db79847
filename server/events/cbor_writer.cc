#include "server/events/cbor_writer.h"

namespace kvd {

void CborWriter::Head(uint8_t major, uint64_t v) {
  const uint8_t m = static_cast<uint8_t>(major << 5);
  int extra_bytes = 0;
  if (v < 24) {
    out_.push_back(static_cast<char>(m | v));
    return;
  } else if (v <= 0xff) {
    out_.push_back(static_cast<char>(m | 24));
    extra_bytes = 1;
  } else if (v <= 0xffff) {
    out_.push_back(static_cast<char>(m | 25));
    extra_bytes = 2;
  } else if (v <= 0xffffffffULL) {
    out_.push_back(static_cast<char>(m | 26));
    extra_bytes = 4;
  } else {
    out_.push_back(static_cast<char>(m | 27));
    extra_bytes = 8;
  }
  for (int i = extra_bytes - 1; i >= 0; --i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace kvd
