// Files of the disk tier (G3). Every file is written the same durable way: to NAME.tmp, fsync,
// rename over NAME, fsync of the directory. A crash leaves either the old file or the new one,
// never a torn one; stray .tmp files are garbage that the next start deletes.
//
// Segment file: a batch of records written together and never modified afterwards.
//   [0,8)   magic "KVDSEG1\0"
//   [8,12)  u32 record count        [12,16) u32 zero
//   [16,24) u64 header bytes H      [24,32) u64 XXH3-64 of the header bytes
//   [32,32+H)  the record headers (record_header.h), each with its payload's offset and checksum
//   [32+H,...) the stored payloads
// A restart reads only [0, 32+H) of each segment; payloads are read, and verified, on demand.
// Nothing read is trusted unverified: the magic and the zero word are compared, H is bounded by
// the file, the header section is checksummed, and the record count (outside the checksum) must
// decode the section exactly, so a flipped bit in any of them is DATA_LOSS, never a crash or a
// huge allocation. Integers are fixed little-endian (the build refuses other hosts).
//
// Manifest: the list of live segments and of deleted object keys, with its own checksum.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/vocab/block_key.h"
#include "server/store/file_system.h"
#include "server/store/record_header.h"

namespace kvd {

// Writes `data` as dir/name durably (see above). The errno of the failing call is named;
// RESOURCE_EXHAUSTED for ENOSPC/EDQUOT.
absl::Status WriteFileDurably(const std::string& dir, const std::string& name,
                              absl::string_view data, FileSystem* fs = FileSystem::Default());
// The same for a file made of `pieces` written in order (no concatenated copy).
absl::Status WriteFileDurably(const std::string& dir, const std::string& name,
                              const std::vector<absl::string_view>& pieces,
                              FileSystem* fs = FileSystem::Default());

// Writes a segment durably; fills each header's offset. `payloads[i]` are the stored bytes of
// `headers[i]` (whose stored_length and checksum must match). Returns the file size.
absl::StatusOr<int64_t> WriteSegment(const std::string& dir, const std::string& name,
                                     std::vector<RecordHeader>& headers,
                                     const std::vector<absl::string_view>& payloads,
                                     FileSystem* fs = FileSystem::Default());
// The headers of a segment, reading only its header section. DATA_LOSS for a bad magic, a
// checksum mismatch or a record count that does not match the section; the failing call named
// (INTERNAL, NOT_FOUND, ...) when the file cannot be opened or read, which is no proof of damage.
// Records whose bytes lie past the end of the file (a truncated segment) are left out and counted
// in `*truncated_records` when given; the intact ones are returned.
absl::StatusOr<std::vector<RecordHeader>> ReadSegmentHeaders(const std::string& path,
                                                             int64_t* file_size,
                                                             int64_t* truncated_records = nullptr,
                                                             FileSystem* fs = FileSystem::Default());
// The stored bytes of one record, verified against its checksum: DATA_LOSS when they do not match.
absl::Status ReadRecordBytes(const std::string& path, const RecordHeader& h, std::string* stored,
                             FileSystem* fs = FileSystem::Default());

struct Tombstone {
  BlockKey key;
  uint64_t segment = 0;
};
struct Manifest {
  uint64_t generation = 0;              // +1 per write
  uint64_t next_segment = 1;            // number of the next segment file
  std::vector<uint64_t> segments;       // live segments, by number (SegmentName)
  std::vector<Tombstone> deleted;       // records of live segments deleted since they were written
};
// "seg-<number, 16 digits>.kvd"
std::string SegmentName(uint64_t number);
// The number of a segment file's name; nullopt for any other name.
std::optional<uint64_t> ParseSegmentName(absl::string_view name);
absl::Status WriteManifest(const std::string& dir, const Manifest& m, FileSystem* fs = FileSystem::Default());
// NOT_FOUND when there is none (a fresh directory); DATA_LOSS when it is damaged.
absl::StatusOr<Manifest> ReadManifest(const std::string& dir, FileSystem* fs = FileSystem::Default());

inline constexpr char kManifestName[] = "MANIFEST";
inline constexpr int64_t kSegmentPreambleBytes = 32;

}  // namespace kvd
