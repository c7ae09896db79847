// PeekPrefixLen and Prefetch on a hybrid pool whose units left G1 (docs/hybrid.md §2.9), against the
// real daemon: units evicted to G2, and on G3 after a SIGKILL and restart. The peek answers the hit
// the next start gets; a prefetch brings the units into G1 so that the start installs nothing (the
// promotion counters do not move) and reads every group's published bytes; another tenant's salt
// peeks and prefetches nothing; prefetches racing evictions and a SIGKILL leave nothing owned or
// reserved.
#include <signal.h>

#include <atomic>
#include <thread>

#include <catch2/catch.hpp>
#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "tests/integration/harness.h"

namespace kvd::testing {
namespace {

constexpr int kRec = 2;  // the state group's index

// Full attention in layers 1 and 3, a 6-token window in 0, recurrent state in 2 (k = 2 blocks of 4
// tokens). 32 full blocks: two 63-token requests take all of them.
std::string Config(const std::string& disk) {
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
      "      - {name: swa, kind: sliding_window, layers: [0], window: 6, capacity_blocks: 24}\n"
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

// What a hit at 8 tokens reads: full and window blocks 0 and 1, and the state at 8.
struct Unit8 {
  std::string full[2], swa[2], rec;
};

const Namespace kNs{.pool = "hy"};
const Namespace kOtherTenant{.pool = "hy", .cache_salt = "tenant-b"};
// Shares the published 8 tokens: 3 blocks may hit, the unit at 8 holds the checkpoint.
const std::vector<Token> kPrompt = Concat(Range(1, 8), Range(500, 9));

Unit8 PublishEight(client::Client& c) {
  auto pool = c.FindPool("hy");
  REQUIRE(pool.ok());
  auto req = c.Start(PoolRequest("writer", Concat(Range(1, 8), Range(100, 9)), 0, "hy"));
  REQUIRE(req.ok());
  client::KvRequest& r = **req;
  const GroupTable full = *r.group_table("full");
  const GroupTable swa = *r.group_table("swa");
  const BlockIndex spare = r.group_table("rec")->blocks[1];
  Unit8 u;
  for (int i = 0; i < 2; ++i) {
    Fill(**pool, "full", full.blocks[i], 40 + i);
    Fill(**pool, "swa", swa.blocks[i], 50 + i);
    u.full[i] = UnitBytes(**pool, "full", full.blocks[i]);
    u.swa[i] = UnitBytes(**pool, "swa", swa.blocks[i]);
  }
  Fill(**pool, "rec", spare, 60);
  u.rec = UnitBytes(**pool, "rec", spare);
  absl::StatusOr<PublishResult> published = r.Publish(Range(1, 8), std::vector<StateCheckpoint>{{kRec, 8, spare}});
  REQUIRE(published.ok());
  REQUIRE(published->checkpoint_outcomes == std::vector<CheckpointOutcome>{CheckpointOutcome::kKept});
  REQUIRE(r.Release(true).ok());
  return u;
}

// Starts kPrompt; REQUIREs a hit of 0, or of 8 whose every group reads `u`'s bytes. Returns the hit.
int64_t ReadBack(client::Client& c, const std::string& id, const Unit8& u) {
  auto pool = c.FindPool("hy");
  REQUIRE(pool.ok());
  auto req = c.Start(PoolRequest(id, kPrompt, 0, "hy"));
  REQUIRE(req.ok());
  client::KvRequest& r = **req;
  const int64_t hit = r.cached_tokens();
  REQUIRE((hit == 0 || hit == 8));
  if (hit == 8) {
    const GroupTable* full = r.group_table("full");
    const GroupTable* swa = r.group_table("swa");
    const GroupTable* rec = r.group_table("rec");
    REQUIRE((full != nullptr && swa != nullptr && rec != nullptr));
    REQUIRE(swa->blocks.size() >= 2);
    for (int i = 0; i < 2; ++i) {
      CHECK(UnitBytes(**pool, "full", full->blocks[i]) == u.full[i]);
      CHECK(UnitBytes(**pool, "swa", swa->blocks[i]) == u.swa[i]);
    }
    REQUIRE(rec->checkpoint_slot >= 0);
    CHECK(UnitBytes(**pool, "rec", rec->checkpoint_slot) == u.rec);
  }
  REQUIRE(r.Release(true).ok());
  return hit;
}

// Two 63-token requests take every full block: whatever G1 caches goes down to G2.
void EvictAll(client::Client& c, const std::string& tag) {
  auto f1 = c.Start(PoolRequest(tag + "-1", Range(1000, 63), 0, "hy"));
  auto f2 = c.Start(PoolRequest(tag + "-2", Range(2000, 63), 0, "hy"));
  if (f1.ok()) REQUIRE((*f1)->Release(true).ok());
  if (f2.ok()) REQUIRE((*f2)->Release(true).ok());
}

v1::ReportResponse Report(const DaemonProcess& d) {
  auto stub = v1::Kvd::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::ReportResponse r;
  REQUIRE(stub->Report(&ctx, v1::ReportRequest(), &r).ok());
  return r;
}

int64_t Promotions(const DaemonProcess& d, const std::string& tier) {
  const v1::ReportResponse r = Report(d);
  auto it = r.tiers().promotions().find(tier);
  return it == r.tiers().promotions().end() ? 0 : it->second;
}

// Nothing owned or reserved by anyone: free + cached = capacity in every group.
void RequireIdle(client::Client& c) {
  absl::StatusOr<CacheReport> r = c.Report();
  REQUIRE(r.ok());
  CHECK(r->reserved_bytes == 0);
  for (const PoolReport& p : r->pools) {
    CHECK(p.owned_blocks == 0);
    for (const PoolReport::Group& g : p.groups) {
      INFO(g.name);
      CHECK(g.owned == 0);
      CHECK(g.reserved == 0);
      CHECK(g.free + g.cached == g.capacity);
    }
  }
}

TEST_CASE("Hybrid units in G2 and G3: peek answers the next start's hit, prefetch makes it a G1 hit",
          "[integration][hybrid][tiers][peek]") {
  TempDir disk;
  Unit8 u;
  {
    DaemonProcess d(Config(disk.path()));
    auto c = client::Client::Connect({.target = d.target()});
    REQUIRE(c.ok());
    u = PublishEight(**c);
    EvictAll(**c, "fill");
    CHECK(Promotions(d, "host") == 0);
    // G1 holds nothing of the prompt; G2 holds both units: the peek is the start's hit.
    CHECK(*(*c)->PeekPrefixLen(kNs, kPrompt) == 8);
    CHECK(*(*c)->PeekPrefixLen(kOtherTenant, kPrompt) == 0);
    absl::StatusOr<client::PrefetchResult> hostile = (*c)->Prefetch(kOtherTenant, kPrompt);
    REQUIRE(hostile.ok());
    CHECK(hostile->found_blocks == 0);
    REQUIRE((*c)->ReleasePrefetch(hostile->handle).ok());
    CHECK(Promotions(d, "host") == 0);
    CHECK(ReadBack(**c, "peeked", u) == 8);
    CHECK(Promotions(d, "host") == 2);  // the start installed both units

    EvictAll(**c, "again");
    CHECK(*(*c)->PeekPrefixLen(kNs, kPrompt) == 8);
    absl::StatusOr<client::PrefetchResult> pf = (*c)->Prefetch(kNs, kPrompt);
    REQUIRE(pf.ok());
    CHECK(pf->found_blocks == 2);
    CHECK(pf->loading_blocks == 0);
    CHECK(Promotions(d, "host") == 4);
    CHECK(*(*c)->PeekPrefixLen(kNs, kPrompt) == 8);
    CHECK(ReadBack(**c, "prefetched", u) == 8);
    CHECK(Promotions(d, "host") == 4);  // a G1 hit: the start installed nothing
    REQUIRE((*c)->ReleasePrefetch(pf->handle).ok());
    RequireIdle(**c);
    auto stub = v1::Kvd::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    v1::FlushResponse flushed;
    REQUIRE(stub->Flush(&ctx, v1::FlushRequest(), &flushed).ok());
    REQUIRE(flushed.durable());
    d.Signal(SIGKILL);
  }
  DaemonProcess d(Config(disk.path()));
  auto c = client::Client::Connect({.target = d.target()});
  REQUIRE(c.ok());
  // From G3 after the restart: the peek, then a prefetch, then a start with nothing left to install.
  CHECK(*(*c)->PeekPrefixLen(kOtherTenant, kPrompt) == 0);
  CHECK(*(*c)->PeekPrefixLen(kNs, kPrompt) == 8);
  absl::StatusOr<client::PrefetchResult> pf = (*c)->Prefetch(kNs, kPrompt);
  REQUIRE(pf.ok());
  CHECK(pf->found_blocks == 2);
  CHECK(Promotions(d, "disk") == 2);
  CHECK(ReadBack(**c, "from-disk", u) == 8);
  CHECK(Promotions(d, "disk") == 2);
  REQUIRE((*c)->ReleasePrefetch(pf->handle).ok());

  // Prefetches racing evictions (another client's full-pool starts): nothing leaks, and once it is
  // quiet the peek is again exactly the next start's hit.
  std::atomic<bool> stop{false};
  std::thread evictor([&] {
    auto e = client::Client::Connect({.target = d.target()});
    REQUIRE(e.ok());
    for (int i = 0; !stop.load(); ++i) EvictAll(**e, absl::StrCat("race", i));
  });
  for (int i = 0; i < 20; ++i) {
    absl::StatusOr<client::PrefetchResult> r = (*c)->Prefetch(kNs, kPrompt);
    REQUIRE(r.ok());
    CHECK(r->found_blocks <= 2);
    REQUIRE((*c)->ReleasePrefetch(r->handle).ok());
  }
  stop = true;
  evictor.join();
  RequireIdle(**c);
  const int64_t peek = *(*c)->PeekPrefixLen(kNs, kPrompt);
  CHECK(ReadBack(**c, "after-race", u) == peek);

  // A prefetch the daemon is killed under: the restarted daemon serves the peek it answers.
  EvictAll(**c, "last");
  std::thread prefetcher([&] { (void)(*c)->Prefetch(kNs, kPrompt); });  // answered or cut off
  REQUIRE(d.Restart());
  prefetcher.join();
  auto c2 = client::Client::Connect({.target = d.target()});
  REQUIRE(c2.ok());
  const int64_t peek2 = *(*c2)->PeekPrefixLen(kNs, kPrompt);
  CHECK(ReadBack(**c2, "restarted", u) == peek2);
  RequireIdle(**c2);
}

}  // namespace
}  // namespace kvd::testing
