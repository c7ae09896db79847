// libFuzzer target: arbitrary bytes as everything the disk tier reads back — a record header, a
// segment file, a manifest, and compressed payloads of each codec. Decoders must reject garbage
// with a status, never crash, never read out of bounds, never allocate without bound.
#include <fuzzer/FuzzedDataProvider.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "server/store/codec.h"
#include "server/store/record_header.h"
#include "server/store/segment_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvd;
  static const std::string dir = [] {
    char tmpl[] = "/tmp/kvd-fuzz-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) std::abort();
    return std::string(tmpl);
  }();
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  absl::string_view in(bytes);
  while (!in.empty() && DecodeRecordHeader(&in).ok()) {
  }
  {
    std::ofstream(dir + "/seg", std::ios::binary | std::ios::trunc) << bytes;
    int64_t file_size = 0;
    if (auto headers = ReadSegmentHeaders(dir + "/seg", &file_size); headers.ok()) {
      std::string stored;
      for (const RecordHeader& h : *headers) {
        if (h.stored_length > (int64_t{1} << 20) || h.raw_length > (int64_t{1} << 20)) continue;
        if (ReadRecordBytes(dir + "/seg", h, &stored).ok()) {
          std::string raw(static_cast<size_t>(h.raw_length), '\0');
          (void)Decompress(h.codec, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(stored.data()), stored.size()),
                           reinterpret_cast<uint8_t*>(raw.data()), h.raw_length);
        }
      }
    }
  }
  {
    std::ofstream(dir + "/" + kManifestName, std::ios::binary | std::ios::trunc) << bytes;
    (void)ReadManifest(dir);
  }
  FuzzedDataProvider fdp(data, size);
  const Codec codec = static_cast<Codec>(fdp.ConsumeIntegralInRange<int>(0, 3));
  const int64_t raw_length = fdp.ConsumeIntegralInRange<int64_t>(0, 1 << 16);
  const std::string payload = fdp.ConsumeRemainingBytesAsString();
  std::string out(static_cast<size_t>(raw_length), '\0');
  (void)Decompress(codec, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()), payload.size()),
                   reinterpret_cast<uint8_t*>(out.data()), raw_length);
  return 0;
}
