// kvd_cuda_bench (GPU only): the two costs of the CUDA data plane, each beside its baseline.
//   1. cudaIpcOpenMemHandle per slab size (2 MiB .. 16 GiB), measured in a child process (a
//      process cannot open its own handle), beside the cudaMalloc of the same size.
//   2. Block gather/scatter device <-> pinned host through CudaBlockCopier (2 MiB Llama-3-8B
//      blocks of 32 layer rows, layer-major: one cudaMemcpy2DAsync per block) and the daemon's
//      own per-block DeviceArena::ReadBlock, beside one plain cudaMemcpy of the same bytes.
//
//   kvd_cuda_bench [--max-gib=16] [--blocks=256]
#include <algorithm>

#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/tools/self_spawn.h"
#include "gpu/cuda_arena.h"
#include "gpu/cuda_block_copier.h"
#include "gpu/cuda_slab_import.h"

namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

int ChildOpen(const std::string& hex, int64_t size) {
  const std::string handle = absl::HexStringToBytes(hex);
  const auto t0 = Clock::now();
  auto slab = kvd::ImportedCudaSlab::Open(0, handle, size);
  const double us = Seconds(Clock::now() - t0) * 1e6;
  if (!slab.ok()) {
    std::fprintf(stderr, "%s\n", slab.status().ToString().c_str());
    return 1;
  }
  std::printf("%.1f\n", us);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int max_gib = 16, num_blocks = 256;
  std::string child_hex;
  int64_t child_size = 0;
  for (int i = 1; i < argc; ++i) {
    std::vector<std::string> kv = absl::StrSplit(argv[i], absl::MaxSplits('=', 1));
    const std::string v = kv.size() > 1 ? kv[1] : "";
    if (kv[0] == "--max-gib") (void)absl::SimpleAtoi(v, &max_gib);
    else if (kv[0] == "--blocks") (void)absl::SimpleAtoi(v, &num_blocks);
    else if (kv[0] == "--child-handle") child_hex = v;
    else if (kv[0] == "--child-size") (void)absl::SimpleAtoi(v, &child_size);
  }
  if (!child_hex.empty()) return ChildOpen(child_hex, child_size);
  if (absl::Status s = kvd::ProbeCuda(); !s.ok()) {
    std::fprintf(stderr, "no usable GPU: %s\n", s.ToString().c_str());
    return 1;
  }

  std::printf("| slab size | cudaMalloc (ms) | cudaIpcOpenMemHandle (ms) |\n|---|---|---|\n");
  for (int64_t size = int64_t{2} << 20; size <= (int64_t{max_gib} << 30); size *= 8) {
    kvd::PoolGeometry g{.name = "ipc", .block_tokens = 16, .num_layers = 1,
                        .bytes_per_token_per_layer = 131072, .capacity_blocks = size / (2 << 20)};
    const auto t0 = Clock::now();
    auto arena = kvd::CudaArena::Create({g});
    const double malloc_ms = Seconds(Clock::now() - t0) * 1e3;
    if (!arena.ok()) {
      std::printf("| %lld MiB | %s | - |\n", static_cast<long long>(size >> 20), arena.status().ToString().c_str());
      break;
    }
    auto kid = kvd::tools::SpawnSelf(
        argv[0], {"--child-handle=" + absl::BytesToHexString((*arena)->slabs()[0].cuda_ipc_handle),
                  absl::StrCat("--child-size=", (*arena)->slabs()[0].size_bytes)});
    if (!kid.ok()) return 1;
    kvd::tools::ChildResult r = kvd::tools::Collect(*kid);
    double open_us = 0;
    if (!r.ok || !absl::SimpleAtod(absl::StripAsciiWhitespace(r.out), &open_us)) open_us = -1;
    std::printf("| %lld MiB | %.2f | %.3f |\n", static_cast<long long>(size >> 20), malloc_ms, open_us / 1e3);
  }

  // Gather / scatter: Llama-3-8B bf16 geometry, 2 MiB blocks of 32 x 64 KiB layer chunks.
  kvd::PoolGeometry g{.name = "kv", .block_tokens = 16, .num_layers = 32,
                      .bytes_per_token_per_layer = 4096, .capacity_blocks = 4 * num_blocks};
  auto arena = kvd::CudaArena::Create({g});
  auto copier = kvd::CudaBlockCopier::Create(0);
  const int64_t bytes = g.block_bytes() * num_blocks;
  auto host = kvd::PinnedBuffer::Allocate(bytes);
  if (!arena.ok() || !copier.ok() || !host.ok()) return 1;
  auto* slab = static_cast<uint8_t*>((*arena)->DeviceAddress(0, 0));
  std::vector<kvd::BlockIndex> blocks(g.capacity_blocks);
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = static_cast<kvd::BlockIndex>(i);
  std::shuffle(blocks.begin(), blocks.end(), std::mt19937(7));
  blocks.resize(num_blocks);
  const kvd::SlabLayout layout(g);
  auto best = [](auto fn) {
    double b = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      const auto t0 = Clock::now();
      if (!fn()) return -1.0;
      b = std::min(b, Seconds(Clock::now() - t0));
    }
    return b;
  };
  const double memcpy_d2h = best([&] { return kvd::CudaCopy(0, host->data(), slab, bytes).ok(); });
  const double memcpy_h2d = best([&] { return kvd::CudaCopy(0, slab, host->data(), bytes).ok(); });
  const double gather = best([&] {
    return (*copier)->Gather(layout, slab, blocks, host->data()).ok() && (*copier)->Wait().ok();
  });
  const double scatter = best([&] {
    return (*copier)->Scatter(layout, host->data(), blocks, slab).ok() && (*copier)->Wait().ok();
  });
  // The daemon's own tier copy: DeviceArena::ReadBlock, one block at a time (one 2D copy and one
  // wait each), as demotion and flush call it.
  const double daemon_reads = best([&] {
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (!(*arena)->ReadBlock(0, blocks[i], host->data() + i * g.block_bytes()).ok()) return false;
    }
    return true;
  });
  std::printf("\n%d random 2 MiB blocks (%lld MiB, %d layer rows each, one cudaMemcpy2DAsync per "
              "block), best of 5:\n", num_blocks, static_cast<long long>(bytes >> 20), g.num_layers);
  std::printf("| copy | GB/s | vs plain cudaMemcpy |\n|---|---|---|\n");
  std::printf("| plain cudaMemcpy device->pinned | %.1f | 1.00 |\n", bytes / memcpy_d2h / 1e9);
  std::printf("| gather blocks device->pinned | %.1f | %.2f |\n", bytes / gather / 1e9, memcpy_d2h / gather);
  std::printf("| daemon ReadBlock per block device->pinned | %.1f | %.2f |\n", bytes / daemon_reads / 1e9,
              memcpy_d2h / daemon_reads);
  std::printf("| plain cudaMemcpy pinned->device | %.1f | 1.00 |\n", bytes / memcpy_h2d / 1e9);
  std::printf("| scatter blocks pinned->device | %.1f | %.2f |\n", bytes / scatter / 1e9, memcpy_h2d / scatter);
  return 0;
}
