// Device identity (UUID / PCI bus id → this process's ordinal) and the strided block regions every
// backend's tier copy follows. No GPU needed.
#include "gpu/device_identity.h"

#include <catch2/catch.hpp>

#include "gpu/slab_layout.h"

namespace kvd {
namespace {

std::vector<DeviceIdentity> TwoGpus() {
  return {{0, "GPU-aaaaaaaa-0000-1111-2222-333333333333", "0000:17:00.0", "H200"},
          {1, "GPU-bbbbbbbb-0000-1111-2222-333333333333", "0000:2a:00.0", "H200"}};
}

TEST_CASE("A worker resolves the daemon's device by UUID, whatever its own ordinals",
          "[gpu][identity]") {
  // The daemon's device 1 is the pod's device 0 (granted one GPU).
  std::vector<DeviceIdentity> pod = {{0, "GPU-bbbbbbbb-0000-1111-2222-333333333333", "0000:2a:00.0", "H200"}};
  REQUIRE(*ResolveDevice(pod, "GPU-bbbbbbbb-0000-1111-2222-333333333333", "0000:2a:00.0", 1) == 0);
  // Case does not matter; the UUID decides over a disagreeing bus id.
  REQUIRE(*ResolveDevice(TwoGpus(), "gpu-BBBBBBBB-0000-1111-2222-333333333333", "0000:17:00.0", 0) == 1);
  // Without a UUID, the bus id, with or without its domain.
  REQUIRE(*ResolveDevice(TwoGpus(), "", "2A:00.0", 0) == 1);
  REQUIRE(*ResolveDevice(TwoGpus(), "", "00000000:2a:00.0", 0) == 1);
  // An old daemon that sent neither: its ordinal, as before.
  REQUIRE(*ResolveDevice(TwoGpus(), "", "", 1) == 1);
}

TEST_CASE("A device the worker cannot see is a clear NOT_FOUND, never another GPU", "[gpu][identity]") {
  std::vector<DeviceIdentity> pod = {{0, "GPU-aaaaaaaa-0000-1111-2222-333333333333", "0000:17:00.0", "H200"}};
  auto r = ResolveDevice(pod, "GPU-bbbbbbbb-0000-1111-2222-333333333333", "0000:2a:00.0", 0);
  REQUIRE(r.status().code() == absl::StatusCode::kNotFound);
  REQUIRE_THAT(std::string(r.status().message()), Catch::Contains("GPU-bbbbbbbb") &&
                                                      Catch::Contains("0000:2a:00.0") &&
                                                      Catch::Contains("CUDA_VISIBLE_DEVICES"));
  // No devices at all (CUDA_VISIBLE_DEVICES="").
  REQUIRE(ResolveDevice({}, "GPU-bbbbbbbb-0000-1111-2222-333333333333", "", 0).status().code() ==
          absl::StatusCode::kNotFound);
}

TEST_CASE("UUIDs print as nvidia-smi prints them", "[gpu][identity]") {
  std::array<uint8_t, 16> b{};
  for (int i = 0; i < 16; ++i) b[i] = static_cast<uint8_t>(0x10 * (i % 16) + i);
  REQUIRE(FormatGpuUuid(b) == "GPU-00112233-4455-6677-8899-aabbccddeeff");
  REQUIRE(CanonicalPciBusId("17:00.0") == "0000:17:00.0");
}

TEST_CASE("A block's strided region covers exactly its layer chunks, in layer order", "[gpu][layout]") {
  for (PoolLayout layout : {PoolLayout::kLayerMajor, PoolLayout::kBlockMajor}) {
    PoolGeometry g;
    g.block_tokens = 4;
    g.num_layers = 3;
    g.bytes_per_token_per_layer = 8;
    g.capacity_blocks = 10;
    g.layout = layout;
    const SlabLayout l(g);
    for (int64_t block : {0, 1, 9}) {
      const StridedBlock r = l.Block(block);
      REQUIRE(r.bytes() == g.num_layers * l.layer_block_bytes());
      // Byte k of the packed buffer ([layer][layer block]) must come from the slab offset of
      // (layer k / L, byte k % L).
      for (int64_t k = 0; k < r.bytes(); ++k) {
        const int64_t row = k / r.row_bytes, col = k % r.row_bytes;
        const int64_t from_region = r.slab_offset + row * r.slab_pitch + col;
        const int64_t layer = k / l.layer_block_bytes(), within = k % l.layer_block_bytes();
        REQUIRE(from_region == l.OffsetUnchecked(block, static_cast<int32_t>(layer)) + within);
      }
    }
  }
}

}  // namespace
}  // namespace kvd
