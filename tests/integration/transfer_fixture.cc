#include "tests/integration/transfer_fixture.h"

#include <chrono>
#include <fstream>
#include <sstream>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvd::testing {

using client::Client;
using client::KvRequest;

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

const std::vector<std::tuple<std::string, std::string, std::string>>& Certs::Odd() {
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

Certs::Certs() {
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

std::string TransferSection(const Certs& certs, const std::string& name, const PeerAddresses& peers,
                            const std::string& allowed, const std::string& extra) {
  std::string yaml = absl::StrCat(
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

std::string NodeConfig(const Certs& certs, const std::string& name, const PeerAddresses& peers,
                       const std::string& allowed, int64_t bytes_per_token_per_layer, int capacity_blocks,
                       const std::string& extra) {
  return absl::StrCat(
      "pools:\n"
      "  - name: default\n"
      "    block_tokens: ", kBlockTokens, "\n"
      "    num_layers: 2\n"
      "    bytes_per_token_per_layer: ", bytes_per_token_per_layer, "\n"
      "    capacity_blocks: ", capacity_blocks, "\n"
      "    max_model_len: 20000\n",
      TransferSection(certs, name, peers, allowed, extra));
}

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

std::vector<Token> Prompt(uint32_t seed, int blocks) {
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

void Prefill(Client& c, const std::string& id, uint32_t seed, int blocks) {
  auto r = c.Start(PoolRequest(id, Prompt(seed, blocks), 1));
  REQUIRE(r.ok());
  WriteBlocks(c, **r, (*r)->cached_tokens() / kBlockTokens, blocks - (*r)->cached_tokens() / kBlockTokens, seed);
  REQUIRE((*r)->End(blocks, {}, true).ok());
}

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

std::unique_ptr<grpc::Server> ServePeer(const Certs& certs, const std::string& who, grpc::Service* service,
                                        std::string* address) {
  grpc::SslServerCredentialsOptions ssl(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  ssl.pem_root_certs = ReadText(certs.path("ca.pem"));
  ssl.pem_key_cert_pairs.push_back({ReadText(certs.path(who + ".key")), ReadText(certs.path(who + ".pem"))});
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::SslServerCredentials(ssl), &port);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  REQUIRE(port > 0);
  *address = absl::StrCat("127.0.0.1:", port);
  return server;
}

grpc::Status RelayPeer::Offer(grpc::ServerContext*, const peer::v1::OfferRequest* req, peer::v1::OfferResponse* resp) {
  grpc::ClientContext ctx;
  return real_->Offer(&ctx, *req, resp);
}

grpc::Status RelayPeer::Read(grpc::ServerContext*, const peer::v1::ReadRequest* req, peer::v1::ReadResponse* resp) {
  grpc::ClientContext ctx;
  return real_->Read(&ctx, *req, resp);
}

grpc::Status RelayPeer::Release(grpc::ServerContext*, const peer::v1::ReleaseRequest* req,
                                peer::v1::ReleaseResponse* resp) {
  grpc::ClientContext ctx;
  return real_->Release(&ctx, *req, resp);
}

grpc::Status HostilePeer::Offer(grpc::ServerContext* ctx, const peer::v1::OfferRequest* req,
                                peer::v1::OfferResponse* resp) {
  grpc::Status s = RelayPeer::Offer(ctx, req, resp);
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

grpc::Status HostilePeer::Read(grpc::ServerContext* ctx, const peer::v1::ReadRequest* req,
                               peer::v1::ReadResponse* resp) {
  if (mode.load() == kReleaseFirst) (void)kvd::testing::Release(real(), req->lease());
  grpc::Status s = RelayPeer::Read(ctx, req, resp);
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

}  // namespace kvd::testing
