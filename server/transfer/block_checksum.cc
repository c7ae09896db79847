#include "server/transfer/block_checksum.h"

#include <xxhash.h>

#include <memory>

#include "absl/strings/str_cat.h"
#include "gpu/slab_layout.h"

namespace kvd {

absl::StatusOr<uint64_t> BlockChecksum(const DeviceArena& arena, PoolId pool, BlockIndex index,
                                       std::vector<uint8_t>* scratch) {
  if (pool >= arena.geometries().size()) return absl::OutOfRangeError(absl::StrCat("no pool ", pool));
  const PoolGeometry& g = arena.geometries()[pool];
  if (index >= g.capacity_blocks) {
    return absl::OutOfRangeError(absl::StrCat("block ", index, " is past pool '", g.name, "'"));
  }
  if (arena.HostAddress(pool, 0) == nullptr) {
    // The block's contiguous form: in a hybrid pool its group's unit, on every shard.
    scratch->resize(static_cast<size_t>(SlabLayout(g).Block(index).bytes() * g.num_shards));
    if (absl::Status s = arena.ReadBlock(pool, index, scratch->data()); !s.ok()) return s;
    return XXH3_64bits(scratch->data(), scratch->size());
  }
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> state(XXH3_createState(), XXH3_freeState);
  if (state == nullptr) return absl::ResourceExhaustedError("XXH3_createState");
  XXH3_64bits_reset(state.get());
  const StridedBlock region = SlabLayout(g).Block(index);
  for (uint32_t shard = 0; shard < static_cast<uint32_t>(g.num_shards); ++shard) {
    const uint8_t* base = static_cast<const uint8_t*>(arena.HostAddress(pool, shard));
    for (int64_t row = 0; row < region.rows; ++row) {
      XXH3_64bits_update(state.get(), base + region.slab_offset + row * region.slab_pitch,
                         static_cast<size_t>(region.row_bytes));
    }
  }
  return XXH3_64bits_digest(state.get());
}

}  // namespace kvd
