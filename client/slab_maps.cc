#include "client/slab_maps.h"

#include <sys/stat.h>

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gpu/fd_passing.h"
#include "proto/convert.h"
#include "proto/vocab/status_macros.h"
#if KVD_HAVE_CUDA
#include "gpu/cuda_device.h"
#endif

namespace kvd::client {
namespace {

bool Wanted(int32_t filter, uint32_t shard) { return filter < 0 || static_cast<int32_t>(shard) == filter; }

std::string CudaIdentity(const v1::SlabInfo& s) {
  if (s.allocator() == "vmm") return absl::StrCat("cuda-vmm:", s.device_uuid(), ":", s.memory_id());
  return absl::StrCat("cuda:", s.device_uuid(), ":", absl::BytesToHexString(s.cuda_ipc_handle()));
}

}  // namespace

absl::StatusOr<GroupKvView> GroupKv(const PoolView& pool, absl::string_view group, uint32_t shard) {
  const PoolGeometry& g = pool.geometry;
  for (size_t j = 0; j < g.groups.size(); ++j) {
    if (g.groups[j].name != group) continue;
    if (shard >= pool.shard_base.size() || pool.shard_base[shard] == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("shard ", shard, " of pool '", g.name, "' is not mapped in this process"));
    }
    const GroupRegion& r = pool.layout.groups()[j];
    return GroupKvView{.base = pool.shard_base[shard] + r.offset, .first_block = r.first_block,
                       .capacity = r.capacity, .layer_unit_bytes = r.layer_unit_bytes, .layers = r.layers};
  }
  return absl::NotFoundError(absl::StrCat("pool '", g.name, "' has no KV group '", group, "'"));
}

absl::StatusOr<std::unique_ptr<SlabMaps>> SlabMaps::Open(const v1::ListPoolsResponse& listed,
                                                          const v1::Attached* attached,
                                                          int32_t shard) {
  std::unique_ptr<SlabMaps> maps(new SlabMaps());
  for (const v1::PoolInfo& p : listed.pools()) {
    PoolView view;
    view.id = p.pool_id();
    view.geometry = GeometryFromProto(p);
    view.layout = SlabLayout(view.geometry);
    view.shard_base.assign(p.slabs_size(), nullptr);
    for (const v1::SlabInfo& s : p.slabs()) {
      view.slab_bytes.push_back(s.size_bytes());
      view.shard_device.push_back(s.device());
    }
    maps->pools_.push_back(std::move(view));
  }
  if (attached == nullptr) return maps;
  if (attached->backend() == "cuda") {
    KVD_RETURN_IF_ERROR(maps->OpenCuda(listed, *attached, shard));
  } else if (attached->backend() == "host") {
    KVD_RETURN_IF_ERROR(maps->MapHost(*attached, shard));
  } else {
    return absl::FailedPreconditionError(
        absl::StrCat("kvd serves backend '", attached->backend(), "', unknown to this client"));
  }
  return maps;
}

std::vector<std::string> SlabMaps::CudaIdentities(const v1::ListPoolsResponse& listed, int32_t shard) {
  std::vector<std::string> out;
  for (const v1::PoolInfo& p : listed.pools()) {
    for (const v1::SlabInfo& s : p.slabs()) {
      if (Wanted(shard, s.shard())) out.push_back(CudaIdentity(s));
    }
  }
  return out;
}

absl::StatusOr<std::vector<SlabMaps::ReceivedSlab>> SlabMaps::ReceiveSlabFds(const v1::Attached& attached) const {
  KVD_ASSIGN_OR_RETURN(UniqueFd sock, ConnectUnix(attached.side_socket()));
  KVD_RETURN_IF_ERROR(SendMessage(sock.get(), attached.slab_token(), {}));
  KVD_ASSIGN_OR_RETURN(ReceivedMessage hello, ReceiveMessage(sock.get(), 4096, 0));
  if (absl::StartsWith(hello.payload, "ERR ")) {
    return absl::PermissionDeniedError(absl::StrCat("side socket refused: ", hello.payload.substr(4)));
  }
  int64_t count = 0;
  absl::string_view greeting = hello.payload;
  if (!absl::ConsumePrefix(&greeting, "OK ") || !absl::SimpleAtoi(greeting, &count)) {
    return absl::InternalError("side socket: malformed greeting");
  }
  std::vector<ReceivedSlab> out;
  for (int64_t i = 0; i < count; ++i) {
    KVD_ASSIGN_OR_RETURN(ReceivedMessage m, ReceiveMessage(sock.get(), 256, 1));
    std::vector<std::string> parts = absl::StrSplit(m.payload, ' ');
    ReceivedSlab r;
    if (parts.size() != 3 || m.fds.size() > 1 || !absl::SimpleAtoi(parts[0], &r.pool) ||
        !absl::SimpleAtoi(parts[1], &r.shard) || !absl::SimpleAtoi(parts[2], &r.size) ||
        r.pool >= pools_.size() || r.shard >= pools_[r.pool].shard_base.size()) {
      return absl::InternalError(absl::StrCat("side socket: malformed slab message '", m.payload, "'"));
    }
    if (m.fds.empty()) continue;  // a slab without an fd (CUDA ipc): opened by its handle
    r.fd = std::move(m.fds[0]);
    out.push_back(std::move(r));
  }
  return out;
}

absl::Status SlabMaps::MapHost(const v1::Attached& attached, int32_t wanted) {
  KVD_ASSIGN_OR_RETURN(std::vector<ReceivedSlab> slabs, ReceiveSlabFds(attached));
  for (ReceivedSlab& r : slabs) {
    if (!Wanted(wanted, r.shard)) continue;
    struct stat st {};
    if (fstat(r.fd.get(), &st) != 0) return absl::InternalError("fstat of a slab fd failed");
    KVD_ASSIGN_OR_RETURN(MappedSlab slab, MappedSlab::Map(std::move(r.fd), r.size));
    pools_[r.pool].shard_base[r.shard] = slab.data();
    identities_.push_back(absl::StrCat("host:", st.st_dev, ":", st.st_ino));
    host_.push_back(std::move(slab));
  }
  return absl::OkStatus();
}

absl::Status SlabMaps::OpenCuda(const v1::ListPoolsResponse& listed, const v1::Attached& attached,
                                int32_t wanted) {
#if KVD_HAVE_CUDA
  // The daemon's ordinals are not this process's (a pod granted one GPU sees it as device 0):
  // each slab names its device by UUID and PCI bus id, resolved here.
  KVD_ASSIGN_OR_RETURN(std::vector<DeviceIdentity> visible, ListCudaDevices());
  // VMM slabs arrive as fds through the side socket, like host memfds.
  std::vector<ReceivedSlab> fds;
  bool received = false;  // the slab token redeems once
  for (const v1::PoolInfo& p : listed.pools()) {
    for (const v1::SlabInfo& s : p.slabs()) {
      if (Wanted(wanted, s.shard()) && s.allocator() == "vmm" && !received) {
        KVD_ASSIGN_OR_RETURN(fds, ReceiveSlabFds(attached));
        received = true;
      }
    }
  }
  for (const v1::PoolInfo& p : listed.pools()) {
    for (const v1::SlabInfo& s : p.slabs()) {
      if (!Wanted(wanted, s.shard())) continue;
      KVD_ASSIGN_OR_RETURN(int device,
                           ResolveDevice(visible, s.device_uuid(), s.device_pci_bus_id(), s.device()));
      uint8_t* base = nullptr;
      if (s.allocator() == "vmm") {
        auto fd = std::find_if(fds.begin(), fds.end(), [&](const ReceivedSlab& r) {
          return r.pool == p.pool_id() && r.shard == s.shard() && r.fd.valid();
        });
        if (fd == fds.end()) {
          return absl::InternalError(absl::StrCat("side socket passed no fd for VMM slab ", p.pool_id(), "/", s.shard()));
        }
        KVD_ASSIGN_OR_RETURN(VmmSlab slab, VmmSlab::Import(device, std::move(fd->fd), s.size_bytes()));
        base = slab.data();
        vmm_.push_back(std::move(slab));
      } else {
        KVD_ASSIGN_OR_RETURN(ImportedCudaSlab slab,
                             ImportedCudaSlab::Open(device, s.cuda_ipc_handle(), s.size_bytes()));
        base = slab.data();
        cuda_.push_back(std::move(slab));
      }
      pools_[p.pool_id()].shard_base[s.shard()] = base;
      pools_[p.pool_id()].shard_device[s.shard()] = device;
      identities_.push_back(CudaIdentity(s));
    }
  }
  return absl::OkStatus();
#else
  (void)listed;
  (void)attached;
  (void)wanted;
  return absl::FailedPreconditionError(
      "kvd serves CUDA memory but this client was built without CUDA; rebuild with the toolkit");
#endif
}

bool SlabMaps::SameGeometryAs(const SlabMaps& other) const {
  if (pools_.size() != other.pools_.size()) return false;
  for (size_t i = 0; i < pools_.size(); ++i) {
    const PoolGeometry& a = pools_[i].geometry;
    const PoolGeometry& b = other.pools_[i].geometry;
    if (a.name != b.name || a.block_tokens != b.block_tokens || a.num_layers != b.num_layers ||
        a.bytes_per_token_per_layer != b.bytes_per_token_per_layer ||
        a.capacity_blocks != b.capacity_blocks || a.num_shards != b.num_shards || a.layout != b.layout ||
        pools_[i].slab_bytes != other.pools_[i].slab_bytes) {
      return false;
    }
  }
  return true;
}

std::unique_ptr<SlabMaps> SlabMaps::Adopt(std::unique_ptr<SlabMaps> newer) {
  std::unique_ptr<SlabMaps> old(new SlabMaps());
  old->host_ = std::move(host_);
  old->identities_ = std::move(identities_);
  host_ = std::move(newer->host_);
  identities_ = std::move(newer->identities_);
#if KVD_HAVE_CUDA
  old->cuda_ = std::move(cuda_);
  cuda_ = std::move(newer->cuda_);
  old->vmm_ = std::move(vmm_);
  vmm_ = std::move(newer->vmm_);
#endif
  for (size_t i = 0; i < pools_.size(); ++i) {
    pools_[i].shard_base = newer->pools_[i].shard_base;
    pools_[i].shard_device = newer->pools_[i].shard_device;
  }
  return old;
}

}  // namespace kvd::client
