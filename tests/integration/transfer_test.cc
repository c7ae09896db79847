// Peer transfer (docs/transfer.md) of single-group pools: two real kvd daemons on loopback, each
// with its own worker clients; the Peer service under mutual TLS with certificates the test makes
// (openssl). Node A prefills, node B pulls over that channel, and every pulled byte is compared
// with what A's worker wrote. Then what goes wrong: a peer not configured, an unauthenticated
// caller, reads of leases that are not the caller's, certificates whose names only look allowed,
// pins against eviction, leases that expire, a hostile peer (a proxy in this process that
// corrupts A's real offers and reads), a peer stopped while others serve, and one killed in the
// middle of a pull. Hybrid pools: transfer_hybrid_test.cc. The two-namespace test with the
// reference engine is tests/transfer/netns_pull.py.
#include <csignal>
#include <fstream>
#include <map>
#include <thread>

#include <catch2/catch.hpp>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "kvd/peer/v1/peer.grpc.pb.h"
#include "tests/integration/harness.h"
#include "tests/integration/transfer_fixture.h"
#include "tests/util/free_port.h"

namespace kvd {
namespace {

using namespace kvd::testing;
using client::Client;

TEST_CASE("A kvd pulls a peer's cached prefix over mutual TLS, verified, and serves it as its own", "[integration][transfer]") {
  Certs certs;
  if (!certs.ok) {
    WARN("skipped: openssl could not generate test certificates");
    return;
  }
  DaemonProcess a(NodeConfig(certs, "node-a", {}, "node-b"));
  REQUIRE(!a.transfer_address().empty());
  DaemonProcess b(NodeConfig(certs, "node-b", {{"node-a", a.transfer_address()}}));
  auto wa = Connect(a, "prefill");
  auto wb = Connect(b, "decode");
  Prefill(*wa, "p1", 1, 8);

  // B had nothing: all 8 blocks come from A, bit-exact, and count as a hit.
  auto [cached, exact] = PullStart(*wb, "d1", 1, 8, "node-a");
  CHECK(cached == 8 * kBlockTokens);
  CHECK(exact);
  CHECK(Metric(b, "kvd_peer_pulled_blocks_total") == 8);
  CHECK(Metric(b, "kvd_peer_pulls_total{outcome=\"pulled\"}") == 1);
  CHECK(Metric(a, "kvd_peer_offered_blocks_total") == 8);
  CHECK(LeasesSettled(a) == 0);  // released once read
  // Published on B: a later request hits locally, no peer named.
  CHECK(Cached(*wb, 1, 8) == 8 * kBlockTokens);
  auto [again, again_exact] = PullStart(*wb, "d2", 1, 8, "");
  CHECK(again == 8 * kBlockTokens);
  CHECK(again_exact);

  // B holds the first 3 blocks of another prompt itself: only the 5 after them are pulled.
  Prefill(*wa, "p2", 2, 8);
  Prefill(*wb, "b2", 2, 3);
  auto [cached2, exact2] = PullStart(*wb, "d3", 2, 8, "node-a");
  CHECK(cached2 == 8 * kBlockTokens);
  CHECK(exact2);
  CHECK(Metric(b, "kvd_peer_pulled_blocks_total") == 8 + 5);

  // A peer without the prompt: nothing to pull, the request computes as after a miss.
  auto [cold, cold_exact] = PullStart(*wb, "d4", 3, 8, "node-a");
  CHECK(cold == 0);
  CHECK(Metric(b, "kvd_peer_pulls_total{outcome=\"nothing\"}") == 1);

  // Both ways: A pulls from B what only B computed.
  DaemonProcess a2(NodeConfig(certs, "node-a", {{"node-b", b.transfer_address()}}));
  auto wa2 = Connect(a2, "decode-a");
  Prefill(*wb, "b4", 4, 6);
  auto [back, back_exact] = PullStart(*wa2, "a4", 4, 6, "node-b");
  CHECK(back == 6 * kBlockTokens);
  CHECK(back_exact);
}

TEST_CASE("Nodes whose pools share a name and shape but not their weights pull nothing from each other, and say why",
          "[integration][transfer]") {
  Certs certs;
  if (!certs.ok) {
    WARN("skipped: openssl could not generate test certificates");
    return;
  }
  const auto with_model = [](std::string yaml, const std::string& fingerprint) {
    const std::string at = "    max_model_len: 20000\n";
    return yaml.replace(yaml.find(at), at.size(), at + "    model_fingerprint: " + fingerprint + "\n");
  };
  DaemonProcess a(with_model(NodeConfig(certs, "node-a", {}, "node-b"), "llama-3.1-8b@v1"));
  DaemonProcess b(with_model(NodeConfig(certs, "node-b", {{"node-a", a.transfer_address()}}), "llama-3.1-8b@v2"));
  auto wa = Connect(a, "prefill");
  auto wb = Connect(b, "decode");
  Prefill(*wa, "p1", 1, 8);
  auto [cached, exact] = PullStart(*wb, "d1", 1, 8, "node-a");
  CHECK(cached == 0);  // computed, as after a miss
  CHECK(Metric(b, "kvd_peer_pulls_total{outcome=\"geometry\"}") == 1);
  CHECK(Metric(b, "kvd_peer_pulled_blocks_total") == 0);
  CHECK(Cached(*wb, 1, 8) == 0);
  for (int i = 0; i < 100 && Metric(a, "kvd_peer_leases") != 0; ++i) absl::SleepFor(absl::Milliseconds(20));
  CHECK(LeasesSettled(a) == 0);  // the offer was given back
  const std::string log = b.Log();
  INFO(log);
  CHECK(log.find("failed (geometry): FAILED_PRECONDITION: the peer\\'s pool differs in model_fingerprint: "
                 "\\'llama-3.1-8b@v1\\' there, \\'llama-3.1-8b@v2\\' here") != std::string::npos);  // quotes escaped in logs
}

TEST_CASE("Eight pulls at once, each exact", "[integration][transfer]") {
  Certs certs;
  if (!certs.ok) return;
  DaemonProcess a(NodeConfig(certs, "node-a", {}, "node-b"));
  DaemonProcess b(NodeConfig(certs, "node-b", {{"node-a", a.transfer_address()}}));
  auto wa = Connect(a, "prefill");
  for (uint32_t s = 10; s < 18; ++s) Prefill(*wa, absl::StrCat("p", s), s, 6);
  std::vector<std::unique_ptr<Client>> workers;
  for (int i = 0; i < 8; ++i) workers.push_back(Connect(b, absl::StrCat("decode", i)));
  std::vector<std::pair<int64_t, bool>> got(8);
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      auto r = workers[i]->Start(PoolRequest(absl::StrCat("d", i), Prompt(10 + i, 6), 1), absl::Seconds(30), "node-a");
      if (!r.ok()) return;
      got[i] = {(*r)->cached_tokens(), BlocksExact(*workers[i], **r, (*r)->cached_tokens() / kBlockTokens, 10 + i)};
      (void)(*r)->Release(true);
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 8; ++i) {
    CHECK(got[i].first == 6 * kBlockTokens);
    CHECK(got[i].second);
  }
  CHECK(Metric(b, "kvd_peer_pulled_blocks_total") == 8 * 6);
  CHECK(LeasesSettled(a) == 0);
}

TEST_CASE("A peer hint kvd cannot follow is refused before anything is admitted", "[integration][transfer]") {
  Certs certs;
  if (!certs.ok) return;
  DaemonProcess b(NodeConfig(certs, "node-b", {{"node-a", "127.0.0.1:1"}}));
  auto wb = Connect(b, "decode");
  auto r = wb->Start(PoolRequest("x", Prompt(1, 2), 1), absl::Seconds(5), "node-z");
  REQUIRE(!r.ok());
  CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(r.status().message()).find("'node-z' is not configured (transfer.peers: node-a)") != std::string::npos);
  auto handles = wb->ListHandles();
  REQUIRE(handles.ok());
  CHECK(handles->empty());
  // A peer that cannot be reached: the request is served as after a miss, and answers in time.
  auto unreachable = wb->Start(PoolRequest("y", Prompt(1, 2), 1), absl::Seconds(5), "node-a");
  REQUIRE(unreachable.ok());
  CHECK((*unreachable)->cached_tokens() == 0);
  CHECK(Metric(b, "kvd_peer_pulls_total{outcome=\"offer\"}") == 1);

  DaemonProcess plain(SmallPoolConfig());
  auto wp = Connect(plain, "w");
  auto p = wp->Start(PoolRequest("z", Range(1, 9)), absl::Seconds(5), "node-a");
  REQUIRE(!p.ok());
  CHECK(p.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(p.status().message()).find("no transfer section") != std::string::npos);

  // Operator typos in the section are named at startup.
  TempDir dir;
  std::ofstream(dir.path() + "/bad.yaml") << NodeConfig(certs, "node-b", {{"node-a", "no-port"}});
  ProcessResult bad = RunProcess(KvdBinary(), {"--config=" + dir.path() + "/bad.yaml", "--print-config"});
  CHECK(bad.exit_code != 0);
  CHECK(bad.out.find("peer 'node-a' needs an address HOST:PORT, not 'no-port'") != std::string::npos);
}

TEST_CASE("Only authenticated, allowed peers get offers", "[integration][transfer]") {
  Certs certs;
  if (!certs.ok) return;
  DaemonProcess a(NodeConfig(certs, "node-a", {}, "node-b"));
  auto wa = Connect(a, "prefill");
  Prefill(*wa, "p", 1, 4);
  // Signed by the CA, but not a name A allows.
  peer::v1::OfferResponse resp;
  grpc::Status s = Offer(*PeerStub(certs, a, "node-a", "stranger"), 1, 4, 1000, &resp);
  CHECK(s.error_code() == grpc::StatusCode::PERMISSION_DENIED);
  CHECK(s.error_message().find("names stranger") != std::string::npos);
  CHECK(resp.blocks().empty());
  // No client certificate: the TLS handshake itself fails.
  peer::v1::OfferResponse none;
  CHECK(!Offer(*PeerStub(certs, a, "node-a", ""), 1, 4, 1000, &none).ok());
  CHECK(none.checksums().empty());
  // Plain text on the peer port gets nothing either.
  auto plain = peer::v1::Peer::NewStub(grpc::CreateChannel(a.transfer_address(), grpc::InsecureChannelCredentials()));
  peer::v1::OfferResponse plain_resp;
  CHECK(!Offer(*plain, 1, 4, 1000, &plain_resp).ok());
  CHECK(LeasesSettled(a) == 0);
  CHECK(Metric(a, "kvd_peer_offers_total{outcome=\"unauthenticated\"}") == 1);

  // A kvd whose certificate A does not allow pulls nothing; its request computes.
  DaemonProcess c(NodeConfig(certs, "stranger", {{"node-a", a.transfer_address()}}));
  auto wc = Connect(c, "decode");
  auto [cached, exact] = PullStart(*wc, "d", 1, 4, "node-a");
  CHECK(cached == 0);
  CHECK(Cached(*wc, 1, 4) == 0);
  CHECK(Metric(c, "kvd_peer_pulls_total{outcome=\"offer\"}") == 1);
  // The allowed peer gets the offer; bad arguments are named.
  auto b = PeerStub(certs, a, "node-a", "node-b");
  peer::v1::OfferResponse bad;
  grpc::Status lease = Offer(*b, 1, 4, 0, &bad);
  CHECK(lease.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(lease.error_message().find("lease_ms must be in (0, 60000], not 0") != std::string::npos);
  peer::v1::OfferResponse good;
  REQUIRE(Offer(*b, 1, 4, 60'000, &good).ok());
  CHECK(good.blocks_size() == 4);
  CHECK(good.checksums_size() == 4);
  // Another peer cannot release it.
  CHECK(Release(*PeerStub(certs, a, "node-a", "stranger"), good.lease()) == grpc::StatusCode::PERMISSION_DENIED);
  CHECK(Metric(a, "kvd_peer_leases") == 1);
}

TEST_CASE("A peer reads the blocks it was offered, while its lease holds, and nothing else", "[integration][transfer]") {
  Certs certs;
  if (!certs.ok) return;
  DaemonProcess a(NodeConfig(certs, "node-a", {}, "node-b, evil"));
  auto wa = Connect(a, "prefill");
  Prefill(*wa, "p", 1, 4);
  Prefill(*wa, "secret", 7, 4);  // cached, never offered to anyone
  auto b = PeerStub(certs, a, "node-a", "node-b");
  auto evil = PeerStub(certs, a, "node-a", "evil");
  peer::v1::OfferResponse offer;
  REQUIRE(Offer(*b, 1, 4, 60'000, &offer).ok());
  REQUIRE(offer.checksums_size() == 4);

  // The lease's own peer reads its blocks: exactly the bytes the checksums name.
  peer::v1::ReadResponse data;
  REQUIRE(Read(*b, offer.lease(), 1, 3, &data).ok());
  REQUIRE(data.blocks_size() == 3);
  CHECK(data.blocks(0).size() == 2 * kBlockTokens * 64);
  // Another allowed peer, a caller nobody allowed, leases never given, reads past the lease: nothing.
  const std::vector<std::pair<grpc::Status, grpc::StatusCode>> refused = {
      {Read(*evil, offer.lease(), 0, 4, &data), grpc::StatusCode::NOT_FOUND},
      {Read(*PeerStub(certs, a, "node-a", "stranger"), offer.lease(), 0, 4, &data), grpc::StatusCode::PERMISSION_DENIED},
      {Read(*b, offer.lease() + 1, 0, 1, &data), grpc::StatusCode::NOT_FOUND},
      {Read(*b, 0, 0, 1, &data), grpc::StatusCode::NOT_FOUND},
      {Read(*b, offer.lease(), 4, 1, &data), grpc::StatusCode::OUT_OF_RANGE},
      {Read(*b, offer.lease(), -1, 1, &data), grpc::StatusCode::OUT_OF_RANGE},
      {Read(*b, offer.lease(), 0, 0, &data), grpc::StatusCode::OUT_OF_RANGE}};
  for (const auto& [status, code] : refused) {
    INFO(status.error_message());
    CHECK(status.error_code() == code);
  }
  CHECK(!Read(*PeerStub(certs, a, "node-a", ""), offer.lease(), 0, 4, &data).ok());  // no certificate
  // Released: the lease reads nothing more.
  REQUIRE(Release(*b, offer.lease()) == grpc::StatusCode::OK);
  CHECK(Read(*b, offer.lease(), 0, 1, &data).error_code() == grpc::StatusCode::NOT_FOUND);
  // An expired lease neither.
  peer::v1::OfferResponse brief;
  REQUIRE(Offer(*b, 1, 4, 200, &brief).ok());
  absl::SleepFor(absl::Milliseconds(400));
  CHECK(Read(*b, brief.lease(), 0, 1, &data).error_code() == grpc::StatusCode::NOT_FOUND);
  CHECK(Metric(a, "kvd_peer_reads_total{outcome=\"NOT_FOUND\"}") >= 5);
  // A listens for peers on its transfer address alone: nothing else of it is reachable over the
  // network, and no peer call writes anything. Both prompts are still as A's worker wrote them.
  for (uint32_t seed : {1u, 7u}) {
    auto r = wa->Start(PoolRequest(absl::StrCat("check", seed), Prompt(seed, 4), 1));
    REQUIRE(r.ok());
    CHECK((*r)->cached_tokens() == 4 * kBlockTokens);
    CHECK(BlocksExact(*wa, **r, 4, seed));
    REQUIRE((*r)->Release(true).ok());
  }
}

TEST_CASE("The allow-list matches DNS names, the CN only without them, URIs only as configured", "[integration][transfer]") {
  Certs certs;
  if (!certs.ok) return;
  DaemonProcess a(NodeConfig(certs, "node-a", {}, "node-b, \"uri:spiffe://example.org/node-b\""));
  auto wa = Connect(a, "prefill");
  Prefill(*wa, "p", 1, 2);
  const std::map<std::string, bool> allowed = {
      {"cn-uri", false},     {"cn-email", false}, {"cn-ip", false},    {"cn-dns-other", false}, {"uri-named", false},
      {"email-named", false}, {"cn-only", true},   {"dns-named", true}, {"spiffe", true}};
  for (const auto& [stem, want] : allowed) {
    INFO(stem);
    peer::v1::OfferResponse resp;
    grpc::Status s = Offer(*PeerStub(certs, a, "node-a", stem), 1, 2, 1000, &resp);
    CHECK(s.ok() == want);
    if (!want) CHECK(s.error_code() == grpc::StatusCode::PERMISSION_DENIED);
    if (want && s.ok()) CHECK(resp.checksums_size() == 2);
  }
}

TEST_CASE("Offered blocks stay pinned against eviction until released or expired", "[integration][transfer]") {
  Certs certs;
  if (!certs.ok) return;
  DaemonProcess a(NodeConfig(certs, "node-a", {}, "node-b"));
  auto wa = Connect(a, "prefill");
  Prefill(*wa, "p", 1, 4);
  auto b = PeerStub(certs, a, "node-a", "node-b");
  peer::v1::OfferResponse offer;
  REQUIRE(Offer(*b, 1, 4, 60'000, &offer).ok());
  REQUIRE(offer.blocks_size() == 4);
  // The operator clears the cache: the pinned blocks stay (a reader may be mid-get).
  REQUIRE(wa->Gc().ok());
  CHECK(Cached(*wa, 1, 4) == 4 * kBlockTokens);
  REQUIRE(Release(*b, offer.lease()) == grpc::StatusCode::OK);
  CHECK(Release(*b, offer.lease()) == grpc::StatusCode::NOT_FOUND);  // twice: nothing unpinned twice
  REQUIRE(wa->Gc().ok());
  CHECK(Cached(*wa, 1, 4) == 0);

  // A puller that never releases: the lease (3 s, held past the count below on a loaded machine)
  // expires and the blocks can go.
  Prefill(*wa, "p2", 2, 4);
  peer::v1::OfferResponse forgotten;
  REQUIRE(Offer(*b, 2, 4, 3000, &forgotten).ok());
  CHECK(Metric(a, "kvd_peer_leases") == 1);
  absl::SleepFor(absl::Milliseconds(3100));
  CHECK(LeasesSettled(a) == 0);
  REQUIRE(wa->Gc().ok());
  CHECK(Cached(*wa, 2, 4) == 0);
}

TEST_CASE("A hostile peer's offers and reads are bounds-checked and verified: nothing is cached, nothing else written",
          "[integration][transfer]") {
  Certs certs;
  if (!certs.ok) return;
  DaemonProcess a(NodeConfig(certs, "node-a", {}, "node-b"));
  auto wa = Connect(a, "prefill");
  HostilePeer hostile(PeerStub(certs, a, "node-a", "node-b"));
  std::string evil;
  std::unique_ptr<grpc::Server> server = ServePeer(certs, "evil", &hostile, &evil);
  DaemonProcess b(NodeConfig(certs, "node-b", {{"node-a", a.transfer_address()}, {"evil", evil}}));
  auto wb = Connect(b, "decode");
  // A canary B computed itself, next to whatever the pulls write.
  Prefill(*wb, "canary", 99, 8);

  const std::vector<std::pair<HostilePeer::Mode, std::string>> modes = {
      {HostilePeer::kGeometry, "geometry"}, {HostilePeer::kLayout, "geometry"},   {HostilePeer::kCount, "bounds"},
      {HostilePeer::kShortBlock, "bounds"}, {HostilePeer::kLongBlock, "bounds"},  {HostilePeer::kExtraBlock, "bounds"},
      {HostilePeer::kNoBlock, "bounds"},    {HostilePeer::kChecksum, "checksum"}, {HostilePeer::kFlipByte, "checksum"},
      {HostilePeer::kSwap, "checksum"}};
  uint32_t seed = 1;
  for (const auto& [mode, cause] : modes) {
    INFO("mode " << mode);
    Prefill(*wa, absl::StrCat("p", seed), seed, 4);
    hostile.mode = mode;
    auto [cached, exact] = PullStart(*wb, absl::StrCat("d", seed), seed, 4, "evil");
    CHECK(cached == 0);
    CHECK(Cached(*wb, seed, 4) == 0);  // nothing partial cached
    ++seed;
  }
  CHECK(Metric(b, "kvd_peer_pulls_total{outcome=\"geometry\"}") == 2);
  CHECK(Metric(b, "kvd_peer_pulls_total{outcome=\"bounds\"}") == 5);
  CHECK(Metric(b, "kvd_peer_pulls_total{outcome=\"checksum\"}") == 3);
  CHECK(Metric(b, "kvd_peer_pulled_blocks_total") == 0);
  CHECK(b.Log().find("differs in bytes_per_token_per_layer: 128 there, 64 here") != std::string::npos);
  CHECK(b.Log().find("fails its checksum") != std::string::npos);
  // Every lease went back to A, and B's own blocks are as its worker wrote them.
  CHECK(LeasesSettled(a) == 0);
  auto canary = wb->Start(PoolRequest("canary2", Prompt(99, 8), 1));
  REQUIRE(canary.ok());
  CHECK((*canary)->cached_tokens() == 8 * kBlockTokens);
  CHECK(BlocksExact(*wb, **canary, 8, 99));
  REQUIRE((*canary)->Release(true).ok());
  // Nothing wedged: the honest path pulls the same prompt at once.
  hostile.mode = 0;
  auto [cached, exact] = PullStart(*wb, "honest", 1, 4, "evil");
  CHECK(cached == 4 * kBlockTokens);
  CHECK(exact);
  server->Shutdown();
}

// A peer that answers Offer honestly, then sits on every Read until told to go on.
class StallingPeer final : public RelayPeer {
 public:
  using RelayPeer::RelayPeer;
  grpc::Status Read(grpc::ServerContext* ctx, const peer::v1::ReadRequest*, peer::v1::ReadResponse*) override {
    reads_.fetch_add(1);
    while (!go_.load() && !ctx->IsCancelled()) absl::SleepFor(absl::Milliseconds(5));
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "stalled");
  }
  grpc::Status Release(grpc::ServerContext*, const peer::v1::ReleaseRequest*, peer::v1::ReleaseResponse*) override {
    while (!go_.load()) absl::SleepFor(absl::Milliseconds(5));  // and never answers Release in time
    return grpc::Status::OK;
  }
  int reads() const { return reads_.load(); }
  void Go() { go_.store(true); }

 private:
  std::atomic<int> reads_{0};
  std::atomic<bool> go_{false};
};

TEST_CASE("A stalled peer costs a start its pull timeout, and pulls from other peers nothing", "[integration][transfer]") {
  Certs certs;
  if (!certs.ok) return;
  DaemonProcess a(NodeConfig(certs, "node-a", {}, "node-b, evil"));
  auto wa = Connect(a, "prefill");
  StallingPeer stalling(PeerStub(certs, a, "node-a", "evil"));
  std::string evil;
  std::unique_ptr<grpc::Server> server = ServePeer(certs, "evil", &stalling, &evil);
  // One pull thread per peer: a stalled peer fills its own, never node-a's.
  DaemonProcess b(NodeConfig(certs, "node-b", {{"node-a", a.transfer_address()}, {"evil", evil}},
                             "", 64, 256, "  pull_timeout_s: 4\n  pull_threads: 1\n"));
  auto wb = Connect(b, "decode");
  auto wb2 = Connect(b, "decode2");
  for (uint32_t s = 1; s <= 3; ++s) Prefill(*wa, absl::StrCat("p", s), s, 4);
  // Two pulls from the stalled peer: the second waits behind the first in that peer's queue, and
  // still answers within its own timeout, counted from its arrival.
  std::atomic<int> stalled_done{0};
  std::vector<std::pair<int64_t, absl::Duration>> stalled(2);
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      auto c = Connect(b, absl::StrCat("stalled", i));
      const absl::Time t0 = absl::Now();
      auto [cached, exact] = PullStart(*c, absl::StrCat("s", i), 1 + i, 4, "evil");
      stalled[i] = {cached, absl::Now() - t0};
      stalled_done.fetch_add(1);
    });
  }
  while (stalling.reads() < 1) absl::SleepFor(absl::Milliseconds(5));
  // Meanwhile node-a serves at once.
  auto [cached, exact] = PullStart(*wb2, "fine", 3, 4, "node-a");
  CHECK(cached == 4 * kBlockTokens);
  CHECK(exact);
  CHECK(stalled_done.load() == 0);  // the stalled pulls were still waiting
  for (auto& t : threads) t.join();
  for (const auto& [got, took] : stalled) {
    CHECK(got == 0);
    // The deadline bounds the answer, queue time included (4 s; a generous margin for a loaded
    // machine, far below the 8 s that two pulls queued one after the other would take).
    CHECK(took < absl::Seconds(7));
  }
  CHECK(Metric(b, "kvd_peer_pulls_total{outcome=\"timeout\"}") == 2);
  CHECK(Cached(*wb, 1, 4) == 0);
  CHECK(Cached(*wb, 2, 4) == 0);
  stalling.Go();
  server->Shutdown();
}

TEST_CASE("A peer's hot handoff hands its listener and cached blocks over: pulls go on", "[integration][transfer]") {
  Certs certs;
  if (!certs.ok) return;
  // A fixed address (a successor binds what its predecessor let go), picked free just now.
  const int port = FreeLoopbackPort();
  REQUIRE(port > 0);
  std::string config = NodeConfig(certs, "node-a", {}, "node-b");
  config.replace(config.find("127.0.0.1:0"), 11, absl::StrCat("127.0.0.1:", port));
  DaemonProcess a(config);
  REQUIRE(a.transfer_address() == absl::StrCat("127.0.0.1:", port));
  DaemonProcess b(NodeConfig(certs, "node-b", {{"node-a", a.transfer_address()}}));
  auto wa = Connect(a, "prefill");
  auto wb = Connect(b, "decode");
  Prefill(*wa, "p1", 1, 6);
  CHECK(PullStart(*wb, "d1", 1, 6, "node-a").first == 6 * kBlockTokens);
  Prefill(*wa, "p2", 2, 6);
  REQUIRE(a.TakeOver());
  REQUIRE(a.WaitPredecessorExit(absl::Seconds(10)).value_or(-1) == 0);
  // The successor serves peers on the same address, from the blocks it took over.
  auto [cached, exact] = PullStart(*wb, "d2", 2, 6, "node-a");
  CHECK(cached == 6 * kBlockTokens);
  CHECK(exact);
  CHECK(Metric(a, "kvd_peer_offered_blocks_total") == 6);  // the successor's own count
}

TEST_CASE("A peer stopped and killed in the middle of a pull leaves nothing partial", "[integration][transfer]") {
  Certs certs;
  if (!certs.ok) return;
  // 512 KiB blocks; a 1024-block prompt is 512 MiB: long enough on loopback to be stopped mid-way.
  const int kBlocks = 1024;
  DaemonProcess a(NodeConfig(certs, "node-a", {}, "node-b", 16384, kBlocks + 8));
  DaemonProcess b(NodeConfig(certs, "node-b", {{"node-a", a.transfer_address()}}, "", 16384, kBlocks + 8,
                             "  pull_timeout_s: 20\n"));
  auto wa = Connect(a, "prefill");
  auto wb = Connect(b, "decode");
  Prefill(*wa, "p", 5, kBlocks);
  std::pair<int64_t, bool> got{-1, false};
  std::thread pull([&] { got = PullStart(*wb, "d", 5, kBlocks, "node-a"); });
  // Once A has answered the offer, B's gets are in flight: stop A, then kill it.
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (Metric(a, "kvd_peer_leases") < 1 && Metric(a, "kvd_peer_offered_blocks_total") < 1 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  a.Signal(SIGSTOP);
  absl::SleepFor(absl::Milliseconds(300));
  a.Signal(SIGKILL);
  pull.join();
  // All or nothing, never part: in practice nothing (the reads were cut), but a pull that
  // finished before the stop must then be whole and exact.
  INFO("B's log: " << b.Log());
  if (got.first == 0) {
    CHECK(Cached(*wb, 5, kBlocks) == 0);
    // A counts the offer before its answer leaves, so the stop can also land between the two:
    // then B's Offer fails ("offer"). Any one failure, counted once, is right.
    int64_t failed = 0;
    for (const char* outcome : {"transfer", "timeout", "offer"}) {
      failed += std::max<int64_t>(0, Metric(b, absl::StrCat("kvd_peer_pulls_total{outcome=\"", outcome, "\"}")));
    }
    CHECK(failed == 1);
  } else {
    WARN("the pull finished before the peer was stopped");
    CHECK(got.first == kBlocks * kBlockTokens);
    CHECK(got.second);
  }
  // B serves on, and the blocks the failed pull used are free again.
  auto r = wb->Start(PoolRequest("after", Prompt(6, kBlocks), 1));
  REQUIRE(r.ok());
  REQUIRE((*r)->Release(true).ok());
}

}  // namespace
}  // namespace kvd
