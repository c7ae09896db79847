// libFuzzer target: arbitrary bytes as a value read back from Redis, opened as a block of a 1 KiB
// pool by a node with a secret only and by a node with an encryption key. OpenRemoteValue must
// refuse garbage with a status, never read or write past the block (ASan), never crash; the
// seed corpus holds valid values of each codec so mutations reach the decoders.
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "server/store/remote_value.h"

namespace {

constexpr int64_t kRaw = 1024;

const kvd::ValueCipher* FuzzCipher() {
  static const std::unique_ptr<kvd::ValueCipher> cipher = [] {
    char path[] = "/tmp/kvd-fuzz-keys-XXXXXX";
    const int fd = mkstemp(path);
    if (fd < 0) std::abort();
    const std::string line = "k1 " + std::string(64, 'a') + "\n";
    if (write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) std::abort();
    close(fd);
    auto c = kvd::ValueCipher::Load(path);
    unlink(path);
    if (!c.ok()) std::abort();
    return *std::move(c);
  }();
  return cipher.get();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvd;
  const RemoteBlockIdentity want{.pool = "default",
                                 .key = BlockKey{1, 2},
                                 .has_parent = true,
                                 .parent_key = BlockKey{3, 4},
                                 .digest = std::string(64, 'd'),
                                 .layout_tag = 77,
                                 .raw_length = kRaw};
  const absl::string_view value(reinterpret_cast<const char*>(data), size);
  std::string scratch;
  // Exactly one block: ASan reports any write past it.
  std::unique_ptr<uint8_t[]> out(new uint8_t[kRaw]);
  (void)OpenRemoteValue(value, want, RemoteValueKeys{.secret = "fuzz"}, &scratch, out.get());
  (void)OpenRemoteValue(value, want, RemoteValueKeys{.secret = "fuzz", .cipher = FuzzCipher()}, &scratch, out.get());
  return 0;
}
