// Values in Redis (remote_value.h): sealed and opened with every codec, with and without a key;
// every header field that decides how bytes are read is authenticated; no length in a value can
// make a reader copy more or fewer than one block's bytes; encryption cannot be stripped.
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <functional>

#include <catch2/catch.hpp>

#include "server/store/record_header.h"
#include "server/store/remote_value.h"

namespace kvd {
namespace {

constexpr int64_t kRaw = 4096;

RemoteBlockIdentity Block() {
  return RemoteBlockIdentity{.pool = "default",
                             .key = BlockKey{1, 2},
                             .has_parent = true,
                             .parent_key = BlockKey{3, 4},
                             .digest = std::string(64, 'd'),
                             .layout_tag = 77,
                             .raw_length = kRaw};
}

std::string Compressible() {
  std::string raw(kRaw, '\0');
  for (int64_t i = 0; i < kRaw; ++i) raw[i] = static_cast<char>((i / 64) & 0xff);
  return raw;
}

// value with its header replaced by `edit(header)` (checksum and stored length recomputed, as a
// writer that knows the format but not the secret or key would).
std::string Rewrite(const std::string& value, const std::function<void(RecordHeader&, std::string&)>& edit) {
  absl::string_view in = value;
  RecordHeader h = *DecodeRecordHeader(&in);
  std::string payload(in);
  edit(h, payload);
  h.stored_length = static_cast<int64_t>(payload.size());
  h.checksum = Checksum(payload.data(), payload.size());
  std::string out;
  EncodeRecordHeader(h, &out);
  return out + payload;
}

std::unique_ptr<ValueCipher> Cipher(const std::string& line) {
  char path[] = "/tmp/kvd-remote-value-keys-XXXXXX";
  const int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  close(fd);
  std::ofstream(path) << line << "\n";
  std::unique_ptr<ValueCipher> c = *ValueCipher::Load(path);
  unlink(path);
  return c;
}

TEST_CASE("Remote values round-trip with every codec, with a secret and with a key", "[store][remote]") {
  std::unique_ptr<ValueCipher> cipher = Cipher("k1 " + std::string(64, 'a'));
  const std::string raw = Compressible();
  for (Codec codec : {Codec::kNone, Codec::kLz4, Codec::kZstd}) {
    for (const ValueCipher* c : {static_cast<const ValueCipher*>(nullptr), static_cast<const ValueCipher*>(cipher.get())}) {
      INFO(CodecName(codec) << (c ? " encrypted" : " with a MAC"));
      const RemoteValueKeys keys{.secret = "s", .cipher = c};
      std::string stored;
      const Codec used = Compress(codec, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(raw.data()), raw.size()), &stored);
      REQUIRE(used == codec);
      absl::StatusOr<std::string> v = SealRemoteValue(Block(), used, stored, keys);
      REQUIRE(v.ok());
      std::string scratch, out(kRaw, '\0');
      REQUIRE(OpenRemoteValue(*v, Block(), keys, &scratch, reinterpret_cast<uint8_t*>(out.data())).ok());
      REQUIRE(out == raw);
    }
  }
}

TEST_CASE("A remote value whose header or payload was rewritten without the secret is refused", "[store][remote]") {
  const RemoteValueKeys keys{.secret = "cluster-secret"};
  const std::string raw = Compressible();
  std::string lz4;
  REQUIRE(Compress(Codec::kLz4, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(raw.data()), raw.size()), &lz4) ==
          Codec::kLz4);
  const std::string v = *SealRemoteValue(Block(), Codec::kLz4, lz4, keys);
  const std::string plain = *SealRemoteValue(Block(), Codec::kNone, raw, keys);
  std::string scratch, out(kRaw, '\0');
  const auto open = [&](const std::string& value) {
    return OpenRemoteValue(value, Block(), keys, &scratch, reinterpret_cast<uint8_t*>(out.data()));
  };
  REQUIRE(open(v).ok());
  // The codec byte flipped: an lz4 payload read as one block of plain bytes (a heap over-read
  // before kvd authenticated the header).
  REQUIRE(absl::IsDataLoss(open(Rewrite(v, [](RecordHeader& h, std::string&) { h.codec = Codec::kNone; }))));
  // A short uncompressed payload, its header's lengths made to agree.
  REQUIRE(absl::IsDataLoss(open(Rewrite(plain, [](RecordHeader&, std::string& p) { p.resize(100); }))));
  // Forged bytes of the right length.
  REQUIRE(absl::IsDataLoss(open(Rewrite(plain, [](RecordHeader&, std::string& p) { p.assign(kRaw, 'Z'); }))));
  // raw_length raised in the header only: the reader's pool decides, never the value.
  REQUIRE(absl::IsDataLoss(open(Rewrite(plain, [](RecordHeader& h, std::string&) { h.raw_length = 1 << 30; }))));
  // The MAC dropped: neither encrypted nor authenticated.
  REQUIRE(absl::IsDataLoss(
      open(Rewrite(plain, [](RecordHeader& h, std::string&) { h.object_key = std::string(64, 'd'); }))));
  // Another secret.
  const RemoteValueKeys other{.secret = "another"};
  REQUIRE(absl::IsDataLoss(OpenRemoteValue(plain, Block(), other, &scratch, reinterpret_cast<uint8_t*>(out.data()))));
  // Another identity (a reader of another prefix).
  RemoteBlockIdentity b = Block();
  b.digest = std::string(64, 'e');
  REQUIRE(absl::IsDataLoss(OpenRemoteValue(plain, b, keys, &scratch, reinterpret_cast<uint8_t*>(out.data()))));
}

TEST_CASE("A node with an encryption key refuses values stripped of their encryption", "[store][remote]") {
  std::unique_ptr<ValueCipher> cipher = Cipher("k1 " + std::string(64, 'a'));
  const RemoteValueKeys keys{.secret = "", .cipher = cipher.get()};
  const std::string raw = Compressible();
  const std::string sealed = *SealRemoteValue(Block(), Codec::kNone, raw, keys);
  std::string scratch, out(kRaw, '\0');
  const auto open = [&](const std::string& value) {
    return OpenRemoteValue(value, Block(), keys, &scratch, reinterpret_cast<uint8_t*>(out.data()));
  };
  REQUIRE(open(sealed).ok());
  // What a writer without the key can make: a plaintext value with a valid MAC under the secret
  // (here even the right one), the key id dropped, or the codec byte flipped.
  const std::string unencrypted = *SealRemoteValue(Block(), Codec::kNone, std::string(kRaw, 'Z'), RemoteValueKeys{});
  REQUIRE(absl::IsDataLoss(open(unencrypted)));
  REQUIRE(absl::IsDataLoss(open(Rewrite(sealed, [](RecordHeader& h, std::string& p) {
    h.object_key = std::string(64, 'd');
    p.assign(kRaw, 'Z');
  }))));
  REQUIRE(absl::IsDataLoss(open(Rewrite(sealed, [](RecordHeader& h, std::string&) { h.codec = Codec::kLz4; }))));
  // An encrypted value on a node without the key is not served either.
  REQUIRE(absl::IsDataLoss(OpenRemoteValue(sealed, Block(), RemoteValueKeys{}, &scratch, reinterpret_cast<uint8_t*>(out.data()))));
}

TEST_CASE("A hybrid unit's value names its parts, authenticated: other parts, or a block's value, are refused",
          "[store][remote][hybrid]") {
  RemoteBlockIdentity unit = Block();
  unit.kind = RecordKind::kUnit;
  unit.parts = {{1, false}, {2, true}};
  const std::string raw = Compressible();
  const std::string value = *SealRemoteValue(unit, Codec::kNone, raw, RemoteValueKeys{.secret = "s"});
  std::string scratch;
  std::string out(kRaw, '\0');
  auto open = [&](const std::string& v, const RemoteBlockIdentity& want) {
    return OpenRemoteValue(v, want, RemoteValueKeys{.secret = "s"}, &scratch, reinterpret_cast<uint8_t*>(out.data()));
  };
  REQUIRE(open(value, unit).ok());
  CHECK(out == raw);
  // A reader that allocated for other parts, or for a block, gets nothing.
  RemoteBlockIdentity other = unit;
  other.parts = {{1, false}, {2, false}};
  CHECK(open(value, other).message() == "redis value: unit parts differ");
  CHECK(open(value, Block()).message() == "redis value: not a block record");
  const std::string block = *SealRemoteValue(Block(), Codec::kNone, raw, RemoteValueKeys{.secret = "s"});
  CHECK(open(block, unit).message() == "redis value: not a unit record");
  // Parts rewritten without the secret (the header's checksum made right) fail the MAC.
  const std::string forged = Rewrite(value, [](RecordHeader& h, std::string&) { h.parts[1].tail = false; });
  CHECK(open(forged, other).message() == "redis value: MAC mismatch");
}

}  // namespace
}  // namespace kvd
