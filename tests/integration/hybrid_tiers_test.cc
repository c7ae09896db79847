// Hybrid pools with host and disk tiers against the real daemon (docs/hybrid.md §2.9, build step
// 6): a published unit (full blocks, the window's blocks, the state checkpoint) evicted by
// pressure goes down to G2 as units and comes back as units, byte for byte per group; a flush and
// a SIGKILL later the restarted daemon serves it from G3 at once; a corrupt unit on disk, and a
// disk written under another grouping, serve nothing (never a wrong byte). G4: hybrid_remote_test.cc.
#include <signal.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include <catch2/catch.hpp>
#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "tests/integration/harness.h"

namespace kvd::testing {
namespace {

constexpr int kRec = 2;  // the state group's index

// Four layers: full attention in 1 and 3, a `window`-token window in 0, recurrent state in 2
// (k = 2 blocks of 4 tokens). 32 full blocks: two 63-token requests take all of them.
std::string Config(const std::string& disk, int window = 6) {
  return absl::StrCat(
      "pools:\n"
      "  - name: hy\n"
      "    block_tokens: 4\n"
      "    num_layers: 4\n"
      "    bytes_per_token_per_layer: 16\n"
      "    max_model_len: 64\n"
      "    step_tokens: 8\n"
      "    groups:\n"
      "      - {name: full, kind: full, layers: [\"1-3/2\"], capacity_blocks: 32}\n"
      "      - {name: swa, kind: sliding_window, layers: [0], window: ",
      window,
      ", capacity_blocks: 24}\n"
      "      - {name: rec, kind: state, layers: [2], bytes_per_state: 100, checkpoint_every_blocks: 2, "
      "capacity_slots: 6}\n"
      "tiers:\n"
      "  host_bytes: 65536\n"
      "  disk_dir: ",
      disk, "\n");
}

std::vector<Token> Concat(std::vector<Token> a, const std::vector<Token>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Every layer of `unit` of `group`, concatenated.
std::string UnitBytes(const client::PoolView& pool, const std::string& group, int64_t unit) {
  auto view = client::GroupKv(pool, group);
  REQUIRE(view.ok());
  const int64_t local = view->Local(unit);
  REQUIRE(local >= 0);
  std::string out;
  for (int32_t j = 0; j < static_cast<int32_t>(view->layers.size()); ++j) {
    out.append(reinterpret_cast<const char*>(view->Unit(j, local)), static_cast<size_t>(view->layer_unit_bytes));
  }
  return out;
}

void Fill(const client::PoolView& pool, const std::string& group, int64_t unit, uint32_t seed) {
  auto view = client::GroupKv(pool, group);
  REQUIRE(view.ok());
  const int64_t local = view->Local(unit);
  REQUIRE(local >= 0);
  for (int32_t j = 0; j < static_cast<int32_t>(view->layers.size()); ++j) {
    uint8_t* p = view->Unit(j, local);
    for (int64_t i = 0; i < view->layer_unit_bytes; ++i) p[i] = static_cast<uint8_t>(seed * 131 + j * 17 + i * 7);
  }
}

// What a hit at 8 tokens must read, per group: full and window blocks 0 and 1, the state at 8.
struct Unit8 {
  std::string full[2], swa[2], rec;
};

// Publishes the 8 tokens [1, 9) with every group's bytes and the state at 8; returns the bytes.
Unit8 PublishEight(client::Client& c) {
  auto pool = c.FindPool("hy");
  REQUIRE(pool.ok());
  auto req = c.Start(PoolRequest("writer", Concat(Range(1, 8), Range(100, 9)), 0, "hy"));
  REQUIRE(req.ok());
  client::KvRequest& r = **req;
  REQUIRE(r.cached_tokens() == 0);
  const GroupTable full = *r.group_table("full");
  const GroupTable swa = *r.group_table("swa");
  REQUIRE(swa.first_block_position == 0);
  const BlockIndex spare = r.group_table("rec")->blocks[1];
  Unit8 u;
  for (int i = 0; i < 2; ++i) {
    Fill(**pool, "full", full.blocks[i], 10 + i);
    Fill(**pool, "swa", swa.blocks[i], 20 + i);
    u.full[i] = UnitBytes(**pool, "full", full.blocks[i]);
    u.swa[i] = UnitBytes(**pool, "swa", swa.blocks[i]);
  }
  Fill(**pool, "rec", spare, 30);
  u.rec = UnitBytes(**pool, "rec", spare);
  absl::StatusOr<PublishResult> published = r.Publish(Range(1, 8), std::vector<StateCheckpoint>{{kRec, 8, spare}});
  REQUIRE(published.ok());
  REQUIRE(published->checkpoint_outcomes == std::vector<CheckpointOutcome>{CheckpointOutcome::kKept});
  REQUIRE(r.Release(true).ok());
  return u;
}

// Starts a request sharing the 8 tokens; REQUIREs a hit of 0 or of 8 whose every group reads the
// bytes `u` holds (never a wrong byte), and returns the hit.
int64_t ReadBack(client::Client& c, const std::string& id, const Unit8& u) {
  auto pool = c.FindPool("hy");
  REQUIRE(pool.ok());
  auto req = c.Start(PoolRequest(id, Concat(Range(1, 8), Range(500, 9)), 0, "hy"));
  REQUIRE(req.ok());
  client::KvRequest& r = **req;
  const int64_t hit = r.cached_tokens();
  REQUIRE((hit == 0 || hit == 8));
  if (hit == 8) {
    const GroupTable* full = r.group_table("full");
    const GroupTable* swa = r.group_table("swa");
    const GroupTable* rec = r.group_table("rec");
    REQUIRE((full != nullptr && swa != nullptr && rec != nullptr));
    REQUIRE(swa->first_block_position == 0);
    REQUIRE(swa->blocks.size() >= 2);
    for (int i = 0; i < 2; ++i) {
      CHECK(UnitBytes(**pool, "full", full->blocks[i]) == u.full[i]);
      CHECK(UnitBytes(**pool, "swa", swa->blocks[i]) == u.swa[i]);
    }
    REQUIRE(rec->checkpoint_slot >= 0);
    CHECK(UnitBytes(**pool, "rec", rec->checkpoint_slot) == u.rec);
  } else {
    CHECK(r.group_table("rec")->checkpoint_slot == -1);
  }
  REQUIRE(r.Release(true).ok());
  return hit;
}

v1::ReportResponse Report(const DaemonProcess& d) {
  auto stub = v1::Kvd::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::ReportResponse r;
  REQUIRE(stub->Report(&ctx, v1::ReportRequest(), &r).ok());
  return r;
}

bool Flush(const DaemonProcess& d) {
  auto stub = v1::Kvd::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::FlushResponse r;
  REQUIRE(stub->Flush(&ctx, v1::FlushRequest(), &r).ok());
  return r.durable();
}

// The segment files of a disk tier directory.
std::vector<std::string> Segments(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (e.is_regular_file() && name.find("MANIFEST") == std::string::npos && name.find(".tmp") == std::string::npos) {
      out.push_back(e.path().string());
    }
  }
  return out;
}

TEST_CASE("Hybrid units go down to the host tier and come back whole, then survive a restart from disk",
          "[integration][hybrid][tiers]") {
  TempDir disk;
  Unit8 u;
  {
    DaemonProcess d(Config(disk.path()));
    auto c = client::Client::Connect({.target = d.target()});
    REQUIRE(c.ok());
    u = PublishEight(**c);
    // Two 63-token requests need all 32 full blocks: the published unit leaves G1 for G2.
    auto f1 = (*c)->Start(PoolRequest("fill1", Range(1000, 63), 0, "hy"));
    auto f2 = (*c)->Start(PoolRequest("fill2", Range(2000, 63), 0, "hy"));
    REQUIRE((f1.ok() && f2.ok()));
    CHECK((*(*c)->PeekPrefixLen(Namespace{.pool = "hy"}, Concat(Range(1, 8), {7}))) == 0);
    REQUIRE((*f1)->Release(true).ok());
    REQUIRE((*f2)->Release(true).ok());
    // Back from G2 before the lookup: the same hit, every group's bytes and the state identical.
    CHECK(ReadBack(**c, "again", u) == 8);
    v1::ReportResponse r = Report(d);
    CHECK(r.tiers().promotions().at("host") == 2);  // two units: depth 1 and 2
    REQUIRE(Flush(d));
    d.Signal(SIGKILL);
  }
  {
    // A restart reloads the units from G3 and the first lookup hits at once.
    DaemonProcess d(Config(disk.path()));
    auto c = client::Client::Connect({.target = d.target()});
    REQUIRE(c.ok());
    CHECK(Report(d).tiers().reloaded_records() == 2);
    CHECK(ReadBack(**c, "restarted", u) == 8);
    CHECK(Report(d).tiers().promotions().at("disk") == 2);
    d.Signal(SIGKILL);
  }
  {
    // Another grouping (a 5-token window) never matches: nothing served, each record counted.
    DaemonProcess d(Config(disk.path(), 5));
    auto c = client::Client::Connect({.target = d.target()});
    REQUIRE(c.ok());
    CHECK(ReadBack(**c, "regrouped", u) == 0);
    CHECK(Report(d).tiers().incompatible() == 2);
    d.Signal(SIGKILL);
  }
  // A flipped byte in the last stored payload (a unit's): that unit fails its checksum when read,
  // and what is left (or nothing) is not a hit; never a wrong byte.
  const std::vector<std::string> segments = Segments(disk.path());
  REQUIRE(!segments.empty());
  for (const std::string& path : segments) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    char last = 0;
    f.read(&last, 1);
    f.seekp(-1, std::ios::end);
    last = static_cast<char>(last ^ 0x5a);
    f.write(&last, 1);
  }
  DaemonProcess d(Config(disk.path()));
  auto c = client::Client::Connect({.target = d.target()});
  REQUIRE(c.ok());
  CHECK(ReadBack(**c, "corrupt", u) == 0);
  CHECK(Report(d).tiers().checksum_failures() >= 1);
  // The daemon still serves: a fresh publish hits again.
  const Unit8 fresh = PublishEight(**c);
  CHECK(ReadBack(**c, "fresh", fresh) == 8);
}

}  // namespace
}  // namespace kvd::testing
