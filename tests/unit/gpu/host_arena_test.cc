#include "gpu/host_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include <catch2/catch.hpp>

#include "gpu/fd_passing.h"
#include "gpu/slab_layout.h"

namespace kvd {
namespace {

PoolGeometry Geometry(PoolLayout layout, int shards = 1) {
  PoolGeometry g;
  g.name = "p";
  g.block_tokens = 4;
  g.num_layers = 3;
  g.bytes_per_token_per_layer = 8;  // 32-byte layer blocks
  g.capacity_blocks = 10;
  g.num_shards = shards;
  g.layout = layout;
  return g;
}

TEST_CASE("Layer-major layout makes each layer one contiguous block array", "[gpu][layout]") {
  SlabLayout l(Geometry(PoolLayout::kLayerMajor));
  REQUIRE(l.payload_bytes() == 10 * 3 * 32);
  REQUIRE(l.slab_bytes() == kSlabAlignment);
  REQUIRE(*l.Offset(0, 0) == 0);
  REQUIRE(*l.Offset(1, 0) == 32);       // next block, same layer: adjacent
  REQUIRE(*l.Offset(0, 1) == 10 * 32);  // next layer starts after all blocks of layer 0
  REQUIRE(*l.Offset(9, 2) == (2 * 10 + 9) * 32);
  REQUIRE(l.Offset(10, 0).status().code() == absl::StatusCode::kOutOfRange);
  REQUIRE(l.Offset(0, 3).status().code() == absl::StatusCode::kOutOfRange);
}

TEST_CASE("Block-major layout keeps each block contiguous across layers", "[gpu][layout]") {
  SlabLayout l(Geometry(PoolLayout::kBlockMajor));
  REQUIRE(*l.Offset(0, 1) == 32);
  REQUIRE(*l.Offset(1, 0) == 3 * 32);
  REQUIRE(*l.Offset(9, 2) == (9 * 3 + 2) * 32);
}

TEST_CASE("HostArena slabs are sealed, 2 MiB-aligned memfds, one per shard", "[gpu][host]") {
  auto arena = HostArena::Create({Geometry(PoolLayout::kLayerMajor, 2)});
  REQUIRE(arena.ok());
  const auto& slabs = (*arena)->slabs();
  REQUIRE(slabs.size() == 2);
  for (const SlabDescriptor& s : slabs) {
    REQUIRE(s.size_bytes % kSlabAlignment == 0);
    REQUIRE(s.fd >= 0);
    const int seals = fcntl(s.fd, F_GET_SEALS);
    REQUIRE((seals & F_SEAL_SHRINK) != 0);
    REQUIRE((seals & F_SEAL_GROW) != 0);
    REQUIRE((seals & F_SEAL_SEAL) != 0);
    REQUIRE(ftruncate(s.fd, 0) != 0);  // cannot be truncated under a worker
  }
  REQUIRE(slabs[1].shard == 1);
  REQUIRE((*arena)->HostAddress(0, 1) != (*arena)->HostAddress(0, 0));
}

TEST_CASE("A slab passed over a socket maps the same bytes in the receiver", "[gpu][host]") {
  auto arena = HostArena::Create({Geometry(PoolLayout::kLayerMajor)});
  REQUIRE(arena.ok());
  int sv[2];
  REQUIRE(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
  const SlabDescriptor& s = (*arena)->slabs()[0];
  REQUIRE(SendMessage(sv[0], "slab", {s.fd}).ok());
  auto got = ReceiveMessage(sv[1], 64, 1);
  REQUIRE(got.ok());
  REQUIRE(got->payload == "slab");
  REQUIRE(got->fds.size() == 1);
  auto mapped = MappedSlab::Map(std::move(got->fds[0]), s.size_bytes);
  REQUIRE(mapped.ok());
  auto* daemon_view = static_cast<uint8_t*>((*arena)->HostAddress(0, 0));
  std::memcpy(daemon_view + 100, "kvd", 3);
  REQUIRE(std::memcmp(mapped->data() + 100, "kvd", 3) == 0);
  mapped->data()[200] = 42;
  REQUIRE(daemon_view[200] == 42);
  // Too many fds for the receiver is an error, not a leak.
  REQUIRE(SendMessage(sv[0], "two", {s.fd, s.fd}).ok());
  REQUIRE_FALSE(ReceiveMessage(sv[1], 64, 1).ok());
  close(sv[0]);
  close(sv[1]);
}

}  // namespace
}  // namespace kvd
