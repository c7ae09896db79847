#include "gpu/device_arena.h"

#include "absl/strings/str_cat.h"
#include "gpu/slab_layout.h"
#include "proto/vocab/status_macros.h"

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

absl::Status DeviceArena::CopyBlockAllShards(PoolId pool, BlockIndex index, uint8_t* buffer,
                                             bool to_slab) const {
  if (absl::Status s = CheckBlock(geometries_, pool, index); !s.ok()) return s;
  const PoolGeometry& g = geometries_[pool];
  const StridedBlock region = SlabLayout(g).Block(index);
  for (int32_t shard = 0; shard < g.num_shards; ++shard) {
    uint8_t* base = SlabBase(pool, static_cast<uint32_t>(shard));
    if (base == nullptr) return absl::InternalError(absl::StrCat("no slab for shard ", shard));
    const int device = DeviceOfShard(g, static_cast<uint32_t>(shard));
    KVD_RETURN_IF_ERROR(CopyBlock(base, device, region, buffer + shard * region.bytes(), to_slab));
  }
  return absl::OkStatus();
}

absl::Status DeviceArena::ReadBlock(PoolId pool, BlockIndex index, uint8_t* dst) const {
  return CopyBlockAllShards(pool, index, dst, /*to_slab=*/false);
}

absl::Status DeviceArena::WriteBlock(PoolId pool, BlockIndex index, const uint8_t* src) const {
  return CopyBlockAllShards(pool, index, const_cast<uint8_t*>(src), /*to_slab=*/true);
}

}  // namespace kvd
