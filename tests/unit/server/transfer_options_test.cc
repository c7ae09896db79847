// The transfer section's checks, and the puller's comparison of an offered geometry with its own:
// an operator's typo or a mismatched peer is named, field and values.
#include <catch2/catch.hpp>

#include "server/transfer/peer_puller.h"
#include "server/transfer/transfer_options.h"

namespace kvd {
namespace {

TransferOptions Valid() {
  TransferOptions t;
  t.listen = "10.0.0.1:7070";
  t.tls_cert_file = "/etc/kvd/peer.pem";
  t.tls_key_file = "/etc/kvd/peer.key";
  t.tls_ca_file = "/etc/kvd/ca.pem";
  t.peers = {{"node-b", "10.0.0.2:7070"}};
  return t;
}

std::string Error(const TransferOptions& t) { return std::string(t.Validate().message()); }

TEST_CASE("The transfer section names what is wrong", "[config][transfer]") {
  CHECK(Valid().Validate().ok());
  CHECK(TransferOptions().Validate().ok());  // off
  TransferOptions t = Valid();
  t.listen.clear();
  CHECK(Error(t) == "transfer.peers and transfer.allowed_peers need transfer.listen");
  t = Valid();
  t.tls_ca_file.clear();
  CHECK(Error(t).find("transfer.tls_ca_file is required") == 0);
  t = Valid();
  t.peers.push_back({"node-b", "10.0.0.3:7070"});
  CHECK(Error(t) == "transfer.peers: peer 'node-b' is listed twice");
  t = Valid();
  t.peers[0].address = "10.0.0.2";
  CHECK(Error(t) == "transfer.peers: peer 'node-b' needs an address HOST:PORT, not '10.0.0.2'");
  t = Valid();
  t.lease = absl::Minutes(5);
  CHECK(Error(t) == "transfer.lease must be in (0, 1m], not 5m");
  t = Valid();
  t.max_leases = 0;
  CHECK(Error(t) == "transfer.max_leases must be >= 1, not 0");
  t = Valid();
  CHECK(t.AllowedNames() == std::vector<std::string>{"node-b"});
  t.allowed_peers = {"node-c"};
  CHECK(t.AllowedNames() == std::vector<std::string>{"node-c"});
}

TEST_CASE("An offered geometry must equal the pool's, field by field", "[config][transfer]") {
  PoolGeometry g;
  g.name = "llama";
  g.kv.dtype = "bfloat16";
  g.kv.kv_heads = 8;
  g.kv.head_dim = 128;
  g.kv.arrangement = "kv_token_head_dim";
  g.bytes_per_token_per_layer = 2 * 8 * 128 * 2;
  peer::v1::Geometry o;
  o.set_block_tokens(g.block_tokens);
  o.set_num_layers(g.num_layers);
  o.set_bytes_per_token_per_layer(g.bytes_per_token_per_layer);
  o.set_capacity_blocks(g.capacity_blocks);
  o.set_num_shards(g.num_shards);
  o.set_layout(PoolLayoutName(g.layout));
  o.set_kv_dtype("bfloat16");
  o.set_kv_heads(8);
  o.set_head_dim(128);
  o.set_kv_arrangement("kv_token_head_dim");
  CHECK(CheckOfferedGeometry(g, o).ok());
  peer::v1::Geometry d = o;
  d.set_kv_dtype("float16");
  CHECK(CheckOfferedGeometry(g, d).message() == "the peer's pool differs in kv.dtype: float16 there, bfloat16 here");
  d = o;
  d.set_capacity_blocks(g.capacity_blocks + 1);
  CHECK(absl::IsFailedPrecondition(CheckOfferedGeometry(g, d)));
  CHECK(std::string(CheckOfferedGeometry(g, d).message()).find("capacity_blocks") != std::string::npos);
  d = o;
  d.set_layout("block_major");
  CHECK(CheckOfferedGeometry(g, d).message() == "the peer's pool differs in layout: block_major there, layer_major here");
}

TEST_CASE("An offer from a pool of another model fingerprint is refused, naming both", "[config][transfer]") {
  PoolGeometry g;
  g.name = "llama";
  g.model_fingerprint = "llama-3.1-8b@v2";
  peer::v1::Geometry o;
  o.set_block_tokens(g.block_tokens);
  o.set_num_layers(g.num_layers);
  o.set_bytes_per_token_per_layer(g.bytes_per_token_per_layer);
  o.set_capacity_blocks(g.capacity_blocks);
  o.set_num_shards(g.num_shards);
  o.set_layout(PoolLayoutName(g.layout));
  o.set_model_fingerprint("llama-3.1-8b@v2");
  CHECK(CheckOfferedGeometry(g, o).ok());
  o.set_model_fingerprint("llama-3.1-8b@v1");  // same name and shape, other weights
  CHECK(absl::IsFailedPrecondition(CheckOfferedGeometry(g, o)));
  CHECK(CheckOfferedGeometry(g, o).message() ==
        "the peer's pool differs in model_fingerprint: 'llama-3.1-8b@v1' there, 'llama-3.1-8b@v2' here");
  o.set_model_fingerprint("");  // a peer that declares none cannot vouch for its weights
  CHECK(!CheckOfferedGeometry(g, o).ok());
  g.model_fingerprint.clear();  // neither declares one: shape alone, as before
  CHECK(CheckOfferedGeometry(g, o).ok());
}

}  // namespace
}  // namespace kvd
