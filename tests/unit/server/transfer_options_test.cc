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


TEST_CASE("An offer of a hybrid pool is compared group by group, naming the group and field", "[config][transfer]") {
  PoolGeometry g;
  g.name = "hy";
  g.block_tokens = 4;
  g.num_layers = 4;
  g.bytes_per_token_per_layer = 16;
  g.max_model_len = 64;
  g.groups.push_back(KvGroup{.name = "full", .kind = KvGroupKind::kFull, .layers = {1, 3}, .capacity = 40});
  g.groups.push_back(KvGroup{.name = "swa", .kind = KvGroupKind::kSlidingWindow, .layers = {0}, .window = 6, .capacity = 24});
  g.groups.push_back(KvGroup{.name = "rec", .kind = KvGroupKind::kState, .layers = {2}, .bytes_per_state = 100,
                             .checkpoint_every_blocks = 2, .capacity = 6});
  REQUIRE(g.ResolveGroups().ok());
  const auto offered = [](const PoolGeometry& p) {
    peer::v1::Geometry o;
    o.set_block_tokens(p.block_tokens);
    o.set_num_layers(p.num_layers);
    o.set_bytes_per_token_per_layer(p.bytes_per_token_per_layer);
    o.set_capacity_blocks(p.capacity_blocks);
    o.set_num_shards(p.num_shards);
    o.set_layout(PoolLayoutName(p.layout));
    for (const KvGroup& k : p.groups) {
      peer::v1::GroupGeometry* x = o.add_groups();
      x->set_name(k.name);
      x->set_kind(KvGroupKindName(k.kind));
      x->mutable_layers()->Add(k.layers.begin(), k.layers.end());
      x->set_bytes_per_token(k.attention() ? p.bytes_per_token_per_layer : 0);
      x->set_bytes_per_state(k.bytes_per_state);
      x->set_window(k.window);
      x->set_chunk(k.chunk);
      x->set_checkpoint_every_blocks(k.checkpoint_every_blocks);
      x->set_checkpoint_at_end(!k.attention() && k.checkpoint_at_end);
    }
    return o;
  };
  const peer::v1::Geometry o = offered(g);
  CHECK(CheckOfferedGeometry(g, o).ok());
  peer::v1::Geometry d = o;
  d.set_capacity_blocks(o.capacity_blocks() + 8);  // another split of the same groups
  CHECK(CheckOfferedGeometry(g, d).ok());
  d = o;
  d.mutable_groups(1)->set_window(7);
  CHECK(CheckOfferedGeometry(g, d).message() ==
        "the peer's pool differs in group 'swa' (groups[1]) field window: 7 there, 6 here");
  d = o;
  d.mutable_groups(2)->set_bytes_per_state(128);
  CHECK(CheckOfferedGeometry(g, d).message() ==
        "the peer's pool differs in group 'rec' (groups[2]) field bytes_per_state: 128 there, 100 here");
  d = o;
  d.mutable_groups(2)->set_checkpoint_every_blocks(4);
  CHECK(std::string(CheckOfferedGeometry(g, d).message()).find("group 'rec' (groups[2]) field checkpoint_every_blocks") !=
        std::string::npos);
  d = o;
  d.mutable_groups(0)->set_layers(1, 2);
  CHECK(CheckOfferedGeometry(g, d).message() == "the peer's pool differs in group 'full' (groups[0]) field layers: 1,2 there, 1,3 here");
  d = o;
  d.mutable_groups(1)->set_kind("chunked_local");
  CHECK(std::string(CheckOfferedGeometry(g, d).message()).find("field kind: chunked_local there, sliding_window here") !=
        std::string::npos);
  d = o;
  d.mutable_groups()->RemoveLast();  // a peer without the state group
  CHECK(CheckOfferedGeometry(g, d).message() == "the peer's pool differs in its KV groups: [full, swa] there, [full, swa, rec] here");
  d = o;
  d.clear_groups();  // a pool without groups under the same name
  CHECK(absl::IsFailedPrecondition(CheckOfferedGeometry(g, d)));
  PoolGeometry plain = g;  // and the other way round: this node's pool has no groups
  plain.groups.clear();
  CHECK(CheckOfferedGeometry(plain, o).message() ==
        "the peer's pool differs in its KV groups: [full, swa, rec] there, [] here");
}
}  // namespace
}  // namespace kvd
