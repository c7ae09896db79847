#include "server/slab_fd_store.h"

#include <cstdlib>
#include <cstring>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gpu/slab_layout.h"
#include "spdlog/spdlog.h"
#if KVD_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

namespace kvd {

std::string SlabFdName(const PoolGeometry& g, PoolId pool, uint32_t shard, int64_t slab_bytes) {
  // Stable across builds: a hand-rolled FNV-1a, not absl::Hash (seeded per process).
  uint64_t h = 1469598103934665603ULL;
  auto mix = [&h](absl::string_view bytes) {
    for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ULL;
  };
  mix(g.name);
  mix(absl::StrCat("|", g.block_tokens, "|", g.num_layers, "|", g.bytes_per_token_per_layer, "|",
                   g.capacity_blocks, "|", g.num_shards, "|", static_cast<int>(g.layout), "|", slab_bytes));
  if (g.allocator == PoolAllocator::kVmm) mix("|vmm");  // host names stay as they were
  // A pool of other weights must not take over memory holding this model's KV (a handoff, or
  // slabs kept by systemd across a restart).
  if (!g.model_fingerprint.empty()) mix(absl::StrCat("|model=", g.model_fingerprint));
  return absl::StrFormat("kvdslab-%d-%d-%016x", pool, shard, h);
}

#if KVD_HAVE_SYSTEMD

namespace {

void Notify(const std::string& state, const int* fds, unsigned n) {
  const int r = sd_pid_notify_with_fds(0, 0, state.c_str(), fds, n);
  if (r < 0) spdlog::warn("fd store: '{}' was not sent to systemd: {}", state, std::strerror(-r));
}

}  // namespace

std::vector<HostArena::Offered> TakeOfferedSlabs(const std::vector<PoolGeometry>& pools) {
  std::vector<HostArena::Offered> out;
  char** names = nullptr;
  const int n = sd_listen_fds_with_names(/*unset_environment=*/1, &names);
  if (n <= 0) return out;
  int adopted = 0;
  for (int i = 0; i < n; ++i) {
    UniqueFd fd(SD_LISTEN_FDS_START + i);
    const std::string name = names != nullptr && names[i] != nullptr ? names[i] : "";
    bool matched = false;
    for (PoolId p = 0; p < pools.size() && !matched; ++p) {
      const int64_t bytes = SlabLayout(pools[p]).slab_bytes();
      for (int32_t shard = 0; shard < pools[p].num_shards; ++shard) {
        if (name == SlabFdName(pools[p], p, static_cast<uint32_t>(shard), bytes)) {
          out.push_back({p, static_cast<uint32_t>(shard), std::move(fd)});
          matched = true;
          ++adopted;
          break;
        }
      }
    }
    if (!matched && name.rfind("kvdslab-", 0) == 0) {
      spdlog::warn("fd store: slab '{}' does not fit the configured pools; dropping it", name);
      Notify(absl::StrCat("FDSTOREREMOVE=1\nFDNAME=", name), nullptr, 0);
    }
  }
  if (names != nullptr) {
    for (int i = 0; i < n; ++i) std::free(names[i]);
    std::free(names);
  }
  spdlog::info("fd store: systemd passed {} descriptors; {} are slabs of the configured pools", n, adopted);
  return out;
}

int StoreSlabFds(const DeviceArena& arena) {
  if (arena.backend() != "host" || std::getenv("NOTIFY_SOCKET") == nullptr) return 0;
  int stored = 0;
  for (const SlabDescriptor& d : arena.slabs()) {
    const PoolGeometry& g = arena.geometries()[d.pool];
    const std::string name = SlabFdName(g, d.pool, d.shard, d.size_bytes);
    const int r = sd_pid_notify_with_fds(0, 0, absl::StrCat("FDSTORE=1\nFDNAME=", name).c_str(), &d.fd, 1);
    if (r > 0) {
      ++stored;
    } else {
      spdlog::warn("fd store: slab '{}' not stored ({}); a restart will not keep its memory", name,
                   r < 0 ? std::strerror(-r) : "no NOTIFY_SOCKET");
    }
  }
  return stored;
}

#else  // !KVD_HAVE_SYSTEMD

std::vector<HostArena::Offered> TakeOfferedSlabs(const std::vector<PoolGeometry>&) { return {}; }
int StoreSlabFds(const DeviceArena&) { return 0; }

#endif

}  // namespace kvd
