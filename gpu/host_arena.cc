#include "gpu/host_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "gpu/slab_layout.h"

namespace kvd {
namespace {

absl::Status Errno(absl::string_view what) {
  const int err = errno;
  std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOMEM || err == ENOSPC) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

// Whether `fd` is a slab kvd made: a memfd of `size` bytes, sealed against shrinking and growing.
bool Adoptable(const UniqueFd& fd, int64_t size) {
  struct stat st {};
  if (!fd.valid() || fstat(fd.get(), &st) != 0 || st.st_size != size) return false;
  const int seals = fcntl(fd.get(), F_GET_SEALS);
  constexpr int kWanted = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
  return seals >= 0 && (seals & kWanted) == kWanted;
}

}  // namespace

absl::StatusOr<std::unique_ptr<HostArena>> HostArena::Create(const std::vector<PoolGeometry>& pools,
                                                             std::vector<Offered> offered) {
  std::unique_ptr<HostArena> arena(new HostArena());
  arena->geometries_ = pools;
  for (PoolId p = 0; p < pools.size(); ++p) {
    const SlabLayout layout(pools[p]);
    for (int32_t shard = 0; shard < pools[p].num_shards; ++shard) {
      const int64_t size = layout.slab_bytes();
      UniqueFd fd;
      for (Offered& o : offered) {
        if (o.pool == p && o.shard == static_cast<uint32_t>(shard) && Adoptable(o.fd, size)) {
          fd = std::move(o.fd);
          ++arena->adopted_;
          break;
        }
      }
      const bool fresh = !fd.valid();
      if (fresh) {
        const std::string name = absl::StrCat("kvd-", pools[p].name, "-", shard);
        fd = UniqueFd(memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
        if (!fd.valid()) return Errno("memfd_create");
        if (ftruncate(fd.get(), size) != 0) return Errno(absl::StrCat("ftruncate(", size, ")"));
      }
      // MAP_POPULATE pre-faults every page now rather than on a worker's first write.
      void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd.get(), 0);
      if (base == MAP_FAILED) return Errno(absl::StrCat("mmap of ", size, " bytes"));
      if (fresh && fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        munmap(base, size);
        return Errno("F_ADD_SEALS");
      }
      SlabDescriptor d;
      d.pool = p;
      d.shard = static_cast<uint32_t>(shard);
      d.size_bytes = size;
      d.fd = fd.get();
      arena->descriptors_.push_back(d);
      arena->slabs_.push_back(Slab{std::move(fd), base, size});
    }
  }
  return arena;
}

HostArena::~HostArena() {
  for (Slab& s : slabs_) {
    if (s.base != nullptr) munmap(s.base, s.size);
  }
}

void* HostArena::HostAddress(PoolId pool, uint32_t shard) const {
  for (size_t i = 0; i < descriptors_.size(); ++i) {
    if (descriptors_[i].pool == pool && descriptors_[i].shard == shard) return slabs_[i].base;
  }
  return nullptr;
}

absl::Status HostArena::CopyBlock(uint8_t* slab, int, const StridedBlock& region, uint8_t* buffer,
                                  bool to_slab) const {
  for (int64_t r = 0; r < region.rows; ++r) {
    uint8_t* in_slab = slab + region.slab_offset + r * region.slab_pitch;
    uint8_t* in_buffer = buffer + r * region.row_bytes;
    std::memcpy(to_slab ? in_slab : in_buffer, to_slab ? in_buffer : in_slab,
                static_cast<size_t>(region.row_bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<MappedSlab> MappedSlab::Map(UniqueFd fd, int64_t size) {
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (base == MAP_FAILED) return Errno(absl::StrCat("mmap of slab (", size, " bytes)"));
  return MappedSlab(std::move(fd), base, size);
}

MappedSlab::MappedSlab(MappedSlab&& o) noexcept
    : fd_(std::move(o.fd_)), base_(std::exchange(o.base_, nullptr)), size_(std::exchange(o.size_, 0)) {}

MappedSlab& MappedSlab::operator=(MappedSlab&& o) noexcept {
  if (this != &o) {
    if (base_ != nullptr) munmap(base_, size_);
    fd_ = std::move(o.fd_);
    base_ = std::exchange(o.base_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

MappedSlab::~MappedSlab() {
  if (base_ != nullptr) munmap(base_, size_);
}

}  // namespace kvd
