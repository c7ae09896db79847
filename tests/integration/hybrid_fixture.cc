#include "tests/integration/hybrid_fixture.h"

#include <catch2/catch.hpp>
#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "kvd/v1/kvd.grpc.pb.h"

namespace kvd::testing {

std::string HybridTierConfig(const std::string& tiers, int window) {
  return absl::StrCat(
      "pools:\n"
      "  - name: hy\n"
      "    block_tokens: 4\n"
      "    num_layers: 4\n"
      "    bytes_per_token_per_layer: 16\n"
      "    max_model_len: 64\n"
      "    step_tokens: 8\n"
      "    groups:\n"
      "      - {name: full, kind: full, layers: [\"1-3/2\"], capacity_blocks: 32}\n"
      "      - {name: swa, kind: sliding_window, layers: [0], window: ",
      window,
      ", capacity_blocks: 24}\n"
      "      - {name: rec, kind: state, layers: [2], bytes_per_state: 100, checkpoint_every_blocks: 2, "
      "capacity_slots: 6}\n"
      "tiers:\n",
      tiers);
}

std::vector<Token> Concat(std::vector<Token> a, const std::vector<Token>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::string UnitBytes(const client::PoolView& pool, const std::string& group, int64_t unit) {
  auto view = client::GroupKv(pool, group);
  REQUIRE(view.ok());
  const int64_t local = view->Local(unit);
  REQUIRE(local >= 0);
  std::string out;
  for (int32_t j = 0; j < static_cast<int32_t>(view->layers.size()); ++j) {
    out.append(reinterpret_cast<const char*>(view->Unit(j, local)), static_cast<size_t>(view->layer_unit_bytes));
  }
  return out;
}

void Fill(const client::PoolView& pool, const std::string& group, int64_t unit, uint32_t seed) {
  auto view = client::GroupKv(pool, group);
  REQUIRE(view.ok());
  const int64_t local = view->Local(unit);
  REQUIRE(local >= 0);
  for (int32_t j = 0; j < static_cast<int32_t>(view->layers.size()); ++j) {
    uint8_t* p = view->Unit(j, local);
    for (int64_t i = 0; i < view->layer_unit_bytes; ++i) p[i] = static_cast<uint8_t>(seed * 131 + j * 17 + i * 7);
  }
}

Unit8 PublishEight(client::Client& c, uint32_t seed) {
  auto pool = c.FindPool("hy");
  REQUIRE(pool.ok());
  auto req = c.Start(PoolRequest("writer", Concat(Range(1, 8), Range(100, 9)), 0, "hy"));
  REQUIRE(req.ok());
  client::KvRequest& r = **req;
  REQUIRE(r.cached_tokens() == 0);
  const GroupTable full = *r.group_table("full");
  const GroupTable swa = *r.group_table("swa");
  REQUIRE(swa.first_block_position == 0);
  const BlockIndex spare = r.group_table("rec")->blocks[1];
  Unit8 u;
  for (int i = 0; i < 2; ++i) {
    Fill(**pool, "full", full.blocks[i], seed + i);
    Fill(**pool, "swa", swa.blocks[i], seed + 10 + i);
    u.full[i] = UnitBytes(**pool, "full", full.blocks[i]);
    u.swa[i] = UnitBytes(**pool, "swa", swa.blocks[i]);
  }
  Fill(**pool, "rec", spare, seed + 20);
  u.rec = UnitBytes(**pool, "rec", spare);
  absl::StatusOr<PublishResult> published = r.Publish(Range(1, 8), std::vector<StateCheckpoint>{{kRec, 8, spare}});
  REQUIRE(published.ok());
  REQUIRE(published->checkpoint_outcomes == std::vector<CheckpointOutcome>{CheckpointOutcome::kKept});
  REQUIRE(r.Release(true).ok());
  return u;
}

int64_t ReadBack(client::Client& c, const std::string& id, const Unit8& u) {
  auto pool = c.FindPool("hy");
  REQUIRE(pool.ok());
  auto req = c.Start(PoolRequest(id, Concat(Range(1, 8), Range(500, 9)), 0, "hy"));
  REQUIRE(req.ok());
  client::KvRequest& r = **req;
  const int64_t hit = r.cached_tokens();
  REQUIRE((hit == 0 || hit == 8));
  if (hit == 8) {
    const GroupTable* full = r.group_table("full");
    const GroupTable* swa = r.group_table("swa");
    const GroupTable* rec = r.group_table("rec");
    REQUIRE((full != nullptr && swa != nullptr && rec != nullptr));
    REQUIRE(swa->first_block_position == 0);
    REQUIRE(swa->blocks.size() >= 2);
    for (int i = 0; i < 2; ++i) {
      CHECK(UnitBytes(**pool, "full", full->blocks[i]) == u.full[i]);
      CHECK(UnitBytes(**pool, "swa", swa->blocks[i]) == u.swa[i]);
    }
    REQUIRE(rec->checkpoint_slot >= 0);
    CHECK(UnitBytes(**pool, "rec", rec->checkpoint_slot) == u.rec);
  } else {
    CHECK(r.group_table("rec")->checkpoint_slot == -1);
  }
  REQUIRE(r.Release(true).ok());
  return hit;
}

v1::ReportResponse Report(const DaemonProcess& d) {
  auto stub = v1::Kvd::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::ReportResponse r;
  REQUIRE(stub->Report(&ctx, v1::ReportRequest(), &r).ok());
  return r;
}

}  // namespace kvd::testing
