#include "server/transfer/transfer_options.h"

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace kvd {


std::vector<std::string> TransferOptions::AllowedNames() const {
  if (!allowed_peers.empty()) return allowed_peers;
  std::vector<std::string> names;
  for (const TransferPeer& p : peers) names.push_back(p.name);
  return names;
}

absl::Status TransferOptions::Validate() const {
  if (!enabled()) {
    if (!peers.empty() || !allowed_peers.empty()) {
      return absl::InvalidArgumentError("transfer.peers and transfer.allowed_peers need transfer.listen");
    }
    return absl::OkStatus();
  }
  if (listen.find(':') == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("transfer.listen must be HOST:PORT, not '", listen, "'"));
  }
  for (const auto& [field, value] : {std::pair<const char*, const std::string&>{"tls_cert_file", tls_cert_file},
                                     {"tls_key_file", tls_key_file},
                                     {"tls_ca_file", tls_ca_file}}) {
    if (value.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "transfer.", field, " is required: peers authenticate each other with mutual TLS (docs/transfer.md)"));
    }
  }
  absl::flat_hash_set<std::string> names;
  for (const TransferPeer& p : peers) {
    if (p.name.empty()) return absl::InvalidArgumentError("transfer.peers: a peer without a name");
    if (p.address.find(':') == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("transfer.peers: peer '", p.name, "' needs an address HOST:PORT, not '", p.address, "'"));
    }
    if (!names.insert(p.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("transfer.peers: peer '", p.name, "' is listed twice"));
    }
  }
  for (const std::string& a : allowed_peers) {
    if (a.empty() || a == "uri:") {
      return absl::InvalidArgumentError(absl::StrCat("transfer.allowed_peers: an empty name ('", a, "')"));
    }
  }
  if (pull_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("transfer.pull_timeout must be positive, not ",
                                                   absl::FormatDuration(pull_timeout)));
  }
  if (lease <= absl::ZeroDuration() || lease > absl::Minutes(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("transfer.lease must be in (0, 1m], not ", absl::FormatDuration(lease)));
  }
  if (max_leases < 1) return absl::InvalidArgumentError(absl::StrCat("transfer.max_leases must be >= 1, not ", max_leases));
  if (pull_threads < 1 || pull_threads > 64) {
    return absl::InvalidArgumentError(absl::StrCat("transfer.pull_threads must be in [1, 64], not ", pull_threads));
  }
  return absl::OkStatus();
}

}  // namespace kvd
