// RecordHeader describes one stored record (a prefix block or an object) on the disk tier: what it
// is (namespace, key, parent key, tokens or object key), how its bytes are stored (codec, lengths,
// checksum) and where (offset in its segment file). The same header travels with a record in every
// stored form, so a reader can verify and decode bytes without any other state.
//
// Encoding: little-endian fixed-width integers and u32-length-prefixed strings. DecodeRecordHeader
// checks every length against the bytes left and sane limits, so garbage is an error, never a
// crash or a huge allocation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/vocab/block_key.h"
#include "proto/vocab/pool_geometry.h"
#include "proto/vocab/types.h"
#include "server/store/codec.h"

namespace kvd {

// kCheckpoint: an interrupted generation's checkpoint; object_key is its request id, tokens its
// tokens, and the payload [u32 engine state bytes][engine state][its blocks' bytes, in order].
// kUnit: a hybrid pool's spine node with the components that travel with it (docs/hybrid.md
// §2.9): identified like kBlock (key, parent, tokens), `parts` naming each component's group (and
// a state checkpoint's tail flag); the payload is the spine block's bytes, then each part's, in
// `parts` order, each its group's unit across all shards.
enum class RecordKind : uint8_t { kBlock = 0, kObject = 1, kCheckpoint = 2, kUnit = 3 };

// A prefix block of the chain (kBlock, or a hybrid pool's kUnit): found and verified by key,
// parent and tokens.
inline bool IsChainRecord(RecordKind k) { return k == RecordKind::kBlock || k == RecordKind::kUnit; }

// One component of a kUnit record.
struct UnitRecordPart {
  uint8_t group = 0;  // the pool's group index (never the spine's)
  bool tail = false;  // a state group's End tail checkpoint
  bool operator==(const UnitRecordPart&) const = default;
};

struct RecordHeader {
  RecordKind kind = RecordKind::kBlock;
  Namespace ns;
  BlockKey key;                // kBlock: the chained block key; kObject: ObjectKey(ns, object_key)
  BlockKey parent_key;         // kBlock with has_parent
  bool has_parent = false;
  std::vector<Token> tokens;   // kBlock: the block's tokens
  std::string object_key;      // kObject: the caller's content key; kCheckpoint: the request id
  Codec codec = Codec::kNone;
  int64_t raw_length = 0;      // bytes once decoded
  int64_t stored_length = 0;   // bytes as stored
  uint64_t checksum = 0;       // Checksum() of the stored bytes
  uint64_t offset = 0;         // of the stored bytes in the segment file
  // kBlock, kCheckpoint: LayoutTag() of the pool geometry that wrote it; a record is served only
  // to a pool with the same tag (a pool redefined under the same name, or declaring another
  // model fingerprint, never gets old bytes).
  uint64_t layout_tag = 0;
  // kUnit only (encoded after layout_tag, for that kind alone, so other records are unchanged).
  std::vector<UnitRecordPart> parts;
};

// The size of the smallest encoded header (every string and list empty): bounds how many headers
// a section of N bytes can hold.
inline constexpr uint64_t kMinRecordHeaderBytes = 103;

// Appends the encoding of `h` to `out`.
void EncodeRecordHeader(const RecordHeader& h, std::string* out);
// Decodes one header from the front of `*in` and advances it. DATA_LOSS naming what was wrong.
absl::StatusOr<RecordHeader> DecodeRecordHeader(absl::string_view* in);

// The key of a checkpoint record: by request id alone (a resume names only the id).
BlockKey CheckpointKey(absl::string_view request_id);

// A fingerprint of everything that fixes a block's bytes: the layout and, when the pool declares
// one, its model fingerprint (pool_geometry.h). Pools without a fingerprint get the tag they had
// before fingerprints existed. A hybrid pool's tag also covers its groups (kind, layers, unit
// bytes, window, chunk, k), so a record of another grouping is never served.
uint64_t LayoutTag(const PoolGeometry& g);
// Why a record tagged `record_tag` is not served to pool `g` (whose tag differs), as precisely as
// the tag allows: records keep only a hash of the fingerprint they were written under.
std::string DescribeTagMismatch(const PoolGeometry& g, uint64_t record_tag);

// The key of an object: XXH3-128 over the namespace root key and the content key, so objects of
// different namespaces never meet.
BlockKey ObjectKey(const Namespace& ns, absl::string_view object_key);

}  // namespace kvd
