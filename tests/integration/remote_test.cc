// The shared Redis tier (G4) with a real redis-server on loopback, real daemons and real workers:
// two daemons with their own disks share a prefix through Redis (bytes verified by the reader);
// a daemon with an empty disk starts warm; corrupt values are never served; killing Redis keeps
// every daemon serving, and the tier comes back with the server.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/integration/harness.h"
#include "tests/integration/remote_fixture.h"
#include "tests/util/free_port.h"

namespace kvd {
namespace {

using namespace kvd::testing;

TEST_CASE("Two daemons share a prefix through Redis; a node with an empty disk starts warm",
          "[integration][remote]") {
  RedisServer redis;
  TempDir disks;
  DaemonProcess a(Config(redis.url(), disks.path() + "/a"));
  DaemonProcess b(Config(redis.url(), disks.path() + "/b"));

  // A computes a 65-token prompt (16 full blocks) and publishes it: uploaded write-through.
  REQUIRE(JsonInt(Work(a, "a1", 300, 65).out, "cached_tokens") == 0);
  WaitForMetric(a, kUploaded, 16);
  REQUIRE(redis.Keys().size() == 16);
  for (const std::string& k : redis.Keys()) REQUIRE(absl::StartsWith(k, "kvd:default:-:"));
  const int64_t ttl = std::stoll(redis.Cli({"TTL", redis.Keys()[0]}).out);
  REQUIRE(ttl > 0);

  // B never saw it: its lookup misses G1-G3 and fetches the run from Redis; the worker verifies
  // every byte A's worker wrote.
  ProcessResult rb = Work(b, "b1", 300, 65);
  REQUIRE(JsonInt(rb.out, "cached_tokens") == 64);
  REQUIRE(JsonInt(rb.out, "verified_bytes") == 64 * 2 * 16);
  REQUIRE(Metric(b, "kvd_promotions_total{from=\"remote\"}") == 16);
  REQUIRE(Metric(b, "kvd_remote_lookups_total") >= 1);
  // B publishing the same blocks again refreshes their TTL and sends no bytes.
  WaitForMetric(b, "kvd_remote_blocks_total{direction=\"refreshed\"}", 16);
  REQUIRE(Metric(b, kUploaded) == 0);

  // A longer prompt on B reuses the shared 16 blocks and adds its own; A then reads B's.
  REQUIRE(JsonInt(Work(b, "b2", 300, 97).out, "cached_tokens") == 64);
  WaitForMetric(b, kUploaded, 8);
  REQUIRE(JsonInt(Work(a, "a2", 300, 97).out, "cached_tokens") == 96);

  // kvdctl status shows the tier.
  const std::string status = KvdctlStatus(b);
  INFO(status);
  REQUIRE(status.find("redis tier") != std::string::npos);
  REQUIRE(status.find(redis.url() + " (available)") != std::string::npos);

  // A restarted node with an empty disk reuses it all.
  DaemonProcess c(Config(redis.url(), disks.path() + "/c"));
  REQUIRE(JsonInt(Work(c, "c1", 300, 97).out, "cached_tokens") == 96);

  // A different tenant salt never sees these blocks.
  ProcessResult salted = RunWorker({"--target", c.target(), "--id", "c2", "--prompt-range", "300:97",
                                    "--salt", "tenant-b"});
  INFO(salted.out);
  REQUIRE(salted.exit_code == 0);
  REQUIRE(JsonInt(salted.out, "cached_tokens") == 0);
  WaitForMetric(c, kUploaded, 24);
  bool salted_key = false;
  for (const std::string& k : redis.Keys()) salted_key |= !absl::StartsWith(k, "kvd:default:-:");
  REQUIRE(salted_key);  // the tenant's blocks live under its own salt tag
}

TEST_CASE("Daemons whose pools declare other model fingerprints share nothing through Redis", "[integration][remote]") {
  RedisServer redis;
  TempDir disks;
  // One pool name and shape on every node; the weights differ.
  const auto config = [&](const std::string& disk, const std::string& fingerprint) {
    const std::string pool = fingerprint.empty() ? "" : "    model_fingerprint: " + fingerprint + "\n";
    return absl::StrCat(SmallPoolConfig(64, pool), "tiers:\n  disk_dir: ", disks.path(), "/", disk,
                        "\n  codec: lz4\n  redis_url: ", redis.url(), "\n  redis_retry_after_s: 0.2\n");
  };
  DaemonProcess a(config("a", "llama-3.1-8b@v1"));
  DaemonProcess b(config("b", "llama-3.1-8b@v2"));

  REQUIRE(JsonInt(Work(a, "a1", 300, 65).out, "cached_tokens") == 0);
  WaitForMetric(a, kUploaded, 16);
  REQUIRE(redis.Keys().size() == 16);
  for (const std::string& k : redis.Keys()) REQUIRE(absl::StartsWith(k, "kvd:default@"));

  // B finds none of A's blocks, and stores its own beside them instead of renewing A's.
  REQUIRE(JsonInt(Work(b, "b1", 300, 65).out, "cached_tokens") == 0);
  REQUIRE(Metric(b, "kvd_promotions_total{from=\"remote\"}") == 0);
  WaitForMetric(b, kUploaded, 16);
  REQUIRE(Metric(b, "kvd_remote_blocks_total{direction=\"refreshed\"}") == 0);
  REQUIRE(redis.Keys().size() == 32);

  // A node of A's weights shares A's blocks; a node that declares no fingerprint shares neither's.
  DaemonProcess c(config("c", "llama-3.1-8b@v1"));
  REQUIRE(JsonInt(Work(c, "c1", 300, 65).out, "cached_tokens") == 64);
  DaemonProcess d(config("d", ""));
  REQUIRE(JsonInt(Work(d, "d1", 300, 65).out, "cached_tokens") == 0);
}

TEST_CASE("Corrupt Redis values are never served", "[integration][remote]") {
  RedisServer redis;
  TempDir disks;
  DaemonProcess a(Config(redis.url(), disks.path() + "/a"));
  Work(a, "a1", 500, 33);
  WaitForMetric(a, kUploaded, 8);
  // Flip the last byte of every stored value (the block bytes, under the checksum).
  for (const std::string& k : redis.Keys()) {
    const int64_t len = std::stoll(redis.Cli({"STRLEN", k}).out);
    REQUIRE(redis.Cli({"SETRANGE", k, std::to_string(len - 1), "\x01"}).exit_code == 0);
  }
  DaemonProcess b(Config(redis.url(), disks.path() + "/b"));
  REQUIRE(JsonInt(Work(b, "b1", 500, 33).out, "cached_tokens") == 0);
  REQUIRE(Metric(b, "kvd_remote_corrupt_total") >= 1);
  REQUIRE(Metric(b, "kvd_promotions_total{from=\"remote\"}") == 0);
}

TEST_CASE("Killing Redis mid-run keeps every daemon serving; the tier returns with the server",
          "[integration][remote]") {
  RedisServer redis;
  TempDir disks;
  DaemonProcess a(Config(redis.url(), disks.path() + "/a"));
  DaemonProcess b(Config(redis.url(), disks.path() + "/b"));
  Work(a, "a1", 700, 41);
  WaitForMetric(a, kUploaded, 10);

  redis.Kill();
  // Both daemons keep answering: A still hits its own G1 copy, B computes what Redis would have
  // given it, new prompts work on both.
  REQUIRE(JsonInt(Work(a, "a2", 700, 41).out, "cached_tokens") == 40);
  REQUIRE(JsonInt(Work(b, "b1", 700, 41).out, "cached_tokens") == 0);
  for (int i = 0; i < 5; ++i) {
    Work(a, absl::StrCat("a-new-", i), 2000 + 100 * i, 41);
    Work(b, absl::StrCat("b-new-", i), 3000 + 100 * i, 41);
  }
  REQUIRE(Metric(b, "kvd_remote_errors_total") >= 1);
  REQUIRE(KvdctlStatus(b).find("last: ") != std::string::npos);  // the last error is named
  // What the alert reads: every call since the kill failed or was skipped, which the
  // availability gauge (1 between back-offs) cannot show; kvdctl says FAILING, not available.
  const int64_t calls = Metric(b, "kvd_remote_calls_total");
  const int64_t failed = Metric(b, "kvd_remote_errors_total") + Metric(b, "kvd_remote_skipped_total");
  REQUIRE(calls >= failed);
  REQUIRE(failed >= 1);
  Work(b, "b-during", 4000, 41);
  REQUIRE(Metric(b, "kvd_remote_calls_total") > calls);
  REQUIRE(Metric(b, "kvd_remote_errors_total") + Metric(b, "kvd_remote_skipped_total") -
              failed == Metric(b, "kvd_remote_calls_total") - calls);
  const std::string down = KvdctlStatus(b);
  REQUIRE((down.find("(FAILING: its last call failed)") != std::string::npos ||
           down.find("(SKIPPED after a failure)") != std::string::npos));
  REQUIRE(down.find(" (available)") == std::string::npos);
  REQUIRE(Metric(a, "kvd_remote_errors_total") + Metric(a, "kvd_remote_skipped_total") +
              Metric(a, "kvd_remote_blocks_total{direction=\"upload_dropped\"}") >= 1);

  // The server comes back (empty): after the back-off, uploads and lookups resume.
  redis.Start();
  WaitForMetric(a, "kvd_remote_available", 1);  // the back-off is over: the next call tries again
  WaitForMetric(b, "kvd_remote_available", 1);
  const int64_t before = Metric(a, kUploaded);
  Work(a, "a3", 5000, 41);
  WaitForMetric(a, kUploaded, before + 10);
  REQUIRE(JsonInt(Work(b, "b2", 5000, 41).out, "cached_tokens") == 40);
  REQUIRE(Metric(b, "kvd_remote_available") == 1);
  REQUIRE(KvdctlStatus(b).find(" (available)") != std::string::npos);  // its last call succeeded
}

// A value in the shared Redis reveals nothing of the tenant: no salt, adapter or token sequence
// in clear (a keyed digest verifies them); a node with the cluster's secret is served, one
// without it is not.
TEST_CASE("Redis values carry no salt, adapter or tokens in clear", "[integration][remote]") {
  RedisServer redis;
  TempDir dir;
  std::ofstream(dir.path() + "/secret") << "cluster-secret-0123456789\n";
  std::ofstream(dir.path() + "/other") << "another-secret\n";
  const auto config = [&](const std::string& disk, const std::string& secret) {
    return absl::StrCat(Config(redis.url(), dir.path() + "/" + disk), "  redis_secret_file: ", dir.path(), "/", secret, "\n");
  };
  DaemonProcess a(config("a", "secret"));
  DaemonProcess b(config("b", "secret"));
  DaemonProcess c(config("c", "other"));
  const std::string salt = "tenant-salt-SECRET-7f3a";
  const std::string adapter = "adapter-acme-finance";
  ProcessResult w = RunWorker({"--target", a.target(), "--id", "t1", "--prompt-range", "4242:41", "--salt", salt,
                               "--adapter", adapter});
  REQUIRE(w.exit_code == 0);
  WaitForMetric(a, kUploaded, 10);
  // Every byte Redis holds for kvd: keys and values.
  std::string everything;
  for (const std::string& key : redis.Keys()) {
    everything += key;
    everything += redis.Cli({"--no-raw", "GET", key}).out;  // escaped bytes: \xNN for the binary ones
    everything += redis.Cli({"GET", key}).out;
  }
  REQUIRE(!redis.Keys().empty());
  REQUIRE(everything.find(salt) == std::string::npos);
  REQUIRE(everything.find(adapter) == std::string::npos);
  // No run of the prompt's tokens, as the u32 little-endian words a header would hold them in.
  std::string words;
  for (uint32_t t = 4242; t < 4242 + 4; ++t) {
    for (int b = 0; b < 4; ++b) words.push_back(static_cast<char>((t >> (8 * b)) & 0xff));
  }
  REQUIRE(everything.find(words) == std::string::npos);
  // The node with the cluster's secret is served every byte; one with another secret is not.
  ProcessResult hit = RunWorker({"--target", b.target(), "--id", "t2", "--prompt-range", "4242:41", "--salt", salt,
                                 "--adapter", adapter});
  INFO(hit.out);
  REQUIRE(JsonInt(hit.out, "cached_tokens") == 40);
  REQUIRE(JsonInt(hit.out, "mismatches") == 0);
  ProcessResult other = RunWorker({"--target", c.target(), "--id", "t3", "--prompt-range", "4242:41", "--salt", salt,
                                   "--adapter", adapter});
  REQUIRE(JsonInt(other.out, "cached_tokens") == 0);
  REQUIRE(Metric(c, "kvd_remote_corrupt_total") >= 1);
  // And the same prompt without the salt (another tenant) finds nothing on b either.
  REQUIRE(JsonInt(RunWorker({"--target", b.target(), "--id", "t4", "--prompt-range", "4242:41", "--adapter", adapter}).out,
                  "cached_tokens") == 0);
}

// With tiers.redis_encryption_key_file the KV bytes in Redis are AES-256-GCM ciphertext: no window
// of the plaintext value another (unencrypted) daemon stored for the same prompt appears in them.
// Keys rotate: a node whose file seals with a new key and still holds the old one opens the old
// values; a node without the old key is not served them.
TEST_CASE("Encrypted Redis values hold no KV plaintext, and keys rotate", "[integration][remote]") {
  RedisServer redis;
  TempDir dir;
  std::ofstream(dir.path() + "/secret") << "cluster-secret\n";
  const std::string k1 = "k1 " + std::string(64, 'a');
  const std::string k2 = "k2 " + std::string(64, 'b');
  std::ofstream(dir.path() + "/keys-a") << "# sealing key first\n" << k1 << "\n";
  std::ofstream(dir.path() + "/keys-b") << k2 << "\n" << k1 << "\n";
  std::ofstream(dir.path() + "/keys-c") << k2 << "\n";
  const auto config = [&](const std::string& name, const std::string& prefix, const std::string& keys) {
    std::string c = absl::StrCat(Config(redis.url(), dir.path() + "/" + name), "  redis_secret_file: ", dir.path(),
                                 "/secret\n  redis_key_prefix: ", prefix, "\n");
    if (!keys.empty()) absl::StrAppend(&c, "  redis_encryption_key_file: ", dir.path(), "/", keys, "\n");
    return c;
  };
  DaemonProcess a(config("a", "enc", "keys-a"));
  DaemonProcess plain(config("p", "plain", ""));
  Work(a, "e1", 9000, 41);
  Work(plain, "p1", 9000, 41);
  WaitForMetric(a, kUploaded, 10);
  WaitForMetric(plain, kUploaded, 10);
  const auto values = [&](const std::string& prefix) {
    std::vector<std::string> out;
    for (absl::string_view k : absl::StrSplit(redis.Cli({"--scan", "--pattern", prefix + ":*"}).out, '\n', absl::SkipEmpty())) {
      out.push_back(redis.Cli({"GET", std::string(k)}).out);
    }
    return out;
  };
  const std::vector<std::string> enc = values("enc");
  const std::vector<std::string> clear = values("plain");
  REQUIRE(enc.size() == clear.size());
  REQUIRE(!enc.empty());
  int windows = 0;
  for (const std::string& v : clear) {
    // 48-byte windows from the stored KV (the tail of each value, past its header).
    for (size_t at = v.size() / 2; at + 48 <= v.size() && at < v.size() / 2 + 480; at += 48, ++windows) {
      const std::string w = v.substr(at, 48);
      for (const std::string& e : enc) REQUIRE(e.find(w) == std::string::npos);
    }
  }
  REQUIRE(windows > 10);
  // Rotation: b seals with k2 and still opens k1; c has only k2.
  DaemonProcess b(config("b", "enc", "keys-b"));
  DaemonProcess c(config("c", "enc", "keys-c"));
  ProcessResult hit = Work(b, "e2", 9000, 41);
  REQUIRE(JsonInt(hit.out, "cached_tokens") == 40);
  REQUIRE(JsonInt(Work(c, "e3", 9000, 41).out, "cached_tokens") == 0);
  REQUIRE(Metric(c, "kvd_remote_corrupt_total") >= 1);
  REQUIRE(c.Log().find("unknown key id") != std::string::npos);
  REQUIRE(c.Log().find(std::string(64, 'b')) == std::string::npos);  // key bytes are never logged
}

// An operator's Redis that fills up: maxmemory small, noeviction (Redis's default policy). Uploads
// that do not fit are refused with OOM: counted apart, skipped, and without the failure back-off,
// so lookups and fetches of what is there go on; kvd names the policy in its log and status.
TEST_CASE("A full Redis under noeviction refuses uploads; lookups and fetches go on", "[integration][remote]") {
  RedisServer redis;
  TempDir disks;
  REQUIRE(redis.Cli({"CONFIG", "SET", "maxmemory-policy", "noeviction"}).exit_code == 0);
  DaemonProcess a(Config(redis.url(), disks.path() + "/a"));
  DaemonProcess b(Config(redis.url(), disks.path() + "/b"));
  Work(a, "a1", 700, 41);
  WaitForMetric(a, kUploaded, 10);
  const std::string status = KvdctlStatus(a);
  REQUIRE(status.find("policy noeviction") != std::string::npos);
  REQUIRE(a.Log().find("maxmemory-policy noeviction") != std::string::npos);  // warned once, at connect
  // Now fill it: maxmemory just above what it holds, so the next uploads do not fit.
  const std::string used = redis.Cli({"INFO", "memory"}).out;
  const size_t at = used.find("used_memory:");
  REQUIRE(at != std::string::npos);
  const int64_t bytes = std::stoll(used.substr(at + 12));
  REQUIRE(redis.Cli({"CONFIG", "SET", "maxmemory", std::to_string(bytes + 4096)}).exit_code == 0);
  // New prompts until Redis has refused one (uploads are asynchronous, and slow under sanitizers).
  for (int i = 0; i < 40 && Metric(a, "kvd_remote_oom_refusals_total") < 1; ++i) {
    Work(a, absl::StrCat("a-big-", i), 10000 + 1000 * i, 41);
    for (int k = 0; k < 50 && Metric(a, "kvd_remote_oom_refusals_total") < 1; ++k) absl::SleepFor(absl::Milliseconds(20));
  }
  REQUIRE(Metric(a, "kvd_remote_oom_refusals_total") >= 1);
  REQUIRE(a.Log().find("Redis is full and refuses new values") != std::string::npos);
  // OOM is not an outage: no back-off, the tier stays in use, and another node still fetches
  // the prefix that was uploaded before it filled, byte for byte.
  REQUIRE(Metric(a, "kvd_remote_available") == 1);
  REQUIRE(JsonInt(Work(b, "b1", 700, 41).out, "cached_tokens") == 40);
  REQUIRE(Metric(b, "kvd_remote_errors_total") == 0);
  REQUIRE(KvdctlStatus(a).find("values refused for want of memory") != std::string::npos);
}

}  // namespace
}  // namespace kvd
