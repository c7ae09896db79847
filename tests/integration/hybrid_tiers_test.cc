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
#include "tests/integration/hybrid_fixture.h"

namespace kvd::testing {
namespace {

// HybridTierConfig's pool over a host tier and a disk tier in `disk`.
std::string Config(const std::string& disk, int window = 6) {
  return HybridTierConfig(absl::StrCat("  host_bytes: 65536\n  disk_dir: ", disk, "\n"), window);
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
