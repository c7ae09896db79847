// Tiers with the real daemon and real workers: flush, warm restart with byte-verified hits,
// SavedPrefixes and restart events, kill -9 in the middle of flushes, Close, objects, kvdctl.
#include <signal.h>

#include <future>
#include <random>
#include <set>

#include <catch2/catch.hpp>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "tests/integration/harness.h"

namespace kvd {
namespace {

using namespace kvd::testing;

std::unique_ptr<v1::Kvd::Stub> Stub(const DaemonProcess& d) {
  return v1::Kvd::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
}

// Block bytes: 4 tokens x 2 layers x `bytes_per_token` each.
std::string TierConfig(const std::string& disk_dir, int64_t bytes_per_token = 16,
                       const std::string& codec = "lz4", int capacity_blocks = 256) {
  return absl::StrCat("pools:\n  - name: default\n    block_tokens: 4\n    num_layers: 2\n",
                      "    bytes_per_token_per_layer: ", bytes_per_token, "\n",
                      "    capacity_blocks: ", capacity_blocks, "\n    max_model_len: 2048\n",
                      "tiers:\n  host_bytes: 1048576\n  disk_dir: ", disk_dir, "\n  codec: ", codec, "\n");
}

// Runs the example worker over tokens [start, start + len); returns its cached_tokens (and
// REQUIREs that every reused byte was what its writer wrote).
int64_t Work(const DaemonProcess& d, const std::string& id, int start, int len) {
  ProcessResult r = RunWorker({"--target", d.target(), "--id", id, "--prompt-range",
                               absl::StrCat(start, ":", len)});
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  REQUIRE(JsonInt(r.out, "mismatches") == 0);
  return JsonInt(r.out, "cached_tokens");
}

v1::FlushResponse Flush(v1::Kvd::Stub& stub) {
  grpc::ClientContext ctx;
  v1::FlushResponse r;
  grpc::Status s = stub.Flush(&ctx, v1::FlushRequest(), &r);
  REQUIRE(s.ok());
  return r;
}

std::vector<v1::SavedPrefix> Saved(v1::Kvd::Stub& stub) {
  grpc::ClientContext ctx;
  auto reader = stub.SavedPrefixes(&ctx, v1::SavedPrefixesRequest());
  std::vector<v1::SavedPrefix> out;
  v1::SavedPrefixBatch batch;
  while (reader->Read(&batch)) {
    for (const auto& p : batch.prefixes()) out.push_back(p);
  }
  REQUIRE(reader->Finish().ok());
  return out;
}

TEST_CASE("A restarted daemon serves every flushed prefix at once, byte for byte", "[integration][tiers]") {
  TempDir disk;
  {
    DaemonProcess d(TierConfig(disk.path()));
    REQUIRE(Work(d, "a", 0, 41) == 0);
    REQUIRE(Work(d, "b", 1000, 21) == 0);
    auto stub = Stub(d);
    v1::FlushResponse f = Flush(*stub);
    REQUIRE(f.durable());
    REQUIRE(f.written_records() == 15);
    // kvdctl reports the same, and a second flush has nothing left to write.
    ProcessResult ctl = RunProcess(KVDCTL_BINARY, {"--target", d.target(), "flush"});
    INFO(ctl.out);
    REQUIRE(ctl.exit_code == 0);
    REQUIRE(ctl.out.find("durable: wrote 0 records") != std::string::npos);
    // Not flushed by hand: SIGTERM's drain flushes it.
    REQUIRE(Work(d, "e", 2000, 13) == 0);
    d.Signal(SIGTERM);
    REQUIRE(*d.WaitExit(absl::Seconds(20)) == 0);
  }
  DaemonProcess d(TierConfig(disk.path(), 16, "zstd"));
  auto stub = Stub(d);
  std::vector<v1::SavedPrefix> saved = Saved(*stub);
  REQUIRE(saved.size() == 3);
  std::set<int> lengths;
  for (const auto& p : saved) lengths.insert(p.tokens_size());
  REQUIRE(lengths == std::set<int>{12, 20, 40});
  // Routers resync: "all cleared", then one stored (disk) event per reloaded block.
  {
    grpc::ClientContext ctx;
    v1::WatchEventsRequest req;
    auto reader = stub->WatchEvents(&ctx, req);
    v1::EventBatch batch;
    REQUIRE(reader->Read(&batch));
    REQUIRE(batch.events_size() >= 19);
    REQUIRE(batch.events(0).kind() == v1::CacheEvent::CLEARED);
    for (int i = 1; i < 19; ++i) REQUIRE(batch.events(i).medium() == "disk");
    ctx.TryCancel();
  }
  ProcessResult ctl = RunProcess(KVDCTL_BINARY, {"--target", d.target(), "saved"});
  REQUIRE(ctl.exit_code == 0);
  REQUIRE(ctl.out.find("0,1,2,3,4,5,6,7,...") != std::string::npos);
  // The first lookup after the restart hits: promoted from disk, verified by the worker.
  REQUIRE(Work(d, "c", 0, 41) == 40);
  REQUIRE(Work(d, "d", 1000, 21) == 20);
  grpc::ClientContext ctx;
  v1::ReportResponse r;
  REQUIRE(stub->Report(&ctx, v1::ReportRequest(), &r).ok());
  REQUIRE(r.tiers().reloaded_records() == 18);
  REQUIRE(r.tiers().promotions().at("disk") == 15);
  REQUIRE(r.hit_tokens() == 60);
  // The same counts on /metrics.
  absl::StatusOr<std::string> metrics = HttpGet(d.metrics_port(), "/metrics");
  REQUIRE(metrics.ok());
  REQUIRE(metrics->find("kvd_promotions_total{from=\"disk\"} 15") != std::string::npos);
  REQUIRE(metrics->find("kvd_tier_reloaded_records 18") != std::string::npos);
  REQUIRE(metrics->find("kvd_pending_persistence_records{kind=\"snapshot\"} 0") != std::string::npos);
  REQUIRE(metrics->find("kvd_last_flush_durable 1") != std::string::npos);
}

TEST_CASE("A daemon restarted on a disk written under another model fingerprint serves none of it, and says why",
          "[integration][tiers]") {
  TempDir disk;
  // The same pool name and shape every time; only the weights it declares change.
  const auto config = [&](const std::string& fingerprint) {
    std::string c = TierConfig(disk.path());
    const std::string at = "    max_model_len: 2048\n";
    return c.replace(c.find(at), at.size(), at + "    model_fingerprint: " + fingerprint + "\n");
  };
  {
    DaemonProcess d(config("llama-3.1-8b@v1"));
    REQUIRE(Work(d, "a", 0, 41) == 0);
    REQUIRE(Flush(*Stub(d)).durable());
  }
  {
    DaemonProcess d(config("llama-3.1-8b@v2"));
    REQUIRE(Saved(*Stub(d)).empty());
    REQUIRE(Work(d, "b", 0, 41) == 0);
    const std::string log = d.Log();
    INFO(log);
    REQUIRE(log.find("not served: it was written under another layout or model fingerprint than pool 'default' has "
                     "now (model_fingerprint 'llama-3.1-8b@v2')") != std::string::npos);
    REQUIRE(log.find("10 records in all not served") != std::string::npos);
    // ListPools shows what the pool declares.
    grpc::ClientContext ctx;
    v1::ListPoolsResponse pools;
    REQUIRE(Stub(d)->ListPools(&ctx, v1::ListPoolsRequest(), &pools).ok());
    REQUIRE(pools.pools(0).model_fingerprint() == "llama-3.1-8b@v2");
  }
  // The weights that wrote them get them back (B flushed nothing over them).
  DaemonProcess d(config("llama-3.1-8b@v1"));
  REQUIRE(Saved(*Stub(d)).size() == 1);
  REQUIRE(Work(d, "c", 0, 41) == 40);
}

TEST_CASE("The data mover keeps a reserve free and every demoted prefix still hits, byte for byte",
          "[integration][tiers][mover]") {
  TempDir disk;
  DaemonProcess d(TierConfig(disk.path(), 16, "lz4", /*capacity_blocks=*/16) + "demote_reserve: 0.25\n");
  // Four prompts of five full blocks each: more than G1's 16 blocks once the reserve is kept.
  for (int p = 0; p < 4; ++p) REQUIRE(Work(d, absl::StrCat("fill", p), 1000 * p, 21) == 0);
  // Every prefix hits again (from G1, or promoted from host memory), each byte verified.
  for (int p = 0; p < 4; ++p) REQUIRE(Work(d, absl::StrCat("again", p), 1000 * p, 21) == 20);
  // The mover refills the reserve after the last request took blocks: at least 4 of 16 free (a
  // request's unpublished last block comes back free too).
  bool reserve_kept = false;
  std::string last;
  const std::string free_gauge = "kvd_blocks{pool=\"default\",state=\"free\"} ";
  for (int i = 0; i < 200 && !reserve_kept; ++i) {
    absl::StatusOr<std::string> metrics = HttpGet(d.metrics_port(), "/metrics");
    REQUIRE(metrics.ok());
    last = *metrics;
    const size_t at = metrics->find(free_gauge);
    REQUIRE(at != std::string::npos);
    reserve_kept = std::stoi(metrics->substr(at + free_gauge.size())) >= 4;
    if (!reserve_kept) absl::SleepFor(absl::Milliseconds(50));
  }
  INFO(last);
  REQUIRE(reserve_kept);
  REQUIRE(last.find("kvd_demotions_total{reason=\"capacity\",to=\"host\"} 0") == std::string::npos);
}

TEST_CASE("kill -9 in the middle of flushes never serves a torn block and keeps every durable one",
          "[integration][tiers]") {
  TempDir disk;
  std::mt19937 rng(20261129);
  std::vector<int> durable;  // prefixes a completed flush reported durable
  int kills = 0;
  constexpr int kRounds = 8;
  for (int round = 0; round < kRounds; ++round) {
    // 64 KiB blocks, 100 per prefix: a flush takes long enough to be cut.
    DaemonProcess d(TierConfig(disk.path(), 8192, round % 2 ? "zstd" : "none", 512));
    auto stub = Stub(d);
    // Everything a completed flush reported durable is there, and byte-exact.
    std::vector<v1::SavedPrefix> saved = Saved(*stub);
    for (int p : durable) {
      bool found = false;
      for (const auto& s : saved) found |= s.tokens_size() >= 400 && s.tokens(0) == static_cast<Token>(p * 10000);
      INFO("prefix " << p << " round " << round);
      REQUIRE(found);
      REQUIRE(Work(d, absl::StrCat("check-", round, "-", p), p * 10000, 401) == 400);
    }
    REQUIRE(Work(d, absl::StrCat("new-", round), round * 10000, 401) == 0);
    auto flushed = std::async(std::launch::async, [&] {
      grpc::ClientContext ctx;
      v1::FlushResponse r;
      grpc::Status s = stub->Flush(&ctx, v1::FlushRequest(), &r);
      return s.ok() && r.durable();
    });
    // Odd rounds cut the flush at a random point; even rounds let it finish first, so that there is
    // always something a completed flush promised.
    if (round % 2 == 1) {
      std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, 60000)(rng)));
    } else {
      flushed.wait();
    }
    d.Signal(SIGKILL);
    ++kills;
    const bool completed = flushed.get();
    if (completed) durable.push_back(round);
    (void)d.WaitExit(absl::Seconds(10));
  }
  WARN(kills << " kills; " << durable.size() << " flushes completed before the kill");
  REQUIRE(durable.size() >= kRounds / 2);
  // A last clean start checks the final state.
  DaemonProcess d(TierConfig(disk.path(), 8192, "none", 512));
  for (int p : durable) REQUIRE(Work(d, absl::StrCat("final-", p), p * 10000, 401) == 400);
}

TEST_CASE("An interrupted generation's checkpoint survives a restart and resumes byte-exact",
          "[integration][tiers]") {
  TempDir disk;
  {
    DaemonProcess d(TierConfig(disk.path()), {"--lease-ttl=4"});
    auto stub = Stub(d);
    WorkerProcess victim({"--target", d.target(), "--id", "gen", "--prompt-range", "100:10", "--gen", "20",
                          "--checkpoint-every", "5", "--hang-after-checkpoint"});
    REQUIRE(victim.WaitForLine("CHECKPOINTED", absl::Seconds(20)).ok());
    {
      grpc::ClientContext ctx;
      v1::ReportResponse r;
      REQUIRE(stub->Report(&ctx, v1::ReportRequest(), &r).ok());
      REQUIRE(r.tiers().pending_checkpoints() == 1);  // only in memory so far
    }
    victim.Kill(SIGKILL);
    v1::FlushResponse f = Flush(*stub);
    REQUIRE(f.durable());
    grpc::ClientContext ctx;
    v1::ReportResponse r;
    REQUIRE(stub->Report(&ctx, v1::ReportRequest(), &r).ok());
    REQUIRE(r.tiers().pending_checkpoints() == 0);
    d.Signal(SIGKILL);  // a crash: only what Flush made durable survives
    (void)d.WaitExit(absl::Seconds(10));
  }
  DaemonProcess d(TierConfig(disk.path()));
  auto stub = Stub(d);
  {
    grpc::ClientContext ctx;
    v1::ReportResponse r;
    REQUIRE(stub->Report(&ctx, v1::ReportRequest(), &r).ok());
    REQUIRE(r.tiers().restored_checkpoints() == 1);
    REQUIRE(r.orphaned_checkpoints() == 1);
  }
  ProcessResult resumed = RunWorker({"--target", d.target(), "--id", "gen2", "--resume-from", "gen",
                                     "--prompt-range", "100:10", "--gen", "20"});
  INFO(resumed.out);
  REQUIRE(resumed.exit_code == 0);
  REQUIRE(JsonBool(resumed.out, "resumed"));
  REQUIRE(JsonInt(resumed.out, "cached_tokens") == 15);
  REQUIRE(JsonInt(resumed.out, "mismatches") == 0);
  REQUIRE(JsonInt(resumed.out, "tokens") == 30);
  // Completed now: the next flush deletes the stored checkpoint, so no restart brings it back.
  REQUIRE(Flush(*stub).durable());
  grpc::ClientContext ctx;
  v1::ReportResponse r;
  REQUIRE(stub->Report(&ctx, v1::ReportRequest(), &r).ok());
  REQUIRE(r.orphaned_checkpoints() == 0);
  d.Signal(SIGKILL);
  (void)d.WaitExit(absl::Seconds(10));
  DaemonProcess again(TierConfig(disk.path()));
  auto stub2 = Stub(again);
  grpc::ClientContext ctx2;
  v1::ReportResponse r2;
  REQUIRE(stub2->Report(&ctx2, v1::ReportRequest(), &r2).ok());
  REQUIRE(r2.tiers().restored_checkpoints() == 0);
  REQUIRE(r2.orphaned_checkpoints() == 0);
}

TEST_CASE("Close needs every request ended, flushes, clears, and is idempotent", "[integration][tiers]") {
  TempDir disk;
  DaemonProcess d(TierConfig(disk.path()));
  auto stub = Stub(d);
  REQUIRE(Work(d, "a", 0, 21) == 0);
  for (int i = 0; i < 2; ++i) {
    grpc::ClientContext ctx;
    v1::CloseResponse r;
    REQUIRE(stub->Close(&ctx, v1::CloseRequest(), &r).ok());
    REQUIRE(r.flush().durable());
    REQUIRE(r.flush().written_records() == (i == 0 ? 5 : 0));
    REQUIRE(r.cleared_blocks() == (i == 0 ? 5 : 0));
  }
  // Cleared from memory, still on disk: the next request is promoted from there.
  REQUIRE(Work(d, "b", 0, 21) == 20);
  WorkerProcess hung({"--target", d.target(), "--id", "live", "--prompt-range", "500:9", "--gen", "8",
                      "--checkpoint-every", "4", "--hang-after-checkpoint"});
  REQUIRE(hung.WaitForLine("CHECKPOINTED", absl::Seconds(20)).ok());
  grpc::ClientContext ctx;
  v1::CloseResponse r;
  grpc::Status s = stub->Close(&ctx, v1::CloseRequest(), &r);
  REQUIRE(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  REQUIRE(s.error_message().find("requests are live") != std::string::npos);
}

TEST_CASE("Objects through the daemon, bad input named, and tier RPCs without tiers", "[integration][tiers]") {
  TempDir disk;
  {
    DaemonProcess d(TierConfig(disk.path()));
    auto stub = Stub(d);
    v1::PutObjectRequest put;
    put.mutable_namespace_()->set_pool("default");
    put.set_key("vision/abc");
    put.set_data(std::string(100000, 'v'));
    {
      grpc::ClientContext ctx;
      v1::PutObjectResponse r;
      REQUIRE(stub->PutObject(&ctx, put, &r).ok());
    }
    v1::GetObjectRequest get;
    *get.mutable_namespace_() = put.namespace_();
    get.set_key("vision/abc");
    {
      grpc::ClientContext ctx;
      v1::GetObjectResponse r;
      REQUIRE(stub->GetObject(&ctx, get, &r).ok());
      REQUIRE(r.data() == put.data());
    }
    v1::PutObjectRequest bad = put;
    bad.set_key("");
    grpc::ClientContext c1;
    v1::PutObjectResponse r1;
    grpc::Status s = stub->PutObject(&c1, bad, &r1);
    REQUIRE(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    bad = put;
    bad.mutable_namespace_()->set_pool("nope");
    grpc::ClientContext c2;
    s = stub->PutObject(&c2, bad, &r1);
    REQUIRE(s.error_code() == grpc::StatusCode::NOT_FOUND);
    v1::PrefetchRequest pf;
    pf.set_worker_id("not-attached");
    pf.mutable_namespace_()->set_pool("default");
    pf.add_tokens(1);
    grpc::ClientContext c3;
    v1::PrefetchResponse r3;
    grpc::Status ps = stub->Prefetch(&c3, pf, &r3);
    REQUIRE(ps.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    REQUIRE(ps.error_message().find("not-attached") != std::string::npos);
    REQUIRE(Flush(*stub).durable());
  }
  {
    DaemonProcess d(TierConfig(disk.path()));
    auto stub = Stub(d);
    v1::GetObjectRequest get;
    get.mutable_namespace_()->set_pool("default");
    get.set_key("vision/abc");
    grpc::ClientContext ctx;
    v1::GetObjectResponse r;
    REQUIRE(stub->GetObject(&ctx, get, &r).ok());  // from disk after the restart
    REQUIRE(r.data() == std::string(100000, 'v'));
  }
  DaemonProcess plain(SmallPoolConfig());
  auto stub = Stub(plain);
  grpc::ClientContext ctx;
  v1::FlushResponse r;
  grpc::Status s = stub->Flush(&ctx, v1::FlushRequest(), &r);
  REQUIRE(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  REQUIRE(s.error_message().find("without tiers") != std::string::npos);
}

}  // namespace
}  // namespace kvd
