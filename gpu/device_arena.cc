#include "gpu/device_arena.h"

#include "absl/strings/str_cat.h"
#include "gpu/slab_layout.h"

namespace kvd {
namespace {

absl::Status CheckBlock(const std::vector<PoolGeometry>& pools, PoolId pool, BlockIndex index) {
  if (pool >= pools.size()) return absl::OutOfRangeError(absl::StrCat("no pool ", pool));
  if (index >= pools[pool].capacity_blocks) {
    return absl::OutOfRangeError(absl::StrCat("block ", index, " is past pool '", pools[pool].name,
                                              "' (", pools[pool].capacity_blocks, " blocks)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DeviceArena::ReadBlock(PoolId pool, BlockIndex index, uint8_t* dst) const {
  if (absl::Status s = CheckBlock(geometries_, pool, index); !s.ok()) return s;
  const PoolGeometry& g = geometries_[pool];
  const SlabLayout layout(g);
  const int64_t chunk = layout.layer_block_bytes();
  for (int32_t shard = 0; shard < g.num_shards; ++shard) {
    const uint8_t* base = SlabBase(pool, static_cast<uint32_t>(shard));
    if (base == nullptr) return absl::InternalError(absl::StrCat("no slab for shard ", shard));
    for (int32_t layer = 0; layer < g.num_layers; ++layer) {
      uint8_t* out = dst + (int64_t{shard} * g.num_layers + layer) * chunk;
      if (absl::Status s = CopyChunk(out, base + layout.OffsetUnchecked(index, layer), chunk, false);
          !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status DeviceArena::WriteBlock(PoolId pool, BlockIndex index, const uint8_t* src) const {
  if (absl::Status s = CheckBlock(geometries_, pool, index); !s.ok()) return s;
  const PoolGeometry& g = geometries_[pool];
  const SlabLayout layout(g);
  const int64_t chunk = layout.layer_block_bytes();
  for (int32_t shard = 0; shard < g.num_shards; ++shard) {
    uint8_t* base = SlabBase(pool, static_cast<uint32_t>(shard));
    if (base == nullptr) return absl::InternalError(absl::StrCat("no slab for shard ", shard));
    for (int32_t layer = 0; layer < g.num_layers; ++layer) {
      const uint8_t* in = src + (int64_t{shard} * g.num_layers + layer) * chunk;
      if (absl::Status s = CopyChunk(base + layout.OffsetUnchecked(index, layer), in, chunk, true);
          !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvd
