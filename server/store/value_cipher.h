// ValueCipher encrypts what kvd stores in a shared Redis: AES-256-GCM, a random 96-bit nonce per
// value, the value's identity digest as associated data (a sealed value cannot be moved under
// another block's key), and a key id beside each value so keys can rotate: the first key of the
// key file seals, every key in it opens.
//
// Key file (tiers.redis_encryption_key_file): one key per line, "<key id> <64 hex digits>"; the
// id is 1–16 characters of [A-Za-z0-9_-]; blank lines and lines starting with '#' are skipped. Key
// bytes are never logged. Thread-safe (immutable after Load).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvd {

class ValueCipher {
 public:
  static constexpr size_t kOverhead = 12 + 16;  // nonce + GCM tag

  // INVALID_ARGUMENT naming the file and line (never the key) when it cannot be used.
  static absl::StatusOr<std::unique_ptr<ValueCipher>> Load(const std::string& path);

  const std::string& sealing_key_id() const { return keys_.front().id; }
  // nonce || ciphertext || tag, under the sealing key.
  absl::StatusOr<std::string> Seal(absl::string_view plaintext, absl::string_view aad) const;
  // The plaintext of `sealed` under key `key_id`; DATA_LOSS when the key is unknown, the bytes
  // were altered, or `aad` differs from the sealer's.
  absl::StatusOr<std::string> Open(absl::string_view key_id, absl::string_view sealed, absl::string_view aad) const;

 private:
  struct Key {
    std::string id;
    std::string bytes;  // 32
  };
  explicit ValueCipher(std::vector<Key> keys) : keys_(std::move(keys)) {}
  std::vector<Key> keys_;
};

}  // namespace kvd
