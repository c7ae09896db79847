// CheckSuccessor (server/handoff.h): which successor may take over a running kvd. Everything
// refused here is refused before the running kvd stops anything.
#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "gpu/slab_layout.h"
#include "server/handoff.h"
#include "server/slab_fd_store.h"

namespace kvd {
namespace {

PoolGeometry Pool(const std::string& name, PoolAllocator allocator = PoolAllocator::kIpc) {
  PoolGeometry g{.name = name, .block_tokens = 16, .num_layers = 2, .bytes_per_token_per_layer = 64,
                 .capacity_blocks = 64};
  g.allocator = allocator;
  return g;
}

// The running kvd's slabs for `pools` on `backend` (one shard each).
std::vector<SlabDescriptor> Slabs(const std::vector<PoolGeometry>& pools, const std::string& backend) {
  std::vector<SlabDescriptor> out;
  for (PoolId p = 0; p < pools.size(); ++p) {
    SlabDescriptor d;
    d.pool = p;
    d.size_bytes = SlabLayout(pools[p]).slab_bytes();
    d.fd = backend == "host" || pools[p].allocator == PoolAllocator::kVmm ? 10 + static_cast<int>(p) : -1;
    d.device = backend == "host" ? -1 : 0;
    d.cuda_vmm = backend == "cuda" && pools[p].allocator == PoolAllocator::kVmm;
    out.push_back(d);
  }
  return out;
}

absl::Status Check(const std::vector<PoolGeometry>& running, const std::string& running_backend,
                   const std::vector<PoolGeometry>& successor, const std::string& successor_backend) {
  return CheckSuccessor(MakeHello(successor, successor_backend), running_backend, Slabs(running, running_backend),
                        running);
}

TEST_CASE("A successor with the same pools takes over host memory and CUDA VMM memory", "[handoff]") {
  REQUIRE(Check({Pool("a"), Pool("b")}, "host", {Pool("a"), Pool("b")}, "host").ok());
  REQUIRE(Check({Pool("a")}, "host", {Pool("a")}, "auto").ok());
  const std::vector<PoolGeometry> vmm = {Pool("a", PoolAllocator::kVmm)};
  REQUIRE(Check(vmm, "cuda", vmm, "cuda").ok());
  REQUIRE(Check(vmm, "cuda", vmm, "auto").ok());
}

TEST_CASE("Successors that cannot take the memory as it is are refused, saying why", "[handoff]") {
  auto refused = [](absl::Status s, const std::string& why) {
    INFO(s.ToString());
    REQUIRE(absl::IsFailedPrecondition(s));
    REQUIRE(absl::StrContains(s.message(), why));
  };
  PoolGeometry bigger = Pool("a");
  bigger.capacity_blocks = 128;
  refused(Check({Pool("a")}, "host", {bigger}, "host"), "the pools differ");
  refused(Check({Pool("a")}, "host", {Pool("a"), Pool("b")}, "host"), "the pools differ");
  refused(Check({Pool("a")}, "host", {Pool("b")}, "host"), "the pools differ");
  PoolGeometry other_layout = Pool("a");
  other_layout.layout = PoolLayout::kBlockMajor;
  refused(Check({Pool("a")}, "host", {other_layout}, "host"), "the pools differ");
  refused(Check({Pool("a")}, "host", {Pool("a")}, "cuda"), "restart instead");
  // cudaMalloc memory cannot cross processes; VMM memory can, but only as VMM memory.
  refused(Check({Pool("a")}, "cuda", {Pool("a")}, "cuda"), "allocator ipc");
  refused(Check({Pool("a", PoolAllocator::kVmm)}, "cuda", {Pool("a")}, "cuda"), "the pools differ");
  HandoffHello future = MakeHello({Pool("a")}, "host");
  future.protocol = kHandoffProtocol + 1;
  refused(CheckSuccessor(future, "host", Slabs({Pool("a")}, "host"), {Pool("a")}), "handoff protocol");
}

TEST_CASE("A VMM pool's slab names differ from an ipc pool's; host names are unchanged", "[handoff]") {
  const PoolGeometry ipc = Pool("a");
  const PoolGeometry vmm = Pool("a", PoolAllocator::kVmm);
  const int64_t bytes = SlabLayout(ipc).slab_bytes();
  REQUIRE(SlabFdName(ipc, 0, 0, bytes) != SlabFdName(vmm, 0, 0, bytes));
  // The name systemd's fd store holds for a host slab must not change with this field's arrival
  // (the value the code before `allocator` computed): a restart would drop the kept memory.
  REQUIRE(SlabFdName(ipc, 0, 0, bytes) == "kvdslab-0-0-2e2695f869239a62");
}

TEST_CASE("A successor whose pool declares another model fingerprint is refused, naming it", "[handoff]") {
  PoolGeometry v1 = Pool("a"), v2 = Pool("a");
  v1.model_fingerprint = "m@v1";
  v2.model_fingerprint = "m@v2";
  const int64_t bytes = SlabLayout(v1).slab_bytes();
  REQUIRE(SlabFdName(v1, 0, 0, bytes) != SlabFdName(v2, 0, 0, bytes));
  REQUIRE(SlabFdName(v1, 0, 0, bytes) != SlabFdName(Pool("a"), 0, 0, bytes));
  REQUIRE(Check({v1}, "host", {v1}, "host").ok());
  const absl::Status s = Check({v1}, "host", {v2}, "host");
  REQUIRE(absl::IsFailedPrecondition(s));
  REQUIRE(s.message().find("model_fingerprint 'm@v2'") != absl::string_view::npos);
  REQUIRE(!Check({Pool("a")}, "host", {v1}, "host").ok());
}

}  // namespace
}  // namespace kvd
