// The CUDA backend where no GPU is usable (every development and CI machine): each entry point
// fails with a clear status naming the cause — never a crash, a hang or a context created.
// Where a GPU is usable these checks say so and pass; the [.gpu] suite covers that case.
#include <catch2/catch.hpp>

#if KVD_HAVE_CUDA
#include "gpu/cuda_arena.h"
#include "gpu/cuda_block_copier.h"
#include "gpu/cuda_device.h"
#include "gpu/cuda_ipc_event.h"
#include "gpu/cuda_slab_import.h"
#include "gpu/cuda_vmm.h"
#include "gpu/unique_fd.h"

#include <sys/mman.h>

namespace kvd {
namespace {

bool NoGpu() {
  if (ProbeCuda().ok()) {
    WARN("a GPU is usable here; the no-device checks do not apply");
    return false;
  }
  return true;
}

TEST_CASE("Without a GPU, the probe names the driver version and kvd's runtime", "[gpu][cuda]") {
  if (!NoGpu()) return;
  absl::Status s = ProbeCuda();
  REQUIRE(s.code() == absl::StatusCode::kUnavailable);
  REQUIRE_THAT(std::string(s.message()), Catch::Contains("NVIDIA driver ") &&
                                             Catch::Contains(CudaVersionString(CudaDriverVersion())));
  REQUIRE(CudaVersionString(CudaRuntimeVersion()) != "none");
  REQUIRE(CudaVersionString(0) == "none");
  REQUIRE(CudaVersionString(12050) == "12.5");
  REQUIRE(ListCudaDevices().status().code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("Without a GPU, every CUDA object fails to build with a status", "[gpu][cuda]") {
  if (!NoGpu()) return;
  PoolGeometry g{.name = "g", .block_tokens = 16, .num_layers = 2, .bytes_per_token_per_layer = 64,
                 .capacity_blocks = 8};
  REQUIRE_FALSE(CudaArena::Create({g}).ok());
  REQUIRE_FALSE(CudaBlockCopier::Create(0).ok());
  REQUIRE_FALSE(InterprocessEvent::Create(0).ok());
  REQUIRE_FALSE(PinnedBuffer::Allocate(4096).ok());
  // A malformed handle is refused before any CUDA call.
  REQUIRE(ImportedCudaSlab::Open(0, "short", 1 << 21).status().code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(InterprocessEvent::Open(0, "short").status().code() == absl::StatusCode::kInvalidArgument);
  // Selecting a device reports the failure and restores nothing it did not change.
  ScopedCudaDevice scope(3);
  REQUIRE_FALSE(scope.status().ok());
}

TEST_CASE("Without a GPU, VMM slabs and vmm pools fail with a status naming the driver", "[gpu][cuda][vmm]") {
  if (!NoGpu()) return;
  absl::StatusOr<VmmSlab> created = VmmSlab::Create(0, 2 << 20);
  INFO(created.status().ToString());
  REQUIRE(created.status().code() == absl::StatusCode::kUnavailable);
  REQUIRE_THAT(std::string(created.status().message()),
               Catch::Contains("virtual-memory API") && Catch::Contains("NVIDIA driver"));
  // An fd that is no VMM allocation (a memfd) is never imported; it is closed, not leaked.
  UniqueFd impostor(memfd_create("impostor", MFD_CLOEXEC));
  REQUIRE(impostor.valid());
  REQUIRE_FALSE(VmmSlab::Import(0, std::move(impostor), 2 << 20).ok());
  PoolGeometry g{.name = "v", .block_tokens = 16, .num_layers = 2, .bytes_per_token_per_layer = 64,
                 .capacity_blocks = 8};
  g.allocator = PoolAllocator::kVmm;
  REQUIRE_FALSE(CudaArena::Create({g}).ok());
}

}  // namespace
}  // namespace kvd
#endif  // KVD_HAVE_CUDA
