// Publish is host-synchronized (docs/api.md): kvd may copy a block the moment its publish
// arrives, so the client library must not send a publish before the engine's writes are done.
// Attacked the way a GPU engine would break it: the worker writes its KV on a second thread (its
// "stream"), slowly, and publishes at once; other workers evict its blocks to the host tier as
// fast as they can, and a third promotes them back and checks every byte.
#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "tests/integration/harness.h"

namespace kvd {
namespace {

using namespace kvd::testing;

// 4-token blocks of 2 layers x 16 bytes; 16 blocks on the device, a host tier below.
std::string Config() {
  return "pools:\n  - name: default\n    block_tokens: 4\n    num_layers: 2\n"
         "    bytes_per_token_per_layer: 16\n    capacity_blocks: 16\n    max_model_len: 256\n"
         "tiers:\n  host_bytes: 1048576\n";
}

TEST_CASE("A slow asynchronous writer's blocks reach the host tier whole", "[integration][publish_order]") {
  DaemonProcess d(Config());
  // 40 tokens (10 blocks), 15 ms each: the writes take about 0.6 s after the worker says WRITING.
  WorkerProcess slow({"--target=" + d.target(), "--id=slow", "--prompt-range=0:40",
                      "--async-writer-us=15000"});
  REQUIRE(slow.WaitForLine("WRITING", absl::Seconds(20)).ok());
  // Fill the device with other prompts over and over while the writes run: any block of `slow`
  // that were published early would be evicted, and demoted, half written.
  int evictions = 0;
  absl::StatusOr<std::string> done;
  for (int i = 0;; ++i) {
    ProcessResult other = RunWorker({"--target=" + d.target(), "--id=" + absl::StrCat("other", i),
                                     "--prompt-range=" + absl::StrCat(10000 + 100 * (i % 7), ":64")});
    INFO(other.out);
    REQUIRE(other.exit_code == 0);
    ++evictions;
    done = slow.WaitForLine("{", absl::Milliseconds(5));
    if (done.ok() || i > 200) break;
  }
  if (!done.ok()) done = slow.WaitForLine("{", absl::Seconds(20));
  REQUIRE(done.ok());
  INFO(*done);
  REQUIRE(JsonInt(*done, "written_bytes") == 40 * 2 * 16);
  // Evict once more, so that every block of `slow` has been copied to the host tier, then read
  // the prompt back: promoted from the host tier, byte for byte what the slow writer wrote.
  REQUIRE(RunWorker({"--target=" + d.target(), "--id=last", "--prompt-range=20000:64"}).exit_code == 0);
  ProcessResult reader = RunWorker({"--target=" + d.target(), "--id=reader", "--prompt-range=0:40"});
  INFO(reader.out);
  REQUIRE(reader.exit_code == 0);
  REQUIRE(JsonInt(reader.out, "cached_tokens") == 36);  // a full hit leaves the last block to compute
  REQUIRE(JsonInt(reader.out, "mismatches") == 0);
}

}  // namespace
}  // namespace kvd
