// RemoteTier without a server: URL parsing, key names, and the failure back-off (a refused
// connection fails fast, then the tier is skipped without a round trip until retry_after).
// tests/integration/remote_test.cc runs it against a real redis-server.
#include <catch2/catch.hpp>

#include "absl/time/clock.h"
#include "server/core/clock.h"
#include "server/store/remote_tier.h"
#include "tests/util/free_port.h"

namespace kvd {
namespace {

absl::StatusOr<std::unique_ptr<RemoteTier>> OpenUrl(const std::string& url) {
  RemoteTierOptions o;
  o.url = url;
  return RemoteTier::Open(o);
}

TEST_CASE("RemoteTier URLs: redis://, unix://, redis-cluster://; anything else is INVALID_ARGUMENT", "[store][remote]") {
  for (const char* ok : {"redis://127.0.0.1:6379", "redis://cache", "redis://:secret@cache:7000/3",
                         "redis://user:pw@10.0.0.1:6380", "unix:///run/redis/redis.sock",
                         "redis-cluster://10.0.0.1:7000", "redis-cluster://u:pw@a:7000,b:7001,[::1]:7002"}) {
    INFO(ok);
    REQUIRE(OpenUrl(ok).ok());
  }
  for (const char* bad : {"http://cache:6379", "redis://", "redis://cache:99999", "redis://cache:6379/x",
                          "unix://relative.sock", "cache:6379", "redis-cluster://", "redis-cluster://a:7000/1",
                          "redis-cluster://a:7000,b", "redis-cluster://a:70000"}) {
    INFO(bad);
    absl::StatusOr<std::unique_ptr<RemoteTier>> t = OpenUrl(bad);
    REQUIRE(t.status().code() == absl::StatusCode::kInvalidArgument);
    REQUIRE(t.status().message().find("redis_url") != absl::string_view::npos);
  }
}

TEST_CASE("Redis passwords never appear in messages or printed URLs", "[store][remote]") {
  REQUIRE(RedactUrl("redis://:hunter2@cache:7000/3") == "redis://:***@cache:7000/3");
  REQUIRE(RedactUrl("redis://ops:hunter2@cache") == "redis://ops:***@cache");
  REQUIRE(RedactUrl("redis://hunter2@cache") == "redis://:***@cache");
  REQUIRE(RedactUrl("redis://cache:6379") == "redis://cache:6379");
  REQUIRE(RedactUrl("unix:///run/redis.sock") == "unix:///run/redis.sock");
  REQUIRE(RedactUrl("redis-cluster://ops:hunter2@a:7000,b:7001") == "redis-cluster://ops:***@a:7000,b:7001");
  for (const char* bad : {"redis://:hunter2@cache:99999", "redis://ops:hunter2@cache:1/x", "redis://:hunter2@"}) {
    INFO(bad);
    absl::StatusOr<std::unique_ptr<RemoteTier>> t = OpenUrl(bad);
    REQUIRE(t.status().code() == absl::StatusCode::kInvalidArgument);
    REQUIRE(t.status().message().find("hunter2") == absl::string_view::npos);
    REQUIRE(t.status().message().find("***") != absl::string_view::npos);
  }
  auto t = OpenUrl("redis://:hunter2@cache:7000");
  REQUIRE(t.ok());
  REQUIRE((*t)->display_url() == "redis://:***@cache:7000");
  RemoteTierOptions o;
  o.url = "redis://cache:7000";
  o.password_file = "/nonexistent/kvd-redis-password";
  auto missing = RemoteTier::Open(o);
  REQUIRE(missing.status().code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(missing.status().message().find("redis_password_file") != absl::string_view::npos);
}

TEST_CASE("RemoteTier keys name the pool and a tag of the salt, never the salt", "[store][remote]") {
  auto t = *OpenUrl("redis://127.0.0.1:6379");
  Namespace ns;
  ns.pool = "llama";
  BlockKey key{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
  REQUIRE(t->KeyName(ns, "", key) == "kvd:llama:-:0123456789abcdeffedcba9876543210");
  ns.cache_salt = "tenant-secret";
  const std::string salted = t->KeyName(ns, "", key);
  REQUIRE(salted.find("tenant-secret") == std::string::npos);
  REQUIRE(salted.size() == std::string("kvd:llama:").size() + 16 + 1 + 32);
  ns.cache_salt = "other";
  REQUIRE(t->KeyName(ns, "", key) != salted);
}

TEST_CASE("RemoteTier keys of a pool with a model fingerprint differ per fingerprint", "[store][remote]") {
  auto t = *OpenUrl("redis://127.0.0.1:6379");
  Namespace ns;
  ns.pool = "llama";
  BlockKey key{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
  const std::string plain = t->KeyName(ns, "", key);
  const std::string v1 = t->KeyName(ns, "llama-3.1-8b@v1", key);
  const std::string v2 = t->KeyName(ns, "llama-3.1-8b@v2", key);
  REQUIRE(v1 != plain);
  REQUIRE(v1 != v2);
  REQUIRE(v1.rfind("kvd:llama@", 0) == 0);
  REQUIRE(v1.size() == std::string("kvd:llama@").size() + 16 + std::string(":-:").size() + 32);
  REQUIRE(t->KeyName(ns, "llama-3.1-8b@v1", key) == v1);
}

TEST_CASE("A refused connection fails fast, then the tier is skipped until retry_after", "[store][remote]") {
  RemoteTierOptions o;
  const int port = testing::FreeLoopbackPort();  // nothing listens there
  REQUIRE(port > 0);
  o.url = "redis://127.0.0.1:" + std::to_string(port);
  o.retry_after = absl::Milliseconds(300);
  FakeClock clock;
  o.clock = &clock;
  auto t = *RemoteTier::Open(o);
  REQUIRE(t->available());
  const std::vector<std::string> keys = {"a", "b"};
  REQUIRE(t->RunLength(keys).status().code() == absl::StatusCode::kUnavailable);
  RemoteStats s = t->Stats();
  REQUIRE(s.errors == 1);
  REQUIRE_FALSE(s.available);
  REQUIRE(s.last_error.find("connect") != std::string::npos);
  // During the back-off: no connection attempt, counted as skipped.
  REQUIRE(t->Refresh(keys).status().code() == absl::StatusCode::kUnavailable);
  REQUIRE(t->Store({{"a", "1"}}).code() == absl::StatusCode::kUnavailable);
  bool consumed = false;
  REQUIRE(t->Fetch(keys, [&](size_t, const absl::string_view*) { return consumed = true; }).code() ==
          absl::StatusCode::kUnavailable);
  REQUIRE_FALSE(consumed);
  s = t->Stats();
  REQUIRE(s.errors == 1);
  REQUIRE(s.skipped == 3);
  // After it: tried again (and fails again: nothing listens).
  clock.Advance(absl::Milliseconds(299));
  REQUIRE_FALSE(t->available());
  clock.Advance(absl::Milliseconds(2));
  REQUIRE(t->available());
  REQUIRE_FALSE(t->RunLength(keys).ok());
  REQUIRE(t->Stats().errors == 2);
}

TEST_CASE("A cluster none of whose seeds answers fails fast and backs off like one server", "[store][remote][cluster]") {
  RemoteTierOptions o;
  const int a = testing::FreeLoopbackPort();
  const int b = testing::FreeLoopbackPort();
  REQUIRE((a > 0 && b > 0));
  o.url = "redis-cluster://127.0.0.1:" + std::to_string(a) + ",127.0.0.1:" + std::to_string(b);
  o.retry_after = absl::Milliseconds(300);
  FakeClock clock;
  o.clock = &clock;
  auto t = *RemoteTier::Open(o);
  REQUIRE(t->Stats().cluster);
  const std::vector<std::string> keys = {"a", "b", "c"};
  const absl::Status s = t->RunLength(keys).status();
  REQUIRE(s.code() == absl::StatusCode::kUnavailable);
  REQUIRE(std::string(s.message()).find("slot map") != std::string::npos);  // every seed was asked
  REQUIRE(t->Stats().errors == 1);
  REQUIRE(t->Stats().slot_refreshes == 0);
  REQUIRE(t->Store({{"a", "1"}}).code() == absl::StatusCode::kUnavailable);  // skipped: no second attempt
  REQUIRE(t->Stats().skipped == 1);
  REQUIRE(t->Stats().errors == 1);
}

}  // namespace
}  // namespace kvd
