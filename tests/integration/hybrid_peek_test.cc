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
#include "tests/integration/hybrid_fixture.h"

namespace kvd::testing {
namespace {

// HybridTierConfig's pool (window 6) over a host tier and a disk tier in `disk`.
std::string Config(const std::string& disk) {
  return HybridTierConfig(absl::StrCat("  host_bytes: 65536\n  disk_dir: ", disk, "\n"));
}

const Namespace kNs{.pool = "hy"};
const Namespace kOtherTenant{.pool = "hy", .cache_salt = "tenant-b"};
// Shares the published 8 tokens: 3 blocks may hit, the unit at 8 holds the checkpoint.
const std::vector<Token> kPrompt = Concat(Range(1, 8), Range(500, 9));

// Two 63-token requests take every full block: whatever G1 caches goes down to G2.
void EvictAll(client::Client& c, const std::string& tag) {
  auto f1 = c.Start(PoolRequest(tag + "-1", Range(1000, 63), 0, "hy"));
  auto f2 = c.Start(PoolRequest(tag + "-2", Range(2000, 63), 0, "hy"));
  if (f1.ok()) REQUIRE((*f1)->Release(true).ok());
  if (f2.ok()) REQUIRE((*f2)->Release(true).ok());
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
    u = PublishEight(**c, 40);
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
