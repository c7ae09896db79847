// Backend selection and sharded pools, on a machine with or without a GPU.
#include <catch2/catch.hpp>

#include "tests/integration/harness.h"

namespace kvd {
namespace {

using namespace kvd::testing;

TEST_CASE("--backend=cuda without a usable GPU exits at once naming the cause", "[integration][backend]") {
  TempDir dir;
  ProcessResult r = RunProcess(KvdBinary(), {"--backend=cuda", "--listen=unix://" + dir.path() + "/k.sock",
                                             "--metrics-listen=off"},
                               absl::Seconds(20));
  INFO(r.out);
  if (r.exit_code == -1) FAIL("kvd did not exit");
  if (r.out.find("kvd serving") != std::string::npos) {
    WARN("a GPU is usable here: --backend=cuda started; nothing to check");
    return;
  }
  REQUIRE(r.exit_code == 1);
  REQUIRE(r.out.find("--backend=cuda") != std::string::npos);
#if KVD_TEST_HAVE_CUDA
  // The CUDA error's name is kept (cudaErrorNoDevice or cudaErrorInsufficientDriver).
  REQUIRE(r.out.find("cudaError") != std::string::npos);
#else
  REQUIRE(r.out.find("without the CUDA backend") != std::string::npos);
#endif
}

TEST_CASE("--backend=auto falls back to host memory with a warning and serves", "[integration][backend]") {
  DaemonProcess d(SmallPoolConfig(), {"--backend=auto"});
  ProcessResult w = RunWorker({"--target=" + d.target(), "--id=a", "--prompt-range=0:9"});
  INFO(w.out);
  REQUIRE(w.exit_code == 0);
  // Without a GPU here the fallback is said once, as a warning naming why.
  const std::string log = d.Log();
  INFO(log);
#if KVD_TEST_HAVE_CUDA
  REQUIRE(log.find("[warning] no usable GPU (") != std::string::npos);
  // The driver it found (none here) and the runtime it needs are named, for the operator.
  REQUIRE(log.find("NVIDIA driver ") != std::string::npos);
  REQUIRE(log.find("kvd's runtime ") != std::string::npos);
#else
  REQUIRE(log.find("[warning] --backend=auto: built without CUDA; using host memory") != std::string::npos);
#endif
  REQUIRE((log.find("falls back to host memory") != std::string::npos || log.find("using host memory") != std::string::npos));
}

TEST_CASE("A pool sharded over several host shards keeps block indices aligned", "[integration][shards]") {
  const std::string config =
      "pools:\n"
      "  - name: tp\n"
      "    block_tokens: 4\n"
      "    num_layers: 2\n"
      "    bytes_per_token_per_layer: 8\n"
      "    capacity_blocks: 32\n"
      "    max_model_len: 100\n"
      "    shards: 2\n"
      "    layout: block_major\n";
  DaemonProcess d(config);
  const std::string target = "--target=" + d.target();
  // Rank 0 and rank 1 each write only their own shard of the same request's blocks...
  ProcessResult all = RunWorker({target, "--pool=tp", "--id=a", "--prompt-range=0:13"});
  INFO(all.out);
  REQUIRE(all.exit_code == 0);
  REQUIRE(JsonInt(all.out, "written_bytes") == 13 * 2 * 8 * 2);  // both shards
  // ...and a rank that maps only shard 1 verifies its part of the reused blocks.
  ProcessResult rank1 = RunWorker({target, "--pool=tp", "--id=b", "--shard=1", "--prompt-range=0:13"});
  INFO(rank1.out);
  REQUIRE(rank1.exit_code == 0);
  REQUIRE(JsonInt(rank1.out, "cached_tokens") == 12);
  REQUIRE(JsonInt(rank1.out, "verified_bytes") == 12 * 2 * 8);  // one shard only
  REQUIRE(JsonInt(rank1.out, "mismatches") == 0);
}

}  // namespace
}  // namespace kvd
