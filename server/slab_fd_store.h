// The host backend's slabs in systemd's file-descriptor store, so that a crash restart keeps the
// KV memory every worker has mapped (docs/operations.md, "Restarts: what engines see").
//
// After the arena is made, kvd sends each slab's memfd to systemd (sd_pid_notify_with_fds,
// "FDSTORE=1" with FDNAME=SlabFdName(...)); the unit needs FileDescriptorStoreMax= at least the
// number of slabs. When systemd restarts kvd it passes the stored fds back (LISTEN_FDS,
// LISTEN_FDNAMES); TakeOfferedSlabs hands those whose name matches the configured geometry to
// HostArena::Create, which adopts them. A name that no longer matches (the pools changed) is
// removed from the store ("FDSTOREREMOVE=1"). Without the index (no snapshot crosses a crash) the
// cache starts empty; workers keep their mappings and are not told their KV moved.
// Outside systemd (no NOTIFY_SOCKET, no LISTEN_FDS) both calls do nothing.
#pragma once

#include <string>
#include <vector>

#include "gpu/device_arena.h"
#include "gpu/host_arena.h"
#include "proto/vocab/pool_geometry.h"

namespace kvd {

// "kvdslab-<pool>-<shard>-<16 hex digits>": the digits hash the pool's name, geometry and slab
// size, so a stored slab is adopted only by a kvd configured for exactly that slab. Valid as an
// FDNAME (no ':', at most 255 characters).
std::string SlabFdName(const PoolGeometry& g, PoolId pool, uint32_t shard, int64_t slab_bytes);

// The stored slabs systemd passed to this process that fit `pools`; the others are removed from
// the store and closed. Unsets LISTEN_FDS so children do not inherit them.
std::vector<HostArena::Offered> TakeOfferedSlabs(const std::vector<PoolGeometry>& pools);

// Sends every host slab's fd to the store (no-op without NOTIFY_SOCKET or on another backend).
// Returns how many were stored.
int StoreSlabFds(const DeviceArena& arena);

}  // namespace kvd
