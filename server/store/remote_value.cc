#include "server/store/remote_value.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include <memory>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "server/store/record_header.h"

namespace kvd {
namespace {

constexpr absl::string_view kMacLabel = "kvd-remote-mac-v1";
constexpr size_t kMacHexChars = 64;

// The associated data: the header as stored, less what depends on the stored bytes (checksum)
// and the MAC itself.
std::string AssociatedData(RecordHeader h, absl::string_view identity_key) {
  h.checksum = 0;
  h.object_key = std::string(identity_key);
  std::string aad;
  EncodeRecordHeader(h, &aad);
  return aad;
}

struct MacFree {
  void operator()(EVP_MAC* m) const { EVP_MAC_free(m); }
  void operator()(EVP_MAC_CTX* c) const { EVP_MAC_CTX_free(c); }
};

// HMAC-SHA256(secret, label || aad || stored), 64 hex digits; "" if OpenSSL fails. Without a
// secret the key is a fixed string: the MAC then only detects accidents (docs/security.md).
std::string Mac(absl::string_view secret, absl::string_view aad, absl::string_view stored) {
  static constexpr absl::string_view kNoSecret = "kvd: no tiers.redis_secret_file";
  const absl::string_view key = secret.empty() ? kNoSecret : secret;
  std::unique_ptr<EVP_MAC, MacFree> mac(EVP_MAC_fetch(nullptr, "HMAC", nullptr));
  std::unique_ptr<EVP_MAC_CTX, MacFree> ctx(mac != nullptr ? EVP_MAC_CTX_new(mac.get()) : nullptr);
  char digest_name[] = "SHA256";
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", digest_name, 0), OSSL_PARAM_construct_end()};
  unsigned char out[EVP_MAX_MD_SIZE];
  size_t len = 0;
  if (ctx == nullptr ||
      EVP_MAC_init(ctx.get(), reinterpret_cast<const unsigned char*>(key.data()), key.size(), params) != 1 ||
      EVP_MAC_update(ctx.get(), reinterpret_cast<const unsigned char*>(kMacLabel.data()), kMacLabel.size()) != 1 ||
      EVP_MAC_update(ctx.get(), reinterpret_cast<const unsigned char*>(aad.data()), aad.size()) != 1 ||
      EVP_MAC_update(ctx.get(), reinterpret_cast<const unsigned char*>(stored.data()), stored.size()) != 1 ||
      EVP_MAC_final(ctx.get(), out, &len, sizeof(out)) != 1) {
    return std::string();
  }
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(out), len));
}

RecordHeader HeaderOf(const RemoteBlockIdentity& b) {
  RecordHeader h;
  h.kind = b.kind;
  if (b.kind == RecordKind::kUnit) h.parts = b.parts;
  h.ns.pool = b.pool;
  h.key = b.key;
  h.has_parent = b.has_parent;
  h.parent_key = b.has_parent ? b.parent_key : BlockKey{};
  h.layout_tag = b.layout_tag;
  h.raw_length = b.raw_length;
  return h;
}

absl::Status Refuse(absl::string_view what) { return absl::DataLossError(absl::StrCat("redis value: ", what)); }

}  // namespace

absl::StatusOr<std::string> SealRemoteValue(const RemoteBlockIdentity& block, Codec codec, absl::string_view stored,
                                            const RemoteValueKeys& keys) {
  RecordHeader h = HeaderOf(block);
  h.codec = codec;
  std::string value;
  if (keys.cipher != nullptr) {
    const std::string identity = absl::StrCat(block.digest, ":", keys.cipher->sealing_key_id());
    h.object_key = identity;
    h.stored_length = static_cast<int64_t>(stored.size() + ValueCipher::kOverhead);
    absl::StatusOr<std::string> sealed = keys.cipher->Seal(stored, AssociatedData(h, identity));
    if (!sealed.ok()) return sealed.status();
    h.checksum = Checksum(sealed->data(), sealed->size());
    EncodeRecordHeader(h, &value);
    value += *sealed;
    return value;
  }
  h.stored_length = static_cast<int64_t>(stored.size());
  h.object_key = block.digest;
  const std::string mac = Mac(keys.secret, AssociatedData(h, block.digest), stored);
  if (mac.size() != kMacHexChars) return absl::InternalError("HMAC-SHA256 failed");
  h.object_key = absl::StrCat(block.digest, "#", mac);
  h.checksum = Checksum(stored.data(), stored.size());
  EncodeRecordHeader(h, &value);
  value.append(stored.data(), stored.size());
  return value;
}

absl::Status OpenRemoteValue(absl::string_view value, const RemoteBlockIdentity& want, const RemoteValueKeys& keys,
                             std::string* scratch, uint8_t* out) {
  absl::string_view in = value;
  absl::StatusOr<RecordHeader> decoded = DecodeRecordHeader(&in);
  if (!decoded.ok()) return Refuse(decoded.status().message());
  const RecordHeader& h = *decoded;
  // Identity: everything the reader knows of its block must match.
  if (h.kind != want.kind || !h.tokens.empty()) {
    return Refuse(want.kind == RecordKind::kUnit ? "not a unit record" : "not a block record");
  }
  if (want.kind == RecordKind::kUnit && h.parts != want.parts) return Refuse("unit parts differ");
  if (h.ns.pool != want.pool || h.key != want.key) return Refuse("pool or key differs");
  if (h.has_parent != want.has_parent || (want.has_parent && h.parent_key != want.parent_key)) {
    return Refuse("parent key differs");
  }
  if (h.layout_tag != want.layout_tag || h.raw_length != want.raw_length) return Refuse("layout differs");
  if (static_cast<int64_t>(in.size()) != h.stored_length) return Refuse("stored length differs from the payload");
  if (Checksum(in.data(), in.size()) != h.checksum) return Refuse("checksum mismatch");
  absl::string_view rest = h.object_key;
  if (!absl::ConsumePrefix(&rest, want.digest)) return Refuse("identity digest differs");
  // Authentication: "<digest>:<key id>" is AEAD ciphertext, "<digest>#<mac>" a MAC'd plaintext.
  absl::string_view payload = in;
  if (absl::ConsumePrefix(&rest, ":")) {
    if (rest.empty()) return Refuse("empty key id");
    if (keys.cipher == nullptr) return Refuse("encrypted, and no tiers.redis_encryption_key_file");
    absl::StatusOr<std::string> opened =
        keys.cipher->Open(rest, payload, AssociatedData(h, absl::StrCat(want.digest, ":", rest)));
    if (!opened.ok()) return Refuse(opened.status().message());
    *scratch = *std::move(opened);
    payload = *scratch;
  } else if (absl::ConsumePrefix(&rest, "#")) {
    if (keys.cipher != nullptr) return Refuse("unencrypted, and this node requires encryption");
    const std::string mac = Mac(keys.secret, AssociatedData(h, want.digest), payload);
    if (rest.size() != kMacHexChars || mac.size() != kMacHexChars ||
        CRYPTO_memcmp(rest.data(), mac.data(), kMacHexChars) != 0) {
      return Refuse("MAC mismatch");
    }
  } else {
    return Refuse("neither encrypted nor authenticated");
  }
  // Lengths again after opening: exactly raw_length bytes land in `out`, never more, never fewer.
  const auto* src = reinterpret_cast<const uint8_t*>(payload.data());
  if (h.codec == Codec::kNone && static_cast<int64_t>(payload.size()) != want.raw_length) {
    return Refuse(want.kind == RecordKind::kUnit ? "uncompressed payload is not one unit long"
                                                 : "uncompressed payload is not one block long");
  }
  absl::Status s = Decompress(h.codec, absl::MakeConstSpan(src, payload.size()), out, want.raw_length);
  if (!s.ok()) return Refuse(s.message());
  return absl::OkStatus();
}

}  // namespace kvd
