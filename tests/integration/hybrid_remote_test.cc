// A hybrid pool with the Redis tier (G4) only, against the real daemon and a real redis-server
// (docs/hybrid.md §2.9): a published unit (full blocks, the window's blocks, the state
// checkpoint) that pressure evicts from a small G1 goes up to Redis as one value per unit and
// comes back before the lookup, byte for byte per group, on the same kvd and on a new one; another
// grouping never shares its keys; a value of another grouping written under its key, a truncated
// value and a flipped byte serve nothing (kvd_remote_corrupt_total), hold nothing, and leave the
// daemon serving.
#include <signal.h>

#include <catch2/catch.hpp>
#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "server/store/record_header.h"
#include "server/store/remote_tier.h"
#include "tests/integration/harness.h"
#include "tests/integration/hybrid_fixture.h"
#include "tests/integration/remote_fixture.h"

namespace kvd::testing {
namespace {

// HybridTierConfig's pool with the Redis tier (G4) alone.
std::string HybridConfig(const std::string& redis_url, int window = 6) {
  return HybridTierConfig(absl::StrCat("  codec: lz4\n  redis_url: ", redis_url, "\n  redis_retry_after_s: 0.2\n"),
                          window);
}

// Publishes [1, 9) with every group's bytes and the state at 8; then two 63-token requests take
// every full block, so both units leave G1 and go up to Redis (waits for the two uploads).
Unit8 PublishAndEvict(const DaemonProcess& d, client::Client& c, int64_t uploaded_before = 0) {
  const Unit8 u = PublishEight(c);
  auto f1 = c.Start(PoolRequest("fill1", Range(1000, 63), 0, "hy"));
  auto f2 = c.Start(PoolRequest("fill2", Range(2000, 63), 0, "hy"));
  REQUIRE((f1.ok() && f2.ok()));
  REQUIRE((*f1)->Release(true).ok());
  REQUIRE((*f2)->Release(true).ok());
  WaitForMetric(d, kUploaded, uploaded_before + 2);
  return u;
}

// Starts a request sharing the 8 tokens; REQUIREs a hit of 0 or of 8 whose every group reads the
// bytes `u` holds (never a wrong byte), and that nothing stays owned once it ends; returns the hit.
int64_t ReadBack(const DaemonProcess& d, client::Client& c, const std::string& id, const Unit8& u) {
  const int64_t hit = testing::ReadBack(c, id, u);
  const v1::ReportResponse report = Report(d);
  REQUIRE(report.pools_size() == 1);
  CHECK(report.pools(0).owned_blocks() == 0);
  for (const v1::GroupReport& g : report.pools(0).groups()) CHECK(g.owned() == 0);
  return hit;
}

// The value of each unit key in Redis, by layout (the key's "@u<tag>") and depth (1: no parent).
struct StoredUnit {
  std::string key, value;
  int depth = 0;
};
std::vector<StoredUnit> StoredUnits(const RedisServer& redis) {
  RemoteTierOptions o;
  o.url = redis.url();
  auto t = RemoteTier::Open(o);
  REQUIRE(t.ok());
  std::vector<StoredUnit> out;
  for (const std::string& key : redis.Keys()) {
    if (key.find("@u") == std::string::npos) continue;
    REQUIRE((*t)->Fetch({key}, [&](size_t, const absl::string_view* v) {
                 REQUIRE(v != nullptr);
                 absl::string_view in = *v;
                 auto h = DecodeRecordHeader(&in);
                 REQUIRE(h.ok());
                 REQUIRE(h->kind == RecordKind::kUnit);
                 out.push_back(StoredUnit{key, std::string(*v), h->has_parent ? 2 : 1});
                 return true;
               }).ok());
  }
  return out;
}

void Set(const RedisServer& redis, const std::string& key, const std::string& value) {
  RemoteTierOptions o;
  o.url = redis.url();
  auto t = RemoteTier::Open(o);
  REQUIRE(t.ok());
  REQUIRE((*t)->Store({{key, value}}).ok());
}

TEST_CASE("Hybrid units go up to Redis as pressure evicts them and come back whole, on a new kvd too",
          "[integration][hybrid][tiers][remote]") {
  RedisServer redis;
  Unit8 u;
  {
    DaemonProcess d(HybridConfig(redis.url()));
    auto c = client::Client::Connect({.target = d.target()});
    REQUIRE(c.ok());
    u = PublishAndEvict(d, **c);
    // G1 lost both units and only Redis holds them: back before the lookup, every group identical.
    CHECK(ReadBack(d, **c, "again", u) == 8);
    CHECK(Metric(d, "kvd_promotions_total{from=\"remote\"}") == 2);
    d.Signal(SIGKILL);
  }
  {
    DaemonProcess d(HybridConfig(redis.url()));
    auto c = client::Client::Connect({.target = d.target()});
    REQUIRE(c.ok());
    CHECK(ReadBack(d, **c, "new", u) == 8);
    CHECK(Metric(d, "kvd_remote_corrupt_total") == 0);
    d.Signal(SIGKILL);
  }
  // Another grouping (a 5-token window) has keys of its own: it finds nothing, refuses nothing.
  DaemonProcess d(HybridConfig(redis.url(), 5));
  auto c = client::Client::Connect({.target = d.target()});
  REQUIRE(c.ok());
  CHECK(ReadBack(d, **c, "regrouped", u) == 0);
  CHECK(Metric(d, "kvd_remote_corrupt_total") == 0);
}

TEST_CASE("A unit value of another grouping, truncated or with a flipped byte serves nothing from Redis",
          "[integration][hybrid][tiers][remote]") {
  RedisServer redis;
  Unit8 u;
  {
    DaemonProcess d(HybridConfig(redis.url()));
    auto c = client::Client::Connect({.target = d.target()});
    REQUIRE(c.ok());
    u = PublishAndEvict(d, **c);
    d.Signal(SIGKILL);
  }
  const std::vector<StoredUnit> ours = StoredUnits(redis);
  REQUIRE(ours.size() == 2);
  {
    DaemonProcess d(HybridConfig(redis.url(), 5));
    auto c = client::Client::Connect({.target = d.target()});
    REQUIRE(c.ok());
    PublishAndEvict(d, **c);
    d.Signal(SIGKILL);
  }
  // The 5-token window's units went up under keys of their own.
  const std::vector<StoredUnit> all = StoredUnits(redis);
  REQUIRE(all.size() == 4);
  const StoredUnit *mine = nullptr, *other = nullptr;
  for (const StoredUnit& s : all) {
    const bool is_ours = s.key == ours[0].key || s.key == ours[1].key;
    if (s.depth == 2) (is_ours ? mine : other) = &s;
  }
  REQUIRE((mine != nullptr && other != nullptr));
  const StoredUnit target = *mine;
  const std::string foreign = other->value;
  // A new kvd after `value` was written under our depth-2 unit's key: its hit and corrupt count.
  const auto serve_after = [&](const std::string& value) {
    Set(redis, target.key, value);
    DaemonProcess d(HybridConfig(redis.url()));
    auto c = client::Client::Connect({.target = d.target()});
    REQUIRE(c.ok());
    const int64_t hit = ReadBack(d, **c, "x", u);
    const int64_t corrupt = Metric(d, "kvd_remote_corrupt_total");
    d.Signal(SIGKILL);
    return std::make_pair(hit, corrupt);
  };
  // Without the depth-2 unit (its checkpoint) the depth-1 unit alone is no hit, and nothing stays.
  SECTION("another grouping's value under the key") {
    CHECK(serve_after(foreign) == std::make_pair(int64_t{0}, int64_t{1}));
  }
  SECTION("a truncated value") {
    CHECK(serve_after(target.value.substr(0, target.value.size() - 1)) == std::make_pair(int64_t{0}, int64_t{1}));
  }
  SECTION("a flipped byte") {
    std::string flipped = target.value;
    flipped[flipped.size() / 2] = static_cast<char>(flipped[flipped.size() / 2] ^ 0x01);
    CHECK(serve_after(flipped) == std::make_pair(int64_t{0}, int64_t{1}));
  }
  // Put back, it serves again.
  CHECK(serve_after(target.value) == std::make_pair(int64_t{8}, int64_t{0}));
}

}  // namespace
}  // namespace kvd::testing
