#include "proto/vocab/pool_geometry.h"

#include "absl/strings/str_cat.h"

namespace kvd {

absl::Status PoolGeometry::Validate() const {
  auto bad = [this](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("pool '", name, "': ", what));
  };
  if (name.empty()) return absl::InvalidArgumentError("pool name must not be empty");
  // The name is a model name in router topics (kv@{node}@{pool}), metrics labels and Redis keys:
  // printable ASCII without spaces and without '@' (the topic's separator), at most 128 bytes.
  if (name.size() > 128) return bad("the name is longer than 128 bytes");
  for (char c : name) {
    if (c <= ' ' || c > '~' || c == '@') {
      return bad("the name may hold printable ASCII except spaces and '@' (it names the pool in router "
                 "topics kv@{node}@{pool}, metrics and Redis keys)");
    }
  }
  if (block_tokens <= 0 || block_tokens > 4096) return bad("block_tokens must be in (0, 4096]");
  if (num_layers <= 0 || num_layers > 4096) return bad("num_layers must be in (0, 4096]");
  if (bytes_per_token_per_layer <= 0 || bytes_per_token_per_layer > (int64_t{1} << 24)) {
    return bad("bytes_per_token_per_layer must be in (0, 16 MiB]");
  }
  if (capacity_blocks <= 0 || capacity_blocks > (int64_t{1} << 31)) {
    return bad("capacity_blocks must be in (0, 2^31]");
  }
  if (max_model_len < block_tokens) return bad("max_model_len must be >= block_tokens");
  if (num_shards <= 0 || num_shards > 64) return bad("num_shards must be in (0, 64]");
  if (!devices.empty() && static_cast<int32_t>(devices.size()) != num_shards) {
    return bad("devices must list one device per shard");
  }
  for (int32_t d : devices) {
    if (d < 0) return bad("device ordinals must be >= 0");
  }
  if (absl::Status s = kv.Validate(bytes_per_token_per_layer); !s.ok()) return bad(s.message());
  if (absl::Status s = CheckModelFingerprint(model_fingerprint); !s.ok()) return bad(s.message());
  // Groups are checked where they are resolved; a geometry built by hand must have been resolved
  // (its first_block, offsets and capacity_blocks are what the slab layout and the index space use).
  PoolGeometry resolved = *this;
  if (absl::Status s = resolved.ResolveGroups(); !s.ok()) return bad(s.message());
  if (resolved.capacity_blocks != capacity_blocks) {
    return bad(absl::StrCat("capacity_blocks ", capacity_blocks, " is not the groups' sum ", resolved.capacity_blocks,
                            " (call ResolveGroups)"));
  }
  for (size_t j = 0; j < groups.size(); ++j) {
    if (resolved.groups[j].first_block != groups[j].first_block ||
        resolved.groups[j].region_offset_bytes != groups[j].region_offset_bytes) {
      return bad(absl::StrCat("groups[", j, "]: first_block / region_offset_bytes are not resolved (call ResolveGroups)"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckModelFingerprint(const std::string& fingerprint) {
  if (fingerprint.size() > kMaxModelFingerprintBytes) {
    return absl::InvalidArgumentError(absl::StrCat("model_fingerprint is ", fingerprint.size(), " bytes; at most ",
                                                   kMaxModelFingerprintBytes, " are allowed"));
  }
  // It travels in Redis keys' neighbours, log lines, status messages and peer offers: printable
  // ASCII without spaces, so that what an operator reads is what is compared.
  for (size_t i = 0; i < fingerprint.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(fingerprint[i]);
    if (c <= ' ' || c > '~') {
      return absl::InvalidArgumentError(absl::StrCat("model_fingerprint has byte 0x", absl::Hex(c, absl::kZeroPad2),
                                                     " at offset ", i, "; only printable ASCII without spaces is allowed"));
    }
  }
  return absl::OkStatus();
}

std::string PoolAllocatorName(PoolAllocator allocator) {
  return allocator == PoolAllocator::kVmm ? "vmm" : "ipc";
}

std::string PoolLayoutName(PoolLayout layout) {
  return layout == PoolLayout::kLayerMajor ? "layer_major" : "block_major";
}

}  // namespace kvd
