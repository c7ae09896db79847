// Peer transfer (docs/transfer.md): two real kvd daemons on loopback, each with its own worker
// clients; the Peer service under mutual TLS with certificates the test makes (openssl). Node A
// prefills, node B pulls over that channel, and every pulled byte is compared with what A's
// worker wrote. Then what goes wrong: a peer not configured, an unauthenticated caller, reads of
// leases that are not the caller's, certificates whose names only look allowed, pins against
// eviction, leases that expire, a hostile peer (a proxy in this process that corrupts A's real
// offers and reads), a peer stopped while others serve, and one killed in the middle of a pull. The two-namespace test with the
// reference engine is tests/transfer/netns_pull.py.
#include <csignal>
#include <cstring>
#include <fstream>
#include <map>
#include <tuple>
#include <sstream>
#include <thread>

#include <catch2/catch.hpp>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "kvd/peer/v1/peer.grpc.pb.h"
#include "tests/integration/harness.h"
#include "tests/util/free_port.h"

namespace kvd {
namespace {

using namespace kvd::testing;
using client::Client;
using client::KvRequest;

constexpr int kBlockTokens = 16;

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A CA, and a certificate it signed for each name (CN and DNS subjectAltName); and, for the
// allow-list, certificates whose CN or other subjectAltName kinds say a name their DNS names do
// not: file stem -> (CN, subjectAltName extension or "" for none).
struct Certs {
  TempDir dir;
  bool ok = false;
  static const std::vector<std::tuple<std::string, std::string, std::string>>& Odd() {
    static const auto* odd = new std::vector<std::tuple<std::string, std::string, std::string>>{
        {"cn-uri", "node-b", "URI:spiffe://example.org/node-x"},
        {"cn-email", "node-b", "email:node-x@example.org"},
        {"cn-ip", "node-b", "IP:127.0.0.9"},
        {"cn-dns-other", "node-b", "DNS:node-x"},
        {"uri-named", "someone-else", "URI:node-b"},
        {"email-named", "someone-else", "email:node-b"},
        {"cn-only", "node-b", ""},
        {"dns-named", "someone-else", "DNS:node-b"},
        {"spiffe", "someone-else", "URI:spiffe://example.org/node-b"}};
    return *odd;
  }
  Certs() {
    std::string script =
        "set -e; cd '" + dir.path() + "'\n"
        "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=kvd-peer-ca -keyout ca.key -out ca.pem 2>/dev/null\n"
        "cert() {  # stem, CN, subjectAltName ('' for none)\n"
        "  openssl req -newkey rsa:2048 -nodes -subj \"/CN=$2\" -keyout $1.key -out $1.csr 2>/dev/null\n"
        "  if [ -n \"$3\" ]; then printf 'subjectAltName=%s\\n' \"$3\" > $1.ext; else : > $1.ext; fi\n"
        "  openssl x509 -req -in $1.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile $1.ext -out $1.pem 2>/dev/null\n"
        "}\n"
        "for who in node-a node-b evil stranger; do cert $who $who DNS:$who; done\n";
    for (const auto& [stem, cn, san] : Odd()) absl::StrAppend(&script, "cert ", stem, " ", cn, " '", san, "'\n");
    ok = RunProcess("/bin/sh", {"-c", script}).exit_code == 0;
  }
  std::string path(const std::string& file) const { return dir.path() + "/" + file; }
};

// A pool of 16-token blocks of 2 layers x `bytes_per_token_per_layer`, and a transfer section
// for `name`, pulling from `peers` (name, address).
std::string NodeConfig(const Certs& certs, const std::string& name,
                       const std::vector<std::pair<std::string, std::string>>& peers,
                       const std::string& allowed = "", int64_t bytes_per_token_per_layer = 64,
                       int capacity_blocks = 256, const std::string& extra = "") {
  std::string yaml = absl::StrCat(
      "pools:\n"
      "  - name: default\n"
      "    block_tokens: ", kBlockTokens, "\n"
      "    num_layers: 2\n"
      "    bytes_per_token_per_layer: ", bytes_per_token_per_layer, "\n"
      "    capacity_blocks: ", capacity_blocks, "\n"
      "    max_model_len: 20000\n"
      "transfer:\n"
      "  listen: 127.0.0.1:0\n"
      "  tls_cert_file: ", certs.path(name + ".pem"), "\n"
      "  tls_key_file: ", certs.path(name + ".key"), "\n"
      "  tls_ca_file: ", certs.path("ca.pem"), "\n", extra);
  if (!allowed.empty()) absl::StrAppend(&yaml, "  allowed_peers: [", allowed, "]\n");
  if (!peers.empty()) {
    absl::StrAppend(&yaml, "  peers:\n");
    for (const auto& [n, a] : peers) absl::StrAppend(&yaml, "    - {name: ", n, ", address: \"", a, "\"}\n");
  }
  return yaml;
}

// The byte a worker writes at `offset` of layer `layer` of prompt block `position`.
uint8_t Pattern(uint32_t seed, int64_t position, int32_t layer, int64_t offset) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ (position * 0x100000001B3ull) ^ (layer * 0xC2B2AE3Dull) ^ offset;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  return static_cast<uint8_t>(x >> 56);
}

std::unique_ptr<Client> Connect(const DaemonProcess& d, const std::string& name) {
  auto c = Client::Connect({.target = d.target(), .worker_name = name});
  REQUIRE(c.ok());
  return std::move(*c);
}

std::vector<Token> Prompt(uint32_t seed, int blocks) {  // `blocks` full blocks and one more token
  std::vector<Token> p;
  for (int i = 0; i < blocks * kBlockTokens + 1; ++i) p.push_back(static_cast<Token>((seed * 7919 + i * 31) % 50000));
  return p;
}

void WriteBlocks(Client& c, const KvRequest& r, int64_t first, int64_t count, uint32_t seed) {
  const client::PoolView* pool = *c.FindPool("default");
  const int64_t n = pool->geometry.layer_block_bytes();
  std::vector<uint8_t> buf(static_cast<size_t>(n));
  for (int64_t i = first; i < first + count; ++i) {
    for (int32_t layer = 0; layer < pool->geometry.num_layers; ++layer) {
      for (int64_t j = 0; j < n; ++j) buf[j] = Pattern(seed, i, layer, j);
      REQUIRE(c.WriteLayer(r.pool(), r.blocks()[i], layer, 0, buf.data(), n).ok());
    }
  }
}

// Whether the first `count` blocks of `r` hold what WriteBlocks wrote for `seed`.
bool BlocksExact(Client& c, const KvRequest& r, int64_t count, uint32_t seed) {
  const client::PoolView* pool = *c.FindPool("default");
  const int64_t n = pool->geometry.layer_block_bytes();
  std::vector<uint8_t> buf(static_cast<size_t>(n));
  for (int64_t i = 0; i < count; ++i) {
    for (int32_t layer = 0; layer < pool->geometry.num_layers; ++layer) {
      if (!c.ReadLayer(r.pool(), r.blocks()[i], layer, 0, buf.data(), n).ok()) return false;
      for (int64_t j = 0; j < n; ++j) {
        if (buf[j] != Pattern(seed, i, layer, j)) return false;
      }
    }
  }
  return true;
}

// A worker of `d` computes `blocks` blocks of prompt `seed` and publishes them.
void Prefill(Client& c, const std::string& id, uint32_t seed, int blocks) {
  auto r = c.Start(PoolRequest(id, Prompt(seed, blocks), 1));
  REQUIRE(r.ok());
  WriteBlocks(c, **r, (*r)->cached_tokens() / kBlockTokens, blocks - (*r)->cached_tokens() / kBlockTokens, seed);
  REQUIRE((*r)->End(blocks, {}, true).ok());
}

// B's worker starts prompt `seed` naming `peer`; answers the cached tokens, and whether the bytes
// of the cached blocks are exact.
std::pair<int64_t, bool> PullStart(Client& c, const std::string& id, uint32_t seed, int blocks, const std::string& peer) {
  auto r = c.Start(PoolRequest(id, Prompt(seed, blocks), 1), absl::Seconds(30), peer);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  const int64_t cached = (*r)->cached_tokens();
  const bool exact = BlocksExact(c, **r, cached / kBlockTokens, seed);
  REQUIRE((*r)->Release(true).ok());
  return {cached, exact};
}

int64_t Cached(Client& c, uint32_t seed, int blocks) {
  Namespace ns;
  ns.pool = "default";
  auto n = c.PeekPrefixLen(ns, Prompt(seed, blocks));
  REQUIRE(n.ok());
  return *n;
}

// A's leases once the pullers' Releases landed: they go out after each start is answered, so a
// test waits for them (up to 10 s) rather than reading the gauge at once.
int64_t LeasesSettled(const DaemonProcess& a) {
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  int64_t n = Metric(a, "kvd_peer_leases");
  while (n != 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(20));
    n = Metric(a, "kvd_peer_leases");
  }
  return n;
}

std::shared_ptr<grpc::ChannelCredentials> PeerCredentials(const Certs& certs, const std::string& who) {
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = ReadText(certs.path("ca.pem"));
  if (!who.empty()) {
    ssl.pem_private_key = ReadText(certs.path(who + ".key"));
    ssl.pem_cert_chain = ReadText(certs.path(who + ".pem"));
  }
  return grpc::SslCredentials(ssl);
}

// A raw stub to `d`'s Peer service, as `who` (empty: no client certificate).
std::unique_ptr<peer::v1::Peer::Stub> PeerStub(const Certs& certs, const DaemonProcess& d, const std::string& server_name,
                                               const std::string& who) {
  grpc::ChannelArguments args;
  args.SetSslTargetNameOverride(server_name);
  return peer::v1::Peer::NewStub(grpc::CreateCustomChannel(d.transfer_address(), PeerCredentials(certs, who), args));
}

grpc::StatusCode Release(peer::v1::Peer::Stub& stub, uint64_t lease) {
  grpc::ClientContext ctx;
  peer::v1::ReleaseRequest rel;
  rel.set_lease(lease);
  peer::v1::ReleaseResponse ignored;
  return stub.Release(&ctx, rel, &ignored).error_code();
}

grpc::Status Read(peer::v1::Peer::Stub& stub, uint64_t lease, int64_t first, int64_t count, peer::v1::ReadResponse* resp) {
  peer::v1::ReadRequest req;
  req.set_lease(lease);
  req.set_first(first);
  req.set_count(count);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return stub.Read(&ctx, req, resp);
}

grpc::Status Offer(peer::v1::Peer::Stub& stub, uint32_t seed, int blocks, int64_t lease_ms, peer::v1::OfferResponse* resp) {
  peer::v1::OfferRequest req;
  req.mutable_namespace_()->set_pool("default");
  for (Token t : Prompt(seed, blocks)) req.add_tokens(t);
  req.set_lease_ms(lease_ms);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return stub.Offer(&ctx, req, resp);
}

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
  REQUIRE(Offer(*b, 1, 4, 1000, &good).ok());
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

  // A puller that never releases: the lease expires and the blocks can go.
  Prefill(*wa, "p2", 2, 4);
  peer::v1::OfferResponse forgotten;
  REQUIRE(Offer(*b, 2, 4, 300, &forgotten).ok());
  CHECK(Metric(a, "kvd_peer_leases") == 1);
  absl::SleepFor(absl::Milliseconds(900));
  CHECK(LeasesSettled(a) == 0);
  REQUIRE(wa->Gc().ok());
  CHECK(Cached(*wa, 2, 4) == 0);
}

// A peer in this process that answers with A's real offers and reads, corrupted as `mode` says.
class HostilePeer final : public peer::v1::Peer::Service {
 public:
  HostilePeer(std::unique_ptr<peer::v1::Peer::Stub> real) : real_(std::move(real)) {}
  std::atomic<int> mode{0};
  enum Mode {
    kGeometry = 1, kLayout, kCount, kChecksum, kShortBlock, kLongBlock, kExtraBlock, kNoBlock, kFlipByte, kSwap,
    // Hybrid pools: the unit's last component (a checkpoint) left out of the offer; a depth that
    // does not match the components; the lease let go before the reads (the lender may evict).
    kDropLast, kDepth, kReleaseFirst
  };

  grpc::Status Offer(grpc::ServerContext*, const peer::v1::OfferRequest* req, peer::v1::OfferResponse* resp) override {
    grpc::ClientContext ctx;
    grpc::Status s = real_->Offer(&ctx, *req, resp);
    if (!s.ok() || resp->blocks().empty()) return s;
    switch (mode.load()) {
      case kGeometry: resp->mutable_geometry()->set_bytes_per_token_per_layer(128); break;
      case kLayout: resp->mutable_geometry()->set_layout("block_major"); break;
      case kCount: resp->add_blocks(resp->blocks(0)), resp->add_checksums(0); break;
      case kChecksum: resp->set_checksums(2, resp->checksums(2) ^ 1); break;
      case kDropLast: resp->mutable_blocks()->RemoveLast(), resp->mutable_checksums()->RemoveLast(); break;
      case kDepth: resp->set_depth_blocks(resp->depth_blocks() + 2); break;
    }
    return s;
  }
  grpc::Status Read(grpc::ServerContext*, const peer::v1::ReadRequest* req, peer::v1::ReadResponse* resp) override {
    if (mode.load() == kReleaseFirst) {
      grpc::ClientContext release;
      peer::v1::ReleaseRequest rel;
      rel.set_lease(req->lease());
      peer::v1::ReleaseResponse ignored;
      (void)real_->Release(&release, rel, &ignored);
    }
    grpc::ClientContext ctx;
    grpc::Status s = real_->Read(&ctx, *req, resp);
    if (!s.ok() || resp->blocks().empty()) return s;
    switch (mode.load()) {
      case kShortBlock: resp->mutable_blocks(0)->pop_back(); break;
      case kLongBlock: resp->mutable_blocks(0)->append(4096, 'x'); break;
      case kExtraBlock: *resp->add_blocks() = resp->blocks(0); break;
      case kNoBlock: resp->clear_blocks(); break;
      case kFlipByte: (*resp->mutable_blocks(resp->blocks_size() - 1))[7] ^= 1; break;
      case kSwap:
        if (resp->blocks_size() > 1) resp->mutable_blocks(0)->swap(*resp->mutable_blocks(1));
        break;
    }
    return s;
  }
  grpc::Status Release(grpc::ServerContext*, const peer::v1::ReleaseRequest* req, peer::v1::ReleaseResponse* resp) override {
    grpc::ClientContext ctx;
    return real_->Release(&ctx, *req, resp);
  }

 private:
  std::unique_ptr<peer::v1::Peer::Stub> real_;
};

// A TLS server for `service` in this process, presenting `who`'s certificate.
std::unique_ptr<grpc::Server> ServePeer(const Certs& certs, const std::string& who, grpc::Service* service, int* port) {
  grpc::SslServerCredentialsOptions ssl(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  ssl.pem_root_certs = ReadText(certs.path("ca.pem"));
  ssl.pem_key_cert_pairs.push_back({ReadText(certs.path(who + ".key")), ReadText(certs.path(who + ".pem"))});
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::SslServerCredentials(ssl), port);
  builder.RegisterService(service);
  return builder.BuildAndStart();
}

TEST_CASE("A hostile peer's offers and reads are bounds-checked and verified: nothing is cached, nothing else written",
          "[integration][transfer]") {
  Certs certs;
  if (!certs.ok) return;
  DaemonProcess a(NodeConfig(certs, "node-a", {}, "node-b"));
  auto wa = Connect(a, "prefill");
  HostilePeer hostile(PeerStub(certs, a, "node-a", "node-b"));
  int port = 0;
  std::unique_ptr<grpc::Server> server = ServePeer(certs, "evil", &hostile, &port);
  REQUIRE(port > 0);
  DaemonProcess b(NodeConfig(certs, "node-b", {{"node-a", a.transfer_address()}, {"evil", absl::StrCat("127.0.0.1:", port)}}));
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
class StallingPeer final : public peer::v1::Peer::Service {
 public:
  StallingPeer(std::unique_ptr<peer::v1::Peer::Stub> real) : real_(std::move(real)) {}
  grpc::Status Offer(grpc::ServerContext*, const peer::v1::OfferRequest* req, peer::v1::OfferResponse* resp) override {
    grpc::ClientContext ctx;
    return real_->Offer(&ctx, *req, resp);
  }
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
  std::unique_ptr<peer::v1::Peer::Stub> real_;
  std::atomic<int> reads_{0};
  std::atomic<bool> go_{false};
};

TEST_CASE("A stalled peer costs a start its pull timeout, and pulls from other peers nothing", "[integration][transfer]") {
  Certs certs;
  if (!certs.ok) return;
  DaemonProcess a(NodeConfig(certs, "node-a", {}, "node-b, evil"));
  auto wa = Connect(a, "prefill");
  StallingPeer stalling(PeerStub(certs, a, "node-a", "evil"));
  int port = 0;
  std::unique_ptr<grpc::Server> server = ServePeer(certs, "evil", &stalling, &port);
  REQUIRE(port > 0);
  // One pull thread per peer: a stalled peer fills its own, never node-a's.
  DaemonProcess b(NodeConfig(certs, "node-b", {{"node-a", a.transfer_address()}, {"evil", absl::StrCat("127.0.0.1:", port)}},
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

// --- Hybrid pools (docs/hybrid.md §2.9, "peers"): a hit travels as one unit of every group's
// components. Pool "hy": 4-token blocks, full attention in layers 1 and 3, a window of 6 in layer
// 0, a recurrent state in layer 2 checkpointed every 2 blocks; step_tokens 8, so a start's window
// table reaches 2 blocks past its hit and a deeper unit lands partly past it.
constexpr int kHyBlock = 4;
constexpr int kHyBlocks = 8;  // the prefill's prompt: 8 blocks and one token

std::string HybridNodeConfig(const Certs& certs, const std::string& name,
                             const std::vector<std::pair<std::string, std::string>>& peers,
                             const std::string& allowed = "", int window = 6) {
  std::string yaml = absl::StrCat(
      "pools:\n"
      "  - name: hy\n"
      "    block_tokens: ", kHyBlock, "\n"
      "    num_layers: 4\n"
      "    bytes_per_token_per_layer: 16\n"
      "    max_model_len: 64\n"
      "    step_tokens: 8\n"
      "    groups:\n"
      "      - {name: full, kind: full, layers: [\"1-3/2\"], capacity_blocks: 40}\n"
      "      - {name: swa, kind: sliding_window, layers: [0], window: ", window, ", capacity_blocks: 24}\n"
      "      - {name: rec, kind: state, layers: [2], bytes_per_state: 100, checkpoint_every_blocks: 2, "
      "capacity_slots: 6}\n"
      "transfer:\n"
      "  listen: 127.0.0.1:0\n"
      "  tls_cert_file: ", certs.path(name + ".pem"), "\n"
      "  tls_key_file: ", certs.path(name + ".key"), "\n"
      "  tls_ca_file: ", certs.path("ca.pem"), "\n");
  if (!allowed.empty()) absl::StrAppend(&yaml, "  allowed_peers: [", allowed, "]\n");
  if (!peers.empty()) {
    absl::StrAppend(&yaml, "  peers:\n");
    for (const auto& [n, a] : peers) absl::StrAppend(&yaml, "    - {name: ", n, ", address: \"", a, "\"}\n");
  }
  return yaml;
}

std::vector<Token> HyPrompt(uint32_t seed) { return Range(static_cast<Token>(1000 * seed), kHyBlocks * kHyBlock + 1); }

// What a worker writes into layer j of group `group`'s unit for block position `position` (a
// state: the state after `position` blocks): a function of the content alone, so that two nodes'
// bytes compare.
std::string HyPattern(uint32_t seed, const std::string& group, int64_t position, int32_t j, int64_t bytes) {
  std::string out(static_cast<size_t>(bytes), '\0');
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(Pattern(seed, position, j, static_cast<int64_t>(i)) ^ group[0]);
  return out;
}

void HyWrite(Client& c, const std::string& group, BlockIndex unit, uint32_t seed, int64_t position) {
  auto view = client::GroupKv(**c.FindPool("hy"), group);
  REQUIRE(view.ok());
  for (int32_t j = 0; j < static_cast<int32_t>(view->layers.size()); ++j) {
    const std::string bytes = HyPattern(seed, group, position, j, view->layer_unit_bytes);
    std::memcpy(view->Unit(j, view->Local(unit)), bytes.data(), bytes.size());
  }
}

bool HyExact(Client& c, const std::string& group, BlockIndex unit, uint32_t seed, int64_t position) {
  auto view = client::GroupKv(**c.FindPool("hy"), group);
  if (!view.ok() || view->Local(unit) < 0) return false;
  for (int32_t j = 0; j < static_cast<int32_t>(view->layers.size()); ++j) {
    const std::string bytes = HyPattern(seed, group, position, j, view->layer_unit_bytes);
    if (std::memcmp(view->Unit(j, view->Local(unit)), bytes.data(), bytes.size()) != 0) return false;
  }
  return true;
}

// A's worker computes HyPrompt(seed) as an engine would: every group's units as its tables hold
// them, reporting computed tokens 8 at a time, and publishes the 8 blocks with the state after
// them (a checkpoint at 32 tokens) in its spare slot.
void HyPrefill(Client& c, const std::string& id, uint32_t seed) {
  auto r = c.Start(PoolRequest(id, HyPrompt(seed), 0, "hy"));
  REQUIRE(r.ok());
  KvRequest& req = **r;
  auto write_tables = [&] {
    for (const std::string group : {"full", "swa"}) {
      const GroupTable* t = req.group_table(group);
      for (size_t i = 0; i < t->blocks.size(); ++i) HyWrite(c, group, t->blocks[i], seed, t->first_block_position + i);
    }
  };
  write_tables();
  for (int64_t computed = 8; computed <= kHyBlocks * kHyBlock; computed += 8) {
    REQUIRE(req.Extend(0, computed).ok());
    write_tables();
  }
  const BlockIndex spare = req.group_table("rec")->blocks[1];
  HyWrite(c, "rec", spare, seed, kHyBlocks);
  const std::vector<Token> prompt = HyPrompt(seed);
  auto published = req.Publish(absl::MakeConstSpan(prompt).first(kHyBlocks * kHyBlock),
                               std::vector<StateCheckpoint>{{2, kHyBlocks * kHyBlock, spare}});
  REQUIRE(published.ok());
  REQUIRE(published->checkpoint_outcomes == std::vector<CheckpointOutcome>{CheckpointOutcome::kKept});
  REQUIRE(req.Release(true).ok());
}

// B's worker starts HyPrompt(seed) naming `peer`: the cached tokens, and whether every unit its
// hit reads (full blocks below it, the window before it, the checkpoint at it) holds A's bytes.
std::pair<int64_t, bool> HyPullStart(Client& c, const std::string& id, uint32_t seed, const std::string& peer) {
  auto r = c.Start(PoolRequest(id, HyPrompt(seed), 0, "hy"), absl::Seconds(30), peer);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  KvRequest& req = **r;
  const int64_t d = req.cached_tokens() / kHyBlock;
  bool exact = true;
  for (int64_t i = 0; i < d; ++i) exact = exact && HyExact(c, "full", req.blocks()[i], seed, i);
  if (d > 0) {
    const GroupTable* swa = req.group_table("swa");
    const GroupTable* rec = req.group_table("rec");
    exact = exact && swa->first_block_position == d - 2 && swa->blocks.size() >= 2;  // ceil((6 - 1) / 4) = 2
    for (int64_t i = 0; exact && i < 2; ++i) exact = HyExact(c, "swa", swa->blocks[i], seed, d - 2 + i);
    exact = exact && rec->checkpoint_slot >= 0 && HyExact(c, "rec", static_cast<BlockIndex>(rec->checkpoint_slot), seed, d);
  }
  REQUIRE(req.Release(true).ok());
  return {req.cached_tokens(), exact};
}

int64_t HyCached(Client& c, uint32_t seed) {
  auto n = c.PeekPrefixLen(Namespace{.pool = "hy"}, HyPrompt(seed));
  REQUIRE(n.ok());
  return *n;
}

// B's units of pool hy owned by anyone (requests, pulls): 0 once its requests are gone.
int64_t HyOwned(Client& c) {
  absl::StatusOr<CacheReport> r = c.Report();
  REQUIRE(r.ok());
  for (const PoolReport& p : r->pools) {
    if (p.name == "hy") return p.owned_blocks;
  }
  FAIL("no pool hy");
  return -1;
}

TEST_CASE("A hybrid pool's hit is pulled from a peer as one unit, every group byte-identical", "[integration][transfer]") {
  Certs certs;
  if (!certs.ok) return;
  DaemonProcess a(HybridNodeConfig(certs, "node-a", {}, "node-b"));
  DaemonProcess b(HybridNodeConfig(certs, "node-b", {{"node-a", a.transfer_address()}}));
  auto wa = Connect(a, "prefill");
  auto wb = Connect(b, "decode");
  HyPrefill(*wa, "p1", 1);
  REQUIRE(HyCached(*wa, 1) == kHyBlocks * kHyBlock);

  // B had nothing: the unit at 32 tokens comes from A (8 full blocks, the window blocks 6 and 7,
  // past the start's window table, and the checkpoint), bit-exact, and counts as a hit.
  auto [cached, exact] = HyPullStart(*wb, "d1", 1, "node-a");
  CHECK(cached == kHyBlocks * kHyBlock);
  CHECK(exact);
  CHECK(Metric(b, "kvd_peer_pulls_total{outcome=\"pulled\"}") == 1);
  CHECK(Metric(a, "kvd_peer_offered_blocks_total") == kHyBlocks + 2 + 1);
  CHECK(Metric(b, "kvd_peer_pulled_blocks_total") == kHyBlocks);
  // The unit's bytes: 8 full blocks of 2 layers, 2 window blocks of 1, one state of 100 bytes.
  CHECK(Metric(b, "kvd_peer_pulled_bytes_total") == kHyBlocks * 2 * kHyBlock * 16 + 2 * kHyBlock * 16 + 100);
  CHECK(LeasesSettled(a) == 0);
  // Published on B as a unit: a later start hits there locally, at the same length, same bytes.
  CHECK(HyCached(*wb, 1) == kHyBlocks * kHyBlock);
  auto [again, again_exact] = HyPullStart(*wb, "d2", 1, "");
  CHECK(again == kHyBlocks * kHyBlock);
  CHECK(again_exact);
  CHECK(HyOwned(*wb) == 0);
  // A peer without the prompt: nothing, the request computes.
  auto [cold, cold_exact] = HyPullStart(*wb, "d3", 2, "node-a");
  CHECK(cold == 0);
  CHECK(Metric(b, "kvd_peer_pulls_total{outcome=\"nothing\"}") == 1);

  // A node whose window differs shares no unit: refused before any read, naming the group.
  DaemonProcess c(HybridNodeConfig(certs, "node-b", {{"node-a", a.transfer_address()}}, "", /*window=*/7));
  auto wc = Connect(c, "decode-c");
  auto [other, other_exact] = HyPullStart(*wc, "d4", 1, "node-a");
  CHECK(other == 0);
  CHECK(HyCached(*wc, 1) == 0);
  CHECK(HyOwned(*wc) == 0);
  CHECK(Metric(c, "kvd_peer_pulls_total{outcome=\"geometry\"}") == 1);
  CHECK(c.Log().find("differs in group \\'swa\\' (groups[1]) field window: 6 there, 7 here") != std::string::npos);
  CHECK(LeasesSettled(a) == 0);
}

TEST_CASE("A hostile peer's hybrid unit is checked component by component: nothing cached, nothing leaked",
          "[integration][transfer]") {
  Certs certs;
  if (!certs.ok) return;
  DaemonProcess a(HybridNodeConfig(certs, "node-a", {}, "node-b"));
  auto wa = Connect(a, "prefill");
  HostilePeer hostile(PeerStub(certs, a, "node-a", "node-b"));
  int port = 0;
  std::unique_ptr<grpc::Server> server = ServePeer(certs, "evil", &hostile, &port);
  REQUIRE(port > 0);
  DaemonProcess b(HybridNodeConfig(certs, "node-b", {{"evil", absl::StrCat("127.0.0.1:", port)}}));
  auto wb = Connect(b, "decode");
  HyPrefill(*wa, "p", 1);

  const std::vector<std::pair<HostilePeer::Mode, std::string>> modes = {
      {HostilePeer::kDropLast, "bounds"},       {HostilePeer::kDepth, "bounds"},
      {HostilePeer::kShortBlock, "bounds"},     {HostilePeer::kLongBlock, "bounds"},
      {HostilePeer::kChecksum, "checksum"},     {HostilePeer::kFlipByte, "checksum"},
      {HostilePeer::kSwap, "checksum"},         {HostilePeer::kReleaseFirst, "transfer"}};
  int n = 0;
  for (const auto& [mode, cause] : modes) {
    INFO("mode " << mode << ", B's log: " << b.Log());
    hostile.mode = mode;
    auto [cached, exact] = HyPullStart(*wb, absl::StrCat("d", n++), 1, "evil");
    CHECK(cached == 0);
    CHECK(HyCached(*wb, 1) == 0);  // nothing partial cached: no block, window or checkpoint
    CHECK(HyOwned(*wb) == 0);      // no unit left behind (the loose window units included)
  }
  CHECK(Metric(b, "kvd_peer_pulls_total{outcome=\"bounds\"}") == 4);
  CHECK(Metric(b, "kvd_peer_pulls_total{outcome=\"checksum\"}") == 3);
  CHECK(Metric(b, "kvd_peer_pulls_total{outcome=\"transfer\"}") == 1);
  CHECK(b.Log().find("component at block") != std::string::npos);
  CHECK(LeasesSettled(a) == 0);
  // The lender let go of the unit mid-pull and may evict it: A's operator clears it; B still
  // pulls nothing and stays at its local hit.
  REQUIRE(wa->Gc().ok());
  hostile.mode = 0;
  CHECK(HyPullStart(*wb, "after-gc", 1, "evil").first == 0);
  // Nothing wedged: the honest path pulls the unit at once.
  HyPrefill(*wa, "p2", 1);
  auto [cached, exact] = HyPullStart(*wb, "honest", 1, "evil");
  CHECK(cached == kHyBlocks * kHyBlock);
  CHECK(exact);
  CHECK(HyOwned(*wb) == 0);
  server->Shutdown();
}

}  // namespace
}  // namespace kvd
