// The `transfer:` section of kvd's config: peer transfer between kvds over mutual TLS (docs/transfer.md). Off unless
// `listen` is set.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace kvd {

struct TransferPeer {
  std::string name;     // the name its certificate carries (a DNS subjectAltName, or its CN without any)
  std::string address;  // HOST:PORT of its transfer.listen
};

struct TransferOptions {
  // HOST:PORT the Peer service listens on (mutual TLS; port 0 picks a free one). Empty: off.
  std::string listen;
  // This node's certificate and key (PEM), presented to peers both ways, and the CA bundle that
  // signed every peer's certificate. All three are required.
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_ca_file;
  // Peers this kvd pulls from: a Start's `peer` names one.
  std::vector<TransferPeer> peers;
  // Certificate names allowed to pull from this kvd (PeerNames in peer_service.h: DNS names, the
  // CN of a certificate without subjectAltNames, "uri:VALUE" for a URI). Empty: the names of
  // `peers`.
  std::vector<std::string> allowed_peers;
  // One pull, from Offer to the last checksum; past it the request computes instead.
  absl::Duration pull_timeout = absl::Seconds(10);
  // How long an offer's pins hold without Release.
  absl::Duration lease = absl::Seconds(30);
  // Leases held at once for all peers; an Offer past it is RESOURCE_EXHAUSTED.
  int64_t max_leases = 64;
  // Pulls running at once; more wait their turn.
  int64_t pull_threads = 4;

  bool enabled() const { return !listen.empty(); }
  // The names allowed to pull: allowed_peers, or the names of peers.
  std::vector<std::string> AllowedNames() const;
  // INVALID_ARGUMENT naming the first bad field (transfer.<field>).
  absl::Status Validate() const;
};

}  // namespace kvd
