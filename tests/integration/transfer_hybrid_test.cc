// Peer transfer of hybrid pools (docs/hybrid.md §2.9, "peers"): a hit travels as one unit of
// every group's components. Two real kvd daemons on loopback under mutual TLS (the fixture of
// transfer_test.cc): a unit pulled bit-exact per group and hit locally after, a node with another
// window refused naming the group, and a hostile peer (a proxy in this process) dropping the
// checkpoint, lying about depth, corrupting components or releasing its lease mid-pull: nothing
// cached, nothing owned. Pool "hy": 4-token blocks, full attention in layers 1 and 3, a window of
// 6 in layer 0, a recurrent state in layer 2 checkpointed every 2 blocks; step_tokens 8, so a
// start's window table reaches 2 blocks past its hit and a deeper unit lands partly past it.
#include <cstring>

#include <catch2/catch.hpp>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "tests/integration/harness.h"
#include "tests/integration/transfer_fixture.h"

namespace kvd {
namespace {

using namespace kvd::testing;
using client::Client;
using client::KvRequest;

constexpr int kHyBlock = 4;
constexpr int kHyBlocks = 8;  // the prefill's prompt: 8 blocks and one token

std::string HybridNodeConfig(const Certs& certs, const std::string& name, const PeerAddresses& peers,
                             const std::string& allowed = "", int window = 6) {
  return absl::StrCat(
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
      "capacity_slots: 6}\n",
      TransferSection(certs, name, peers, allowed));
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
  std::string evil;
  std::unique_ptr<grpc::Server> server = ServePeer(certs, "evil", &hostile, &evil);
  DaemonProcess b(HybridNodeConfig(certs, "node-b", {{"evil", evil}}));
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
