// SlabMaps: a worker's view of kvd's pools and its mappings of their slabs — memfd slabs mmap'ed
// from fds the side socket passes (host backend), CUDA IPC handles opened once (CUDA backend,
// allocator ipc), or CUDA VMM fds the side socket passes, imported once (allocator vmm).
// Internal to kvd_client; client.h exposes the PoolViews.
//
// Identity. Each mapped slab has an identity: the memfd's (st_dev, st_ino) on the host backend,
// the 64-byte IPC handle on CUDA, the daemon's memory_id for a VMM slab. After kvd restarts, the client compares identities: the same
// memory (kvd adopted its slabs from systemd's fd store, or a handoff passed them) keeps every
// mapping and every pointer the engine holds; different memory is mapped anew and the engine is
// told its KV moved (ClientOptions::on_remap).
// Not thread-safe; the client guards it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "gpu/host_arena.h"
#include "kvd/v1/kvd.pb.h"
#if KVD_HAVE_CUDA
#include "gpu/cuda_slab_import.h"
#include "gpu/cuda_vmm.h"
#endif

namespace kvd::client {

class SlabMaps {
 public:
  // Pool views from `listed`; with `attached` (nullptr: map nothing), maps this process's slabs
  // (only shard `shard` of each pool when >= 0). PERMISSION_DENIED when the side socket refuses;
  // NOT_FOUND when a CUDA slab's device is not visible here.
  static absl::StatusOr<std::unique_ptr<SlabMaps>> Open(const v1::ListPoolsResponse& listed,
                                                        const v1::Attached* attached, int32_t shard);
  // The CUDA identities ListPools announces (no handle is opened): equal to identities() of the
  // maps built from the same memory.
  static std::vector<std::string> CudaIdentities(const v1::ListPoolsResponse& listed, int32_t shard);

  std::vector<PoolView>& pools() { return pools_; }
  const std::vector<std::string>& identities() const { return identities_; }
  // Same pools, same geometry and layout, in the same order (what an engine's kernels assume).
  bool SameGeometryAs(const SlabMaps& other) const;
  // Moves `newer`'s mappings in, updating this object's PoolViews in place (so references to
  // pools() stay valid), and returns the mappings it held before, to unmap once the engine has
  // been told. REQUIRES: SameGeometryAs(newer).
  std::unique_ptr<SlabMaps> Adopt(std::unique_ptr<SlabMaps> newer);

 private:
  SlabMaps() = default;
  absl::Status MapHost(const v1::Attached& attached, int32_t shard);
  absl::Status OpenCuda(const v1::ListPoolsResponse& listed, const v1::Attached& attached, int32_t shard);
  // One slab's fd as the side socket passes it.
  struct ReceivedSlab {
    uint32_t pool = 0;
    uint32_t shard = 0;
    int64_t size = 0;
    UniqueFd fd;
  };
  // Redeems the attachment's slab token on the side socket: every slab kvd passes an fd for.
  absl::StatusOr<std::vector<ReceivedSlab>> ReceiveSlabFds(const v1::Attached& attached) const;

  std::vector<PoolView> pools_;
  std::vector<std::string> identities_;  // one per mapped slab, in (pool, shard) order
  std::vector<MappedSlab> host_;
#if KVD_HAVE_CUDA
  std::vector<ImportedCudaSlab> cuda_;
  std::vector<VmmSlab> vmm_;
#endif
};

}  // namespace kvd::client
