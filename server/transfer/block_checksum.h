// The checksum a peer offers with each block and a puller verifies after its reads: XXH3-64 over
// the block's contiguous form ([shard][layer][layer block bytes], as DeviceArena::ReadBlock
// writes it), whatever the slab layout. Host slabs are hashed in place; others (CUDA) are first
// copied to `scratch`. The caller guarantees nobody writes the block meanwhile.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu/device_arena.h"

namespace kvd {

absl::StatusOr<uint64_t> BlockChecksum(const DeviceArena& arena, PoolId pool, BlockIndex index,
                                       std::vector<uint8_t>* scratch);

}  // namespace kvd
