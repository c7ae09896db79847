// A hybrid pool's units in the Redis tier (docs/hybrid.md §2.9, G4) against a real redis-server on
// a Unix socket: a unit pressure evicts from G1 goes up as one value and comes back whole into a
// new node's G1 before the lookup, byte for byte per group and checkpoint; a value of another
// grouping written under its key, a truncated value and a flipped byte serve nothing (counted as
// corrupt), encrypted units open only with the key, and the engine's checker and the store's
// gauges agree afterwards.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <catch2/catch.hpp>

#include "absl/time/clock.h"
#include "server/store/remote_tier.h"
#include "tests/unit/store/hybrid_store_fixture.h"
#include "tests/unit/store/store_fixture.h"

namespace kvd {
namespace {

using testing::HybridOptions;
using testing::Seq;
using testing::Serve;
using testing::Spec;

// A redis-server without persistence listening on a Unix socket only, in a temporary directory.
class Redis {
 public:
  Redis() {
    sock_ = dir_.path + "/redis.sock";
    pid_ = fork();
    if (pid_ == 0) {
      execlp("redis-server", "redis-server", "--port", "0", "--unixsocket", sock_.c_str(), "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no", "--dir", dir_.path.c_str(), "--logfile", "redis.log",
             static_cast<char*>(nullptr));
      _exit(127);
    }
    const std::string ping = "redis-cli -s " + sock_ + " PING >/dev/null 2>&1";
    for (int i = 0; i < 200; ++i) {
      if (std::filesystem::exists(sock_) && std::system(ping.c_str()) == 0) return;
      absl::SleepFor(absl::Milliseconds(25));
    }
    FAIL("redis-server did not start (is it installed? scripts/test.sh installs it)");
  }
  ~Redis() {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  std::string url() const { return "unix://" + sock_; }

 private:
  testing::ScopedDir dir_;
  std::string sock_;
  pid_t pid_ = -1;
};

TierOptions RedisOnly(const Redis& redis) {
  TierOptions t;
  t.remote.url = redis.url();
  t.remote.retry_after = absl::Milliseconds(10);
  return t;
}

// Publishes [1, 9) with the window blocks and the state at 8, then a 63-token request takes every
// full block: both units leave G1 and go up to Redis. Waits until the uploads are done.
void PublishAndEvict(testing::Node& node) {
  testing::PublishUnit(node);
  const RequestSpec fill = Spec("fill", Seq(1000, 63));
  testing::Start(*node.cache, fill);
  REQUIRE(node.cache->Release(fill.id, true).ok());
  for (int i = 0; i < 400 && node.store->Stats().remote.uploaded_blocks < 2; ++i) absl::SleepFor(absl::Milliseconds(10));
  REQUIRE(node.store->Stats().remote.uploaded_blocks == 2);
}

// The Redis keys of the two units of [1, 9) in a pool of `o`'s grouping.
std::vector<std::string> UnitNames(RemoteTier& t, const CacheOptions& o) {
  Namespace ns;
  ns.pool = "m";
  const std::vector<BlockKey> keys = ChainKeys(ns, Seq(1, 8), 4, 2);
  return {t.KeyName(ns, "", keys[0], LayoutTag(o.pools[0])), t.KeyName(ns, "", keys[1], LayoutTag(o.pools[0]))};
}

std::vector<std::string> Values(RemoteTier& t, const std::vector<std::string>& names) {
  std::vector<std::string> out(names.size());
  REQUIRE(t.Fetch(names, [&](size_t i, const absl::string_view* v) {
               REQUIRE(v != nullptr);
               out[i] = std::string(*v);
               return true;
             }).ok());
  return out;
}

TEST_CASE("Hybrid units go up to Redis whole as pressure evicts them and come back whole into a new node",
          "[store][hybrid][remote]") {
  Redis redis;
  {
    testing::Node node(RedisOnly(redis), HybridOptions());
    PublishAndEvict(node);
    // G1 lost them and no other tier holds them: Redis serves them back to the same node.
    CHECK(Serve(node, "same") == 8);
    CHECK(node.store->Stats().remote_promotions == 2);
  }
  testing::Node node(RedisOnly(redis), HybridOptions());
  CHECK(Serve(node, "new") == 8);
  const TierStats s = node.store->Stats();
  CHECK(s.remote_promotions == 2);
  CHECK(s.remote.corrupt == 0);
  // Another grouping (a 5-token window) has other keys: it finds nothing, and nothing is refused.
  testing::Node other(RedisOnly(redis), HybridOptions(5));
  CHECK(Serve(other, "other") == 0);
  CHECK(other.store->Stats().remote.corrupt == 0);
}

TEST_CASE("A unit value of another grouping, truncated or with a flipped byte serves nothing",
          "[store][hybrid][remote]") {
  Redis redis;
  RemoteTierOptions ro;
  ro.url = redis.url();
  auto t = *RemoteTier::Open(ro);
  // Units of a 5-token-window pool, and of the pool itself.
  { testing::Node five(RedisOnly(redis), HybridOptions(5)); PublishAndEvict(five); }
  { testing::Node six(RedisOnly(redis), HybridOptions()); PublishAndEvict(six); }
  const std::vector<std::string> names = UnitNames(*t, HybridOptions());
  const std::vector<std::string> good = Values(*t, names);
  const std::vector<std::string> foreign = Values(*t, UnitNames(*t, HybridOptions(5)));
  const auto serve_with = [&](const std::string& what, const std::string& second) {
    INFO(what);
    REQUIRE(t->Store({{names[0], good[0]}, {names[1], second}}).ok());
    testing::Node node(RedisOnly(redis), HybridOptions());
    // The first unit has no checkpoint: without the second, nothing is a hit (and nothing stays).
    CHECK(Serve(node, "x") == 0);
    CHECK(node.store->Stats().remote.corrupt == 1);
    CHECK(node.cache->Report().pools[0].cached_blocks == 0);
  };
  serve_with("another grouping's value under the key", foreign[1]);
  serve_with("a truncated value", good[1].substr(0, good[1].size() - 1));
  std::string flipped = good[1];
  flipped[flipped.size() - 1] = static_cast<char>(flipped.back() ^ 0x5a);
  serve_with("a flipped payload byte", flipped);
  // The header's last byte is its last part's tail flag: a unit claiming another shape of parts
  // (the reader would allocate for it) fails its MAC.
  absl::string_view rest = good[1];
  REQUIRE(DecodeRecordHeader(&rest).ok());
  std::string forged = good[1];
  const size_t tail_flag = good[1].size() - rest.size() - 1;
  forged[tail_flag] = static_cast<char>(forged[tail_flag] ^ 0x01);
  serve_with("a unit's parts altered", forged);
  // Put back, the value serves again.
  REQUIRE(t->Store({{names[1], good[1]}}).ok());
  testing::Node node(RedisOnly(redis), HybridOptions());
  CHECK(Serve(node, "back") == 8);
}

TEST_CASE("Encrypted unit values come back whole; a node without the key serves none of them",
          "[store][hybrid][remote]") {
  Redis redis;
  const testing::ScopedDir dir;
  const std::string key_file = dir.path + "/keys";
  {
    std::ofstream out(key_file);
    out << "k1 " << std::string(64, 'a') << "\n";
  }
  TierOptions sealed = RedisOnly(redis);
  sealed.remote.encryption_key_file = key_file;
  { testing::Node node(sealed, HybridOptions()); PublishAndEvict(node); }
  {
    testing::Node node(sealed, HybridOptions());
    CHECK(Serve(node, "keyed") == 8);
    CHECK(node.store->Stats().remote.corrupt == 0);
  }
  testing::Node plain(RedisOnly(redis), HybridOptions());
  CHECK(Serve(plain, "plain") == 0);
  CHECK(plain.store->Stats().remote.corrupt == 1);
}

}  // namespace
}  // namespace kvd
