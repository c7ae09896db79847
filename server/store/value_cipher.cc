#include "server/store/value_cipher.h"

#include <openssl/evp.h>
#include <openssl/rand.h>

#include <fstream>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvd {
namespace {

struct CtxFree {
  void operator()(EVP_CIPHER_CTX* c) const { EVP_CIPHER_CTX_free(c); }
};
using Ctx = std::unique_ptr<EVP_CIPHER_CTX, CtxFree>;

bool ValidId(absl::string_view id) {
  if (id.empty() || id.size() > 16) return false;
  for (char c : id) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-') return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ValueCipher>> ValueCipher::Load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("tiers.redis_encryption_key_file: cannot read ", path));
  std::vector<Key> keys;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    absl::string_view l = absl::StripAsciiWhitespace(line);
    if (l.empty() || l[0] == '#') continue;
    std::vector<absl::string_view> parts = absl::StrSplit(l, ' ', absl::SkipEmpty());
    std::string bytes;
    if (parts.size() != 2 || !ValidId(parts[0]) || parts[1].size() != 64 ||
        !absl::c_all_of(parts[1], [](char c) { return absl::ascii_isxdigit(static_cast<unsigned char>(c)); })) {
      return absl::InvalidArgumentError(absl::StrCat("tiers.redis_encryption_key_file ", path, " line ", n,
                                                     ": want \"<key id> <64 hex digits>\""));
    }
    bytes = absl::HexStringToBytes(parts[1]);
    for (const Key& k : keys) {
      if (k.id == parts[0]) {
        return absl::InvalidArgumentError(absl::StrCat("tiers.redis_encryption_key_file ", path, " line ", n,
                                                       ": key id '", parts[0], "' appears twice"));
      }
    }
    keys.push_back(Key{std::string(parts[0]), std::move(bytes)});
  }
  if (keys.empty()) return absl::InvalidArgumentError(absl::StrCat("tiers.redis_encryption_key_file ", path, ": no key"));
  return std::unique_ptr<ValueCipher>(new ValueCipher(std::move(keys)));
}

absl::StatusOr<std::string> ValueCipher::Seal(absl::string_view plaintext, absl::string_view aad) const {
  const Key& key = keys_.front();
  std::string out(12 + plaintext.size() + 16, '\0');
  auto* nonce = reinterpret_cast<unsigned char*>(out.data());
  if (RAND_bytes(nonce, 12) != 1) return absl::InternalError("no random bytes for a nonce");
  Ctx ctx(EVP_CIPHER_CTX_new());
  int len = 0;
  auto* body = nonce + 12;
  if (ctx == nullptr ||
      EVP_EncryptInit_ex(ctx.get(), EVP_aes_256_gcm(), nullptr,
                         reinterpret_cast<const unsigned char*>(key.bytes.data()), nonce) != 1 ||
      EVP_EncryptUpdate(ctx.get(), nullptr, &len, reinterpret_cast<const unsigned char*>(aad.data()),
                        static_cast<int>(aad.size())) != 1 ||
      EVP_EncryptUpdate(ctx.get(), body, &len, reinterpret_cast<const unsigned char*>(plaintext.data()),
                        static_cast<int>(plaintext.size())) != 1 ||
      EVP_EncryptFinal_ex(ctx.get(), body + len, &len) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_GET_TAG, 16, body + plaintext.size()) != 1) {
    return absl::InternalError("AES-256-GCM encryption failed");
  }
  return out;
}

absl::StatusOr<std::string> ValueCipher::Open(absl::string_view key_id, absl::string_view sealed,
                                              absl::string_view aad) const {
  const Key* key = nullptr;
  for (const Key& k : keys_) {
    if (k.id == key_id) key = &k;
  }
  if (key == nullptr) return absl::DataLossError(absl::StrCat("sealed under unknown key id '", key_id, "'"));
  if (sealed.size() < kOverhead) return absl::DataLossError("sealed value too short");
  const auto* nonce = reinterpret_cast<const unsigned char*>(sealed.data());
  const size_t n = sealed.size() - kOverhead;
  std::string out(n, '\0');
  Ctx ctx(EVP_CIPHER_CTX_new());
  int len = 0;
  std::string tag(sealed.substr(12 + n, 16));
  if (ctx == nullptr ||
      EVP_DecryptInit_ex(ctx.get(), EVP_aes_256_gcm(), nullptr,
                         reinterpret_cast<const unsigned char*>(key->bytes.data()), nonce) != 1 ||
      EVP_DecryptUpdate(ctx.get(), nullptr, &len, reinterpret_cast<const unsigned char*>(aad.data()),
                        static_cast<int>(aad.size())) != 1 ||
      EVP_DecryptUpdate(ctx.get(), reinterpret_cast<unsigned char*>(out.data()), &len, nonce + 12,
                        static_cast<int>(n)) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_SET_TAG, 16, tag.data()) != 1 ||
      EVP_DecryptFinal_ex(ctx.get(), reinterpret_cast<unsigned char*>(out.data()) + len, &len) != 1) {
    return absl::DataLossError("sealed value failed authentication");
  }
  return out;
}

}  // namespace kvd
