// GPU tests (hidden tag [.gpu]; registered only when CUDA is found). Each test checks for a usable
// device first and, without one, says so and returns. On a GPU machine they run from the bundle
// (scripts/gpu-bundle.sh, then its run.sh), which sets KVD_TEST_BIN_DIR to the bundle's binaries.
#include <signal.h>
#include <unistd.h>

#include <thread>

#include <catch2/catch.hpp>
// This suite drives streams itself (a slow writer); only gpu/ and tests/gpu see CUDA types.
#include <cuda_runtime_api.h>

#include "client/client.h"
#include "client/examples/kv_pattern.h"
#include "gpu/cuda_arena.h"
#include "gpu/cuda_block_copier.h"
#include "gpu/cuda_device.h"
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

// The writer is this process, the reader another (CUDA defines opening an IPC handle only in a
// process other than the one that exported it). The writer's stream first runs a 300 ms host
// function, then copies the KV: a slow GPU writer. It records its event and publishes at once;
// the host-synchronized publish (docs/api.md) holds the publish until the stream has run, so the
// reader process, started the moment the publish returns, sees every byte.
TEST_CASE("GPU: a slow writer's publish waits for its stream; another process reads it whole", "[.gpu]") {
  if (!HaveGpu()) return;
  DaemonProcess d(CudaPoolConfig(), {"--backend=cuda"});
  auto writer = client::Client::Connect({.target = d.target(), .ipc_event_device = 0});
  INFO(writer.status().ToString());
  REQUIRE(writer.ok());
  RequestSpec s = PoolRequest("w", Range(0, 40));
  auto w = (*writer)->Start(s);
  REQUIRE(w.ok());
  const PoolGeometry& g = (*writer)->pools()[(*w)->pool()].geometry;
  const int64_t n = g.bytes_per_token_per_layer;
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaLaunchHostFunc(stream, [](void*) { usleep(300 * 1000); }, nullptr) == cudaSuccess);
  std::vector<uint8_t> host(32 * g.num_layers * n);  // pageable: cudaMemcpyAsync stages it
  for (int64_t pos = 0; pos < 32; ++pos) {
    for (int32_t layer = 0; layer < g.num_layers; ++layer) {
      uint8_t* src = host.data() + (pos * g.num_layers + layer) * n;
      for (int64_t j = 0; j < n; ++j) src[j] = example::KvByte(s.prompt[pos], pos, layer, j);
      auto dst = (*writer)->LayerPointer((*w)->pool(), (*w)->blocks()[pos / 16], layer);
      REQUIRE(dst.ok());
      REQUIRE(cudaMemcpyAsync(*dst + (pos % 16) * n, src, n, cudaMemcpyHostToDevice, stream) == cudaSuccess);
    }
  }
  REQUIRE((*writer)->RecordWrites(stream).ok());
  REQUIRE((*w)->Publish(s.prompt).ok());  // waits for the stream (host-synchronized publish)
  REQUIRE((*w)->Release(/*completed=*/true).ok());
  ProcessResult r = RunWorker({"--target=" + d.target(), "--id=r", "--prompt-range=0:40"});
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  REQUIRE(JsonInt(r.out, "cached_tokens") == 32);
  REQUIRE(JsonInt(r.out, "mismatches") == 0);
  cudaStreamDestroy(stream);
}

// Tiers on the CUDA backend: blocks demoted to the host tier under pressure come back byte for
// byte; flushed ones survive a daemon restart into fresh device memory.
TEST_CASE("GPU: demote, promote, flush and restart move device blocks whole", "[.gpu]") {
  if (!HaveGpu()) return;
  TempDir disk;
  const std::string config =
      "pools:\n  - name: default\n    block_tokens: 16\n    num_layers: 4\n"
      "    bytes_per_token_per_layer: 256\n    capacity_blocks: 16\n    max_model_len: 2048\n"
      "tiers:\n  host_bytes: 8388608\n  disk_dir: " + disk.path() + "\n";
  {
    DaemonProcess d(config, {"--backend=cuda"});
    const std::string target = "--target=" + d.target();
    REQUIRE(RunWorker({target, "--id=a", "--prompt-range=0:100"}).exit_code == 0);
    for (int i = 0; i < 3; ++i) {  // 16 blocks of other prompts: a's 6 blocks are demoted
      REQUIRE(RunWorker({target, "--id=o" + std::to_string(i),
                         "--prompt-range=" + std::to_string(5000 + 1000 * i) + ":250"}).exit_code == 0);
    }
    ProcessResult back = RunWorker({target, "--id=b", "--prompt-range=0:100"});
    INFO(back.out);
    REQUIRE(back.exit_code == 0);
    REQUIRE(JsonInt(back.out, "cached_tokens") == 96);  // promoted from the host tier
    REQUIRE(JsonInt(back.out, "mismatches") == 0);
    d.Signal(SIGTERM);  // drain flushes to disk
    REQUIRE(d.WaitExit(absl::Seconds(30)).ok());
  }
  DaemonProcess restarted(config, {"--backend=cuda"});
  ProcessResult after = RunWorker({"--target=" + restarted.target(), "--id=c", "--prompt-range=0:100"});
  INFO(after.out);
  REQUIRE(after.exit_code == 0);
  REQUIRE(JsonInt(after.out, "cached_tokens") == 96);  // from disk into the new daemon's memory
  REQUIRE(JsonInt(after.out, "mismatches") == 0);
}

// A worker pod granted one GPU sees it as device 0, whatever the daemon calls it. The pool lives
// on the daemon's last device; the worker sees only that device (CUDA_VISIBLE_DEVICES=<uuid>)
// and must resolve it by UUID. A worker that sees no GPU fails with a clear error.
TEST_CASE("GPU: a worker that sees only the pool's device maps it by UUID", "[.gpu]") {
  if (!HaveGpu()) return;
  auto devices = ListCudaDevices();
  REQUIRE(devices.ok());
  const DeviceIdentity& last = devices->back();
  DaemonProcess d("pools:\n  - name: far\n    block_tokens: 16\n    num_layers: 2\n"
                  "    bytes_per_token_per_layer: 64\n    capacity_blocks: 64\n    devices: [" +
                      std::to_string(last.ordinal) + "]\n",
                  {"--backend=cuda"});
  const std::string target = "--target=" + d.target();
  REQUIRE(RunWorker({target, "--pool=far", "--id=a", "--prompt-range=0:50"}).exit_code == 0);
  ProcessResult pod = RunProcess("/usr/bin/env", {"CUDA_VISIBLE_DEVICES=" + last.uuid, ExampleWorkerBinary(),
                                                  target, "--pool=far", "--id=b", "--prompt-range=0:50"});
  INFO(pod.out);
  REQUIRE(pod.exit_code == 0);
  REQUIRE(JsonInt(pod.out, "cached_tokens") == 48);
  REQUIRE(JsonInt(pod.out, "mismatches") == 0);
  ProcessResult blind = RunProcess("/usr/bin/env", {"CUDA_VISIBLE_DEVICES=", ExampleWorkerBinary(),
                                                    target, "--pool=far", "--id=c", "--prompt-range=0:50"});
  INFO(blind.out);
  REQUIRE(blind.exit_code != 0);
  REQUIRE(blind.out.find("CUDA") != std::string::npos);
  if (devices->size() < 2) WARN("one GPU: the UUID was resolved, but to the same ordinal");
}

// Library calls leave the caller's current device as they found it.
TEST_CASE("GPU: connecting and copying leave the engine's current device alone", "[.gpu]") {
  if (!HaveGpu()) return;
  auto devices = ListCudaDevices();
  REQUIRE(devices.ok());
  const int mine = devices->back().ordinal;  // the engine's device; the pool is on device 0
  DaemonProcess d(CudaPoolConfig(), {"--backend=cuda"});
  int after_connect = -1, after_copy = -1;
  bool ok = false;
  std::thread engine([&] {
    cudaSetDevice(mine);
    auto c = client::Client::Connect({.target = d.target(), .ipc_event_device = 0});
    if (!c.ok()) return;
    cudaGetDevice(&after_connect);
    auto r = (*c)->Start(PoolRequest("x", Range(0, 20)));
    ok = r.ok() && (*c)->RecordWrites(nullptr).ok() && (*r)->Publish(Range(0, 20)).ok();
    cudaGetDevice(&after_copy);
  });
  engine.join();
  REQUIRE(ok);
  REQUIRE(after_connect == mine);
  REQUIRE(after_copy == mine);
}

TEST_CASE("GPU: a worker reusing its own published blocks waits on its own event, not an opened copy",
          "[.gpu]") {
  if (!HaveGpu()) return;
  DaemonProcess d(CudaPoolConfig(), {"--backend=cuda"});
  auto c = client::Client::Connect({.target = d.target(), .ipc_event_device = 0});
  REQUIRE(c.ok());
  {
    auto first = (*c)->Start(PoolRequest("first", Range(0, 40)));
    REQUIRE(first.ok());
    REQUIRE((*c)->RecordWrites(nullptr).ok());
    REQUIRE((*first)->Publish(Range(0, 40)).ok());
    REQUIRE((*first)->Release(true).ok());
  }
  auto again = (*c)->Start(PoolRequest("again", Range(0, 40)));
  REQUIRE(again.ok());
  REQUIRE((*again)->cached_tokens() == 32);
  REQUIRE(!(*again)->publisher_events().empty());  // its own event: CUDA refuses to open that here
  absl::Status waited = (*c)->WaitForPublishers(**again, nullptr);
  INFO(waited.ToString());
  REQUIRE(waited.ok());
}

TEST_CASE("GPU: WriteLayer and ReadLayer work from a thread that never selected a device", "[.gpu]") {
  if (!HaveGpu()) return;
  DaemonProcess d(CudaPoolConfig(), {"--backend=cuda"});
  auto c = client::Client::Connect({.target = d.target()});
  REQUIRE(c.ok());
  auto r = (*c)->Start(PoolRequest("x", Range(0, 20)));
  REQUIRE(r.ok());
  absl::Status wrote, read;
  std::vector<uint8_t> got(256);
  std::thread fresh([&] {  // a new thread: no CUDA context current
    std::vector<uint8_t> bytes(256, 0x5a);
    wrote = (*c)->WriteLayer((*r)->pool(), (*r)->blocks()[0], 0, 0, bytes.data(), 256);
    read = (*c)->ReadLayer((*r)->pool(), (*r)->blocks()[0], 0, 0, got.data(), 256);
  });
  fresh.join();
  INFO(wrote.ToString() << " / " << read.ToString());
  REQUIRE(wrote.ok());
  REQUIRE(read.ok());
  REQUIRE(got == std::vector<uint8_t>(256, 0x5a));
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
