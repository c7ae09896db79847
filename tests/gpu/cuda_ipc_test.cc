// GPU tests (hidden tag [.gpu]; registered only when CUDA is found). Each test checks for a usable
// device first and, without one, says so and returns. Run them with tests/gpu/run.sh.
#include <signal.h>

#include <catch2/catch.hpp>

#include "client/client.h"
#include "gpu/cuda_arena.h"
#include "gpu/cuda_block_copier.h"
#include "tests/integration/harness.h"

namespace kvd {
namespace {

using namespace kvd::testing;

bool HaveGpu() {
  absl::Status s = ProbeCuda();
  if (!s.ok()) WARN("no usable GPU, skipped: " << s.ToString());
  return s.ok();
}

std::string CudaPoolConfig(const std::string& more_pools = "") {
  return "pools:\n"
         "  - name: default\n"
         "    block_tokens: 16\n"
         "    num_layers: 4\n"
         "    bytes_per_token_per_layer: 256\n"
         "    capacity_blocks: 256\n"
         "    max_model_len: 2048\n" +
         more_pools;
}

TEST_CASE("GPU: two worker processes share blocks through CUDA IPC", "[.gpu]") {
  if (!HaveGpu()) return;
  DaemonProcess d(CudaPoolConfig(), {"--backend=cuda"});
  const std::string target = "--target=" + d.target();
  ProcessResult a = RunWorker({target, "--id=a", "--prompt-range=0:100", "--gen=8"});
  INFO(a.out);
  REQUIRE(a.exit_code == 0);
  ProcessResult b = RunWorker({target, "--id=b", "--prompt-range=0:100", "--gen=8"});
  INFO(b.out);
  REQUIRE(b.exit_code == 0);
  REQUIRE(JsonInt(b.out, "cached_tokens") == 96);
  REQUIRE(JsonInt(b.out, "verified_bytes") == 96 * 4 * 256);
  REQUIRE(JsonInt(b.out, "mismatches") == 0);
}

TEST_CASE("GPU: a client opens each slab once and gets device pointers", "[.gpu]") {
  if (!HaveGpu()) return;
  DaemonProcess d(CudaPoolConfig("  - name: second\n    block_tokens: 16\n    num_layers: 2\n"
                                 "    bytes_per_token_per_layer: 128\n    capacity_blocks: 64\n"),
                  {"--backend=cuda"});
  auto c = client::Client::Connect({.target = d.target()});
  INFO(c.status().ToString());
  REQUIRE(c.ok());
  REQUIRE((*c)->backend() == "cuda");
  REQUIRE((*c)->pools().size() == 2);  // several pools on one device
  for (const auto& p : (*c)->pools()) {
    REQUIRE(p.shard_base[0] != nullptr);
    REQUIRE(p.shard_device[0] == 0);
  }
  auto p0 = (*c)->LayerPointer(0, 3, 1);
  auto p0_again = (*c)->LayerPointer(0, 3, 1);
  REQUIRE(*p0 == *p0_again);  // the mapping is kept, not reopened
  // Round trip through the second pool's slab.
  const char msg[] = "kvd-gpu";
  REQUIRE((*c)->WriteLayer(1, 5, 1, 0, msg, sizeof(msg)).ok());
  char back[sizeof(msg)] = {};
  REQUIRE((*c)->ReadLayer(1, 5, 1, 0, back, sizeof(back)).ok());
  REQUIRE(std::string(back) == msg);
  ProcessResult w = RunWorker({"--target=" + d.target(), "--pool=second", "--id=s", "--prompt-range=0:40"});
  REQUIRE(w.exit_code == 0);
}

TEST_CASE("GPU: readers wait on the publisher's interprocess event, not on the host", "[.gpu]") {
  if (!HaveGpu()) return;
  DaemonProcess d(CudaPoolConfig(), {"--backend=cuda"});
  auto writer = client::Client::Connect({.target = d.target(), .ipc_event_device = 0});
  INFO(writer.status().ToString());
  REQUIRE(writer.ok());
  RequestSpec s = PoolRequest("w", Range(0, 40));
  auto w = (*writer)->Start(s);
  REQUIRE(w.ok());
  std::vector<uint8_t> bytes(256, 0xAB);
  for (int64_t pos = 0; pos < 32; ++pos) {
    REQUIRE((*writer)->WriteLayer((*w)->pool(), (*w)->blocks()[pos / 16], 0, (pos % 16) * 256,
                                  bytes.data(), bytes.size()).ok());
  }
  REQUIRE((*writer)->RecordWrites(nullptr).ok());  // on the default stream, after the writes
  REQUIRE((*w)->Publish(s.prompt).ok());
  auto reader = client::Client::Connect({.target = d.target()});
  REQUIRE(reader.ok());
  s.id = RequestId("r");
  auto r = (*reader)->Start(s);
  REQUIRE(r.ok());
  REQUIRE((*r)->cached_tokens() == 32);
  REQUIRE((*r)->publisher_events().size() == 1);
  REQUIRE((*reader)->WaitForPublishers(**r, nullptr).ok());
  std::vector<uint8_t> got(256);
  REQUIRE((*reader)->ReadLayer((*r)->pool(), (*r)->blocks()[1], 0, 0, got.data(), got.size()).ok());
  REQUIRE(got == bytes);
}

TEST_CASE("GPU: a killed worker's blocks are reclaimed", "[.gpu]") {
  if (!HaveGpu()) return;
  DaemonProcess d(CudaPoolConfig(), {"--backend=cuda"});
  auto observer = client::Client::Connect({.target = d.target(), .map_slabs = false});
  REQUIRE(observer.ok());
  WorkerProcess victim({"--target=" + d.target(), "--id=v", "--prompt-range=0:40", "--gen=20",
                        "--checkpoint-every=4", "--hang-after-checkpoint"});
  REQUIRE(victim.WaitForLine("CHECKPOINTED", absl::Seconds(20)).ok());
  victim.Kill(SIGKILL);
  CacheReport r;
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  do {
    absl::SleepFor(absl::Milliseconds(20));
    r = *(*observer)->Report();
  } while (r.live_requests != 0 && absl::Now() < deadline);
  REQUIRE(r.live_requests == 0);
  ProcessResult resumed = RunWorker({"--target=" + d.target(), "--id=v2", "--resume-from=v",
                                     "--prompt-range=0:40", "--gen=20"});
  INFO(resumed.out);
  REQUIRE(resumed.exit_code == 0);
  REQUIRE(JsonBool(resumed.out, "resumed"));
  REQUIRE(JsonInt(resumed.out, "mismatches") == 0);
}

TEST_CASE("GPU: a pool sharded over two devices, each rank mapping its own", "[.gpu]") {
  if (!HaveGpu()) return;
  int devices = 0;
  for (int i = 0; i < 16; ++i) {
    if (CudaArena::Create({PoolGeometry{.name = "probe", .capacity_blocks = 1, .devices = {i}}}).ok()) {
      devices = i + 1;
    } else {
      break;
    }
  }
  if (devices < 2) {
    WARN("fewer than two GPUs: sharding over devices skipped (host shards are tested in CI)");
    return;
  }
  DaemonProcess d("pools:\n  - name: tp\n    block_tokens: 16\n    num_layers: 2\n"
                  "    bytes_per_token_per_layer: 64\n    capacity_blocks: 64\n    devices: [0, 1]\n",
                  {"--backend=cuda"});
  const std::string target = "--target=" + d.target();
  REQUIRE(RunWorker({target, "--pool=tp", "--id=a", "--prompt-range=0:50"}).exit_code == 0);
  ProcessResult r1 = RunWorker({target, "--pool=tp", "--id=b", "--shard=1", "--prompt-range=0:50"});
  REQUIRE(r1.exit_code == 0);
  REQUIRE(JsonInt(r1.out, "mismatches") == 0);
}

TEST_CASE("GPU: gather and scatter of blocks round-trip through pinned memory", "[.gpu]") {
  if (!HaveGpu()) return;
  PoolGeometry g{.name = "g", .block_tokens = 16, .num_layers = 4, .bytes_per_token_per_layer = 512,
                 .capacity_blocks = 64};
  auto arena = CudaArena::Create({g});
  REQUIRE(arena.ok());
  auto copier = CudaBlockCopier::Create(0);
  REQUIRE(copier.ok());
  const SlabLayout layout(g);
  const int64_t block_bytes = g.block_bytes();
  std::vector<BlockIndex> blocks = {3, 9, 10, 40};
  auto host = PinnedBuffer::Allocate(block_bytes * blocks.size());
  auto back = PinnedBuffer::Allocate(block_bytes * blocks.size());
  REQUIRE(host.ok());
  REQUIRE(back.ok());
  for (int64_t i = 0; i < host->size(); ++i) host->data()[i] = static_cast<uint8_t>(i * 31 + 7);
  auto* slab = static_cast<uint8_t*>((*arena)->DeviceAddress(0, 0));
  REQUIRE((*copier)->Scatter(layout, host->data(), blocks, slab).ok());
  REQUIRE((*copier)->Gather(layout, slab, blocks, back->data()).ok());
  REQUIRE((*copier)->Wait().ok());
  REQUIRE(std::memcmp(host->data(), back->data(), host->size()) == 0);
}

}  // namespace
}  // namespace kvd
