// A hostile Redis writer against real daemons: anyone who can write to the shared server can
// rewrite any value (keeping its digest, which it cannot forge) — flip its codec, shorten its
// payload with the lengths made to agree, drop its key id and write plaintext. No reader serves
// such a value (its worker checks every reused byte), none reads past a value, each is counted
// corrupt. Also: a Redis on a Unix socket (unix:// URLs) serves like one on TCP.
#include <hiredis/hiredis.h>

#include <fstream>
#include <functional>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "server/store/record_header.h"
#include "tests/integration/harness.h"
#include "tests/integration/remote_fixture.h"

namespace kvd {
namespace {

using namespace kvd::testing;

// Binary-safe GET and SET against `redis` (redis-cli's output is not).
class RawRedis {
 public:
  explicit RawRedis(const RedisServer& redis) : c_(redisConnect("127.0.0.1", redis.port())) {
    REQUIRE(c_ != nullptr);
    REQUIRE(c_->err == 0);
  }
  ~RawRedis() { redisFree(c_); }
  std::string Get(const std::string& key) {
    auto* r = static_cast<redisReply*>(redisCommand(c_, "GET %b", key.data(), key.size()));
    REQUIRE(r != nullptr);
    REQUIRE(r->type == REDIS_REPLY_STRING);
    std::string v(r->str, r->len);
    freeReplyObject(r);
    return v;
  }
  void Set(const std::string& key, const std::string& value) {
    auto* r = static_cast<redisReply*>(
        redisCommand(c_, "SET %b %b", key.data(), key.size(), value.data(), value.size()));
    REQUIRE(r != nullptr);
    REQUIRE(r->type == REDIS_REPLY_STATUS);
    freeReplyObject(r);
  }

 private:
  redisContext* c_;
};

// Rewrites every stored value as a writer who knows the format but not the secret or key would:
// `edit` changes the header and payload, then the stored length and checksum are made to agree.
void RewriteAll(const RedisServer& redis, const std::function<void(RecordHeader&, std::string&)>& edit) {
  RawRedis raw(redis);
  const std::vector<std::string> keys = redis.Keys();
  REQUIRE(!keys.empty());
  for (const std::string& k : keys) {
    const std::string value = raw.Get(k);
    absl::string_view in = value;
    absl::StatusOr<RecordHeader> h = DecodeRecordHeader(&in);
    REQUIRE(h.ok());
    std::string payload(in);
    edit(*h, payload);
    h->stored_length = static_cast<int64_t>(payload.size());
    h->checksum = Checksum(payload.data(), payload.size());
    std::string forged;
    EncodeRecordHeader(*h, &forged);
    raw.Set(k, forged + payload);
  }
}

// The digest a value names, without its key id or MAC.
std::string DigestOf(const std::string& object_key) { return object_key.substr(0, 64); }

std::string SecretConfig(const RedisServer& redis, const TempDir& dir, const std::string& name, bool encrypted) {
  std::ofstream(dir.path() + "/secret") << "cluster-secret\n";
  std::ofstream(dir.path() + "/keys") << "k1 " << std::string(64, 'a') << "\n";
  std::string c = absl::StrCat(Config(redis.url(), dir.path() + "/" + name), "  redis_secret_file: ", dir.path(),
                               "/secret\n");
  if (encrypted) absl::StrAppend(&c, "  redis_encryption_key_file: ", dir.path(), "/keys\n");
  return c;
}

// B, a node with an empty disk, reads the prompt A published and reuses nothing of it.
void NothingServed(const std::string& config) {
  DaemonProcess b(config);
  ProcessResult r = Work(b, "reader", 700, 41);  // REQUIREs every reused byte is right
  REQUIRE(JsonInt(r.out, "cached_tokens") == 0);
  REQUIRE(Metric(b, "kvd_remote_corrupt_total") >= 1);
  REQUIRE(Metric(b, "kvd_promotions_total{from=\"remote\"}") == 0);
}

TEST_CASE("A hostile Redis writer cannot make a node serve forged bytes or its own heap",
          "[integration][remote][hostile]") {
  RedisServer redis;
  TempDir dir;
  DaemonProcess a(SecretConfig(redis, dir, "a", /*encrypted=*/false));
  Work(a, "writer", 700, 41);
  WaitForMetric(a, kUploaded, 10);
  // Sanity: untouched, B reuses all ten blocks.
  {
    DaemonProcess b(SecretConfig(redis, dir, "b0", false));
    REQUIRE(JsonInt(Work(b, "reader", 700, 41).out, "cached_tokens") == 40);
  }
  SECTION("a payload shortened, its codec none, the lengths agreeing (a heap over-read before)") {
    RewriteAll(redis, [](RecordHeader& h, std::string& p) {
      h.codec = Codec::kNone;
      p.resize(p.size() / 4);
    });
    NothingServed(SecretConfig(redis, dir, "b1", false));
  }
  SECTION("forged bytes of the right length under the real digest") {
    RewriteAll(redis, [](RecordHeader& h, std::string& p) {
      h.codec = Codec::kNone;
      p.assign(static_cast<size_t>(h.raw_length), 'Z');
    });
    NothingServed(SecretConfig(redis, dir, "b2", false));
  }
  SECTION("the MAC dropped") {
    RewriteAll(redis, [](RecordHeader& h, std::string&) { h.object_key = DigestOf(h.object_key); });
    NothingServed(SecretConfig(redis, dir, "b3", false));
  }
}

TEST_CASE("With an encryption key, values stripped of their encryption or with a flipped codec are refused",
          "[integration][remote][hostile]") {
  RedisServer redis;
  TempDir dir;
  DaemonProcess a(SecretConfig(redis, dir, "a", /*encrypted=*/true));
  Work(a, "writer", 700, 41);
  WaitForMetric(a, kUploaded, 10);
  SECTION("the key id dropped, plaintext written under the real digest") {
    RewriteAll(redis, [](RecordHeader& h, std::string& p) {
      h.object_key = DigestOf(h.object_key);
      h.codec = Codec::kNone;
      p.assign(static_cast<size_t>(h.raw_length), 'Z');
    });
    NothingServed(SecretConfig(redis, dir, "b1", true));
  }
  SECTION("the codec byte flipped on the ciphertext") {
    RewriteAll(redis, [](RecordHeader& h, std::string&) { h.codec = h.codec == Codec::kNone ? Codec::kLz4 : Codec::kNone; });
    NothingServed(SecretConfig(redis, dir, "b2", true));
  }
}

TEST_CASE("A Redis on a Unix socket serves like one on TCP (unix:// URLs)", "[integration][remote]") {
  RedisServer redis(RedisServer::WithUnixSocket{});
  TempDir disks;
  DaemonProcess a(Config(redis.unix_url(), disks.path() + "/a"));
  Work(a, "a1", 300, 65);
  WaitForMetric(a, kUploaded, 16);
  DaemonProcess b(Config(redis.unix_url(), disks.path() + "/b"));
  REQUIRE(JsonInt(Work(b, "b1", 300, 65).out, "cached_tokens") == 64);
  REQUIRE(Metric(b, "kvd_promotions_total{from=\"remote\"}") == 16);
  REQUIRE(KvdctlStatus(b).find("(available)") != std::string::npos);
}

}  // namespace
}  // namespace kvd
