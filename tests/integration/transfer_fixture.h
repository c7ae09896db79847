// The fixture of the peer transfer tests (transfer_test.cc, transfer_hybrid_test.cc): a CA and
// certificates made with openssl for the Peer service's mutual TLS, daemon configs with a
// transfer section, a worker's prompts and the bytes it writes for them, raw Peer calls as a
// chosen peer, and Peer services in this process that relay to a real daemon, honestly or not.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "client/client.h"
#include "kvd/peer/v1/peer.grpc.pb.h"
#include "tests/integration/harness.h"

namespace kvd::testing {

// Tokens per block of the pool "default" that NodeConfig makes.
inline constexpr int kBlockTokens = 16;

// The whole text of the file at `path`.
std::string ReadText(const std::string& path);

// A CA, and a certificate it signed for each name (CN and DNS subjectAltName); and, for the
// allow-list, certificates whose CN or other subjectAltName kinds say a name their DNS names do
// not: file stem -> (CN, subjectAltName extension or "" for none).
struct Certs {
  TempDir dir;
  bool ok = false;  // false when openssl failed: the test says so and returns
  static const std::vector<std::tuple<std::string, std::string, std::string>>& Odd();
  Certs();
  std::string path(const std::string& file) const { return dir.path() + "/" + file; }
};

// Peers a node pulls from: (name, HOST:PORT).
using PeerAddresses = std::vector<std::pair<std::string, std::string>>;

// The transfer section for `name` (its certificate), listening on 127.0.0.1:0, with `extra`
// lines, `allowed` as allowed_peers when not empty, and `peers` to pull from.
std::string TransferSection(const Certs& certs, const std::string& name, const PeerAddresses& peers,
                            const std::string& allowed = "", const std::string& extra = "");

// A pool of 16-token blocks of 2 layers x `bytes_per_token_per_layer`, and a transfer section
// for `name`, pulling from `peers` (name, address).
std::string NodeConfig(const Certs& certs, const std::string& name, const PeerAddresses& peers,
                       const std::string& allowed = "", int64_t bytes_per_token_per_layer = 64,
                       int capacity_blocks = 256, const std::string& extra = "");

// The byte a worker writes at `offset` of layer `layer` of prompt block `position`.
uint8_t Pattern(uint32_t seed, int64_t position, int32_t layer, int64_t offset);

// A worker client of `d` named `name`; REQUIREs it connects.
std::unique_ptr<client::Client> Connect(const DaemonProcess& d, const std::string& name);

// Prompt `seed`: `blocks` full blocks and one more token.
std::vector<Token> Prompt(uint32_t seed, int blocks);

// Writes Pattern(seed, ...) into blocks [first, first + count) of `r`, every layer.
void WriteBlocks(client::Client& c, const client::KvRequest& r, int64_t first, int64_t count, uint32_t seed);

// Whether the first `count` blocks of `r` hold what WriteBlocks wrote for `seed`.
bool BlocksExact(client::Client& c, const client::KvRequest& r, int64_t count, uint32_t seed);

// A worker of `d` computes `blocks` blocks of prompt `seed` and publishes them.
void Prefill(client::Client& c, const std::string& id, uint32_t seed, int blocks);

// B's worker starts prompt `seed` naming `peer`; answers the cached tokens, and whether the bytes
// of the cached blocks are exact.
std::pair<int64_t, bool> PullStart(client::Client& c, const std::string& id, uint32_t seed, int blocks,
                                   const std::string& peer);

// How many tokens of prompt `seed` the node of `c` holds cached in pool "default".
int64_t Cached(client::Client& c, uint32_t seed, int blocks);

// A's leases once the pullers' Releases landed: they go out after each start is answered, so a
// test waits for them (up to 10 s) rather than reading the gauge at once.
int64_t LeasesSettled(const DaemonProcess& a);

// Channel credentials trusting the test CA, presenting `who`'s certificate (empty: none).
std::shared_ptr<grpc::ChannelCredentials> PeerCredentials(const Certs& certs, const std::string& who);

// A raw stub to `d`'s Peer service, as `who` (empty: no client certificate).
std::unique_ptr<peer::v1::Peer::Stub> PeerStub(const Certs& certs, const DaemonProcess& d,
                                               const std::string& server_name, const std::string& who);

// Raw Peer calls. Release answers the status code; Read and Offer (of prompt `seed`, pool
// "default") have a 5 s deadline.
grpc::StatusCode Release(peer::v1::Peer::Stub& stub, uint64_t lease);
grpc::Status Read(peer::v1::Peer::Stub& stub, uint64_t lease, int64_t first, int64_t count,
                  peer::v1::ReadResponse* resp);
grpc::Status Offer(peer::v1::Peer::Stub& stub, uint32_t seed, int blocks, int64_t lease_ms,
                   peer::v1::OfferResponse* resp);

// Serves `service` in this process under TLS, presenting `who`'s certificate and requiring one
// the CA signed; REQUIREs it listens. `*address` is where a node finds it (127.0.0.1:PORT).
std::unique_ptr<grpc::Server> ServePeer(const Certs& certs, const std::string& who, grpc::Service* service,
                                        std::string* address);

// A Peer service in this process that relays every call to a real daemon's (`real`: a stub as a
// peer that daemon allows). Subclasses change what goes through.
class RelayPeer : public peer::v1::Peer::Service {
 public:
  explicit RelayPeer(std::unique_ptr<peer::v1::Peer::Stub> real) : real_(std::move(real)) {}
  grpc::Status Offer(grpc::ServerContext*, const peer::v1::OfferRequest* req, peer::v1::OfferResponse* resp) override;
  grpc::Status Read(grpc::ServerContext*, const peer::v1::ReadRequest* req, peer::v1::ReadResponse* resp) override;
  grpc::Status Release(grpc::ServerContext*, const peer::v1::ReleaseRequest* req,
                       peer::v1::ReleaseResponse* resp) override;

 protected:
  peer::v1::Peer::Stub& real() { return *real_; }

 private:
  std::unique_ptr<peer::v1::Peer::Stub> real_;
};

// A peer that answers with A's real offers and reads, corrupted as `mode` says (0: honestly).
class HostilePeer final : public RelayPeer {
 public:
  using RelayPeer::RelayPeer;
  std::atomic<int> mode{0};
  enum Mode {
    kGeometry = 1, kLayout, kCount, kChecksum, kShortBlock, kLongBlock, kExtraBlock, kNoBlock, kFlipByte, kSwap,
    // Hybrid pools: the unit's last component (a checkpoint) left out of the offer; a depth that
    // does not match the components; the lease let go before the reads (the lender may evict).
    kDropLast, kDepth, kReleaseFirst
  };

  grpc::Status Offer(grpc::ServerContext* ctx, const peer::v1::OfferRequest* req,
                     peer::v1::OfferResponse* resp) override;
  grpc::Status Read(grpc::ServerContext* ctx, const peer::v1::ReadRequest* req, peer::v1::ReadResponse* resp) override;
};

}  // namespace kvd::testing
