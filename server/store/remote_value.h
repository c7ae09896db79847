// The value kvd stores in Redis for one prefix block, and how a reader opens it. Anyone who can
// write to the Redis server can write any bytes under any key, so a reader trusts nothing in a
// value that it did not check against its own request or that was not authenticated:
//
//   value  = EncodeRecordHeader(header) || stored bytes
//   header : kind kBlock (a hybrid unit: kUnit and its parts), ns.pool, key, parent key, codec,
//            raw_length, stored_length, layout tag,
//            checksum (XXH3 of the stored bytes), object_key:
//              encrypted   "<digest>:<key id>"   stored = AES-256-GCM(compressed bytes)
//              unencrypted "<digest>#<mac>"      stored = compressed bytes
//   digest : RemoteTier::ValueDigest, HMAC(secret) of the block's identity (namespace, key,
//            parent key, tokens), which never travels in clear
//   aad    : the header's encoding with checksum 0 and object_key "<digest>[:<key id>]": every
//            field that decides how the stored bytes are read (codec, both lengths, layout tag,
//            pool, keys) — the associated data of the AEAD, or with the payload after it the
//            message of mac = HMAC-SHA256(secret, "kvd-remote-mac-v1" || aad || stored)
//
// So a value's header cannot be changed (the codec byte flipped, a length or layout altered) nor
// its payload replaced without the key (encrypted) or the secret (unencrypted). A node with an
// encryption key refuses unencrypted values (encryption cannot be stripped). Whatever the header
// says, a reader copies exactly raw_length bytes into the pool, and only after checking that the
// opened or decompressed bytes are exactly that long. docs/security.md says what each of secret
// and key protects.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/vocab/block_key.h"
#include "server/store/codec.h"
#include "server/store/record_header.h"
#include "server/store/value_cipher.h"

namespace kvd {

// What authenticates values: the cluster's secret (tiers.redis_secret_file; may be empty, then a
// MAC only detects accidents) and, when configured, the encryption key file's cipher.
struct RemoteValueKeys {
  absl::string_view secret;
  const ValueCipher* cipher = nullptr;
};

// A block as its reader knows it from its own request; a value is served only if it matches.
// A hybrid pool's unit (docs/hybrid.md §2.9) is kind kUnit with its `parts`: the header names them
// (authenticated with the rest), and the payload is the unit's record bytes (the spine block, then
// each part's), raw_length long. A reader names the parts it allocated for; other parts are refused.
struct RemoteBlockIdentity {
  RecordKind kind = RecordKind::kBlock;
  std::vector<UnitRecordPart> parts;  // kUnit only
  std::string pool;
  BlockKey key;
  bool has_parent = false;
  BlockKey parent_key;
  std::string digest;  // RemoteTier::ValueDigest of the block
  uint64_t layout_tag = 0;
  int64_t raw_length = 0;  // the pool's block bytes (a unit's: its record's)
};

// The value for `block` whose raw bytes compressed with `codec` are `stored` (codec kNone: the
// raw bytes). INTERNAL when encryption fails.
absl::StatusOr<std::string> SealRemoteValue(const RemoteBlockIdentity& block, Codec codec, absl::string_view stored,
                                            const RemoteValueKeys& keys);

// Checks `value` against `want` and writes its raw bytes to out[0, want.raw_length); `scratch`
// holds decrypted bytes. DATA_LOSS naming the first check that failed; `out` may then hold garbage
// but nothing past raw_length is ever written or read.
absl::Status OpenRemoteValue(absl::string_view value, const RemoteBlockIdentity& want, const RemoteValueKeys& keys,
                             std::string* scratch, uint8_t* out);

}  // namespace kvd
