// Block credit per (pool, group) on a hybrid pool against the real daemon (docs/hybrid.md §2.4,
// docs/api.md "Steps"): the C++ StepBatch places each group's credit itself, so a decode step
// that stays within credit makes no round trip and its tables are exactly kvd's; a hostile raw
// client naming credit of another group, credit it does not hold, or credit past the window's
// horizon is refused INVALID_ARGUMENT naming the group, and nothing changes; detach gives every
// group's credit back.
#include <catch2/catch.hpp>
#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/step.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "tests/integration/harness.h"
#include "tests/integration/raw_attachment.h"

namespace kvd::testing {
namespace {

// Four layers: full attention in 1 and 3, a 6-token window in 0, recurrent state in 2; step_tokens 8.
std::string CreditPool() {
  return "pools:\n"
         "  - name: hy\n"
         "    block_tokens: 4\n"
         "    num_layers: 4\n"
         "    bytes_per_token_per_layer: 16\n"
         "    max_model_len: 64\n"
         "    step_tokens: 8\n"
         "    groups:\n"
         "      - {name: full, kind: full, layers: [\"1-3/2\"], capacity_blocks: 64}\n"
         "      - {name: swa, kind: sliding_window, layers: [0], window: 6, capacity_blocks: 48}\n"
         "      - {name: rec, kind: state, layers: [2], bytes_per_state: 100, checkpoint_every_blocks: 2, "
         "capacity_slots: 16}\n";
}
constexpr int kFull = 0, kSwa = 1;

struct Held {
  int64_t owned = 0, reserved = 0;
  int64_t reserved_bytes = 0;
};
Held Counts(client::Client& c) {
  absl::StatusOr<CacheReport> r = c.Report();
  REQUIRE(r.ok());
  for (const PoolReport& p : r->pools) {
    if (p.name == "hy") return {p.owned_blocks, p.reserved_blocks, r->reserved_bytes};
  }
  FAIL("no pool hy");
  return {};
}

TEST_CASE("A hybrid decode places each group's credit itself: no round trip while credit covers it",
          "[integration][hybrid][credit]") {
  DaemonProcess d(CreditPool());
  auto c = client::Client::Connect({.target = d.target(), .step_credit_blocks = 4});
  auto observer = client::Client::Connect({.target = d.target(), .map_slabs = false});
  REQUIRE((c.ok() && observer.ok()));
  auto pool = (*c)->FindPool("hy");
  REQUIRE(pool.ok());
  const PoolId id = (*pool)->id;

  client::StepRequest s;
  client::StepBatch batch;
  batch.Start(&s, PoolRequest("dec", Range(100, 8), 40, "hy"));
  auto answer = (*c)->Step(batch);
  REQUIRE(answer.ok());
  REQUIRE(answer->items[0].status.ok());
  // The first grow goes to kvd (it settles what the start left); its answer brings credit per group.
  batch.Clear();
  batch.Grow(&s, 1, 8);
  answer = (*c)->Step(batch);
  REQUIRE(answer.ok());
  REQUIRE(answer->items[0].status.ok());
  CHECK(answer->sent);
  REQUIRE((*c)->StepCreditBlocks(id, kFull).size() == 4);
  REQUIRE((*c)->StepCreditBlocks(id, kSwa).size() == 4);
  for (BlockIndex b : (*c)->StepCreditBlocks(id, kSwa)) CHECK((*pool)->geometry.GroupOf(b) == kSwa);

  // Decode: one token a step, computed = the tokens before it. Every 4th step crosses a block in
  // both attention groups, placed from credit here; the reporter refills while the engine computes.
  int sent = 0;
  std::vector<BlockIndex> placed;
  for (int step = 0; step < 24; ++step) {
    const std::vector<BlockIndex> before = (*c)->StepCreditBlocks(id, kSwa);
    batch.Clear();
    batch.Grow(&s, 1, s.num_tokens);
    answer = (*c)->Step(batch);
    REQUIRE(answer.ok());
    REQUIRE(answer->items[0].status.ok());
    sent += answer->sent ? 1 : 0;
    const GroupTable* swa = s.group_table("swa");
    if (std::find(before.begin(), before.end(), swa->blocks.back()) != before.end()) placed.push_back(swa->blocks.back());
  }
  CHECK(sent == 0);  // not one of the engine's steps waited for kvd
  CHECK(placed.size() >= 5);  // window blocks came out of credit, not from an answer
  CHECK(s.num_tokens == 33);
  REQUIRE(s.error.ok());
  REQUIRE((*c)->FlushSteps().ok());
  REQUIRE(s.error.ok());  // kvd accepted every placement
  // The tables are kvd's: everything owned is the request's tables, its slots and the credit.
  const GroupTable* full = s.group_table("full");
  const GroupTable* swa = s.group_table("swa");
  CHECK(full->blocks.size() == 9);  // ceil(33 / 4)
  CHECK(full->blocks == s.blocks);
  CHECK(swa->first_block_position == (32 - 5) / 4);
  CHECK(swa->first_block_position + static_cast<int64_t>(swa->blocks.size()) == 9);  // ceil(min(33, 40) / 4)
  // (A refill the reporter sends may still be in flight: its answer settles the client's list.)
  const auto tables_and_credit = [&] {
    return static_cast<int64_t>(full->blocks.size() + swa->blocks.size() + s.group_table("rec")->blocks.size()) +
           (*c)->StepCredit(id);
  };
  for (int i = 0; i < 100 && Counts(**observer).owned != tables_and_credit(); ++i) absl::SleepFor(absl::Milliseconds(20));
  CHECK(Counts(**observer).owned == tables_and_credit());
  // A grow kvd answers checks the tables against its own (INTERNAL on a mismatch).
  batch.Clear();
  batch.Grow(&s, 0, 33);
  batch.End(&s, 0, {}, /*completed=*/true);
  answer = (*c)->Step(batch);
  REQUIRE(answer.ok());
  CHECK(answer->sent);
  REQUIRE(answer->items[0].status.ok());
  REQUIRE(answer->items[1].status.ok());
  CHECK(Counts(**observer).owned == (*c)->StepCredit(id));
  // Detach gives every group's credit back.
  c->reset();
  for (int i = 0; i < 100 && Counts(**observer).owned != 0; ++i) absl::SleepFor(absl::Milliseconds(20));
  const Held idle = Counts(**observer);
  CHECK(idle.owned == 0);
  CHECK(idle.reserved == 0);
  CHECK(idle.reserved_bytes == 0);
}

struct Raw {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Kvd::Stub> stub;
  std::unique_ptr<RawAttachment> attachment;
  uint64_t seq = 0;
  explicit Raw(const DaemonProcess& d)
      : channel(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials())),
        stub(v1::Kvd::NewStub(channel)),
        attachment(AttachByHand(*stub)) {}
  v1::StepResponse Send(v1::StepRequest req) {
    req.set_worker_id(attachment->attached.worker_id());
    req.set_seq(++seq);
    grpc::ClientContext ctx;
    v1::StepResponse resp;
    const grpc::Status s = stub->Step(&ctx, req, &resp);
    INFO(s.error_message());
    REQUIRE(s.ok());
    return resp;
  }
};

TEST_CASE("A hostile client's credit of the wrong group, not its own, or past the window is refused; nothing changes",
          "[integration][hybrid][credit]") {
  DaemonProcess d(CreditPool());
  auto observer = client::Client::Connect({.target = d.target(), .map_slabs = false});
  REQUIRE(observer.ok());
  Raw raw(d);
  v1::StepRequest first;
  v1::StepItem* start = first.add_items();
  start->set_request_id("r");
  v1::AdmitRequest* admit = start->mutable_start()->mutable_admit();
  admit->mutable_namespace_()->set_pool("hy");
  for (int t = 0; t < 12; ++t) admit->add_prompt(static_cast<uint32_t>(500 + t));
  admit->set_max_new_tokens(20);
  v1::StepResponse resp = raw.Send(first);
  REQUIRE(resp.results(0).code() == 0);
  v1::StepRequest ask;
  for (int g : {kFull, kSwa}) {
    v1::CreditWant* w = ask.add_credit();
    w->set_pool("hy");
    w->set_group(g);
    w->set_blocks(4);
  }
  resp = raw.Send(ask);
  REQUIRE(resp.credit_size() == 2);
  std::vector<uint32_t> credit[2];
  for (const v1::StepCredit& c : resp.credit()) {
    REQUIRE((c.group() == kFull || c.group() == kSwa));
    credit[c.group()].assign(c.blocks().begin(), c.blocks().end());
  }
  REQUIRE(credit[kFull].size() == 4);
  REQUIRE(credit[kSwa].size() == 4);
  const auto handle = (*observer)->GetHandle(RequestId("r"));
  REQUIRE(handle.ok());
  const Held before = Counts(**observer);

  // Grow 12 -> 16 with computed 12: the full group appends 1 block, the window group 2 ([1, 4)).
  struct Case {
    const char* what;
    std::vector<std::pair<int, uint32_t>> entries;
    const char* names;
  };
  uint32_t foreign = credit[kSwa][0] + 1;  // a window block that is not this worker's credit
  while (std::find(credit[kSwa].begin(), credit[kSwa].end(), foreign) != credit[kSwa].end()) ++foreign;
  const Case cases[] = {
      {"a window block named as the full group's", {{kFull, credit[kSwa][0]}}, "group 'full'"},
      {"a full block named as the window's", {{kSwa, credit[kFull][0]}}, "group 'swa'"},
      {"a block it does not hold", {{kSwa, foreign}}, "credit of group 'swa'"},
      {"credit past the window horizon",
       {{kSwa, credit[kSwa][0]}, {kSwa, credit[kSwa][1]}, {kSwa, credit[kSwa][2]}},
       "group 'swa'"},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    v1::StepRequest grow;
    v1::StepItem* item = grow.add_items();
    item->set_request_id("r");
    item->mutable_grow()->set_tokens(4);
    item->mutable_grow()->set_computed_tokens(12);
    for (const auto& [g, b] : c.entries) {
      v1::CreditEntry* e = item->mutable_grow()->add_credit();
      e->set_group(g);
      e->set_block(b);
    }
    resp = raw.Send(grow);
    CHECK(resp.results(0).code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(resp.results(0).message(), Catch::Contains(c.names));
    const auto now = (*observer)->GetHandle(RequestId("r"));
    REQUIRE(now.ok());
    CHECK(now->num_tokens == handle->num_tokens);
    CHECK(now->blocks == handle->blocks);
    const Held after = Counts(**observer);
    CHECK(after.owned == before.owned);
    CHECK(after.reserved == before.reserved);
    CHECK(after.reserved_bytes == before.reserved_bytes);
  }
  // credit_blocks without groups on a hybrid pool: refused naming the field.
  v1::StepRequest flat;
  v1::StepItem* item = flat.add_items();
  item->set_request_id("r");
  item->mutable_grow()->set_tokens(4);
  item->mutable_grow()->add_credit_blocks(credit[kFull][0]);
  resp = raw.Send(flat);
  CHECK(resp.results(0).code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(resp.results(0).message(), Catch::Contains("credit_blocks"));
  // A credit asked for a group the pool lacks: the step is refused whole.
  v1::StepRequest bad_group;
  v1::CreditWant* w = bad_group.add_credit();
  w->set_pool("hy");
  w->set_group(5);
  w->set_blocks(1);
  bad_group.set_worker_id(raw.attachment->attached.worker_id());
  bad_group.set_seq(++raw.seq);
  grpc::ClientContext ctx;
  v1::StepResponse ignored;
  const grpc::Status s = raw.stub->Step(&ctx, bad_group, &ignored);
  CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(s.error_message(), Catch::Contains("group 5"));
  --raw.seq;  // not applied
  // The right placement is accepted: the credit is the request's table, in order.
  v1::StepRequest good;
  item = good.add_items();
  item->set_request_id("r");
  item->mutable_grow()->set_tokens(4);
  item->mutable_grow()->set_computed_tokens(12);
  for (const auto& [g, b] : std::vector<std::pair<int, uint32_t>>{
           {kFull, credit[kFull][0]}, {kSwa, credit[kSwa][0]}, {kSwa, credit[kSwa][1]}}) {
    v1::CreditEntry* e = item->mutable_grow()->add_credit();
    e->set_group(g);
    e->set_block(b);
  }
  resp = raw.Send(good);
  INFO(resp.results(0).message());
  REQUIRE(resp.results(0).code() == 0);
  REQUIRE(resp.results(0).group_tables_size() == 3);
  CHECK(std::vector<uint32_t>(resp.results(0).group_tables(kFull).blocks().begin(),
                              resp.results(0).group_tables(kFull).blocks().end()) ==
        std::vector<uint32_t>{credit[kFull][0]});
  CHECK(std::vector<uint32_t>(resp.results(0).group_tables(kSwa).blocks().begin(),
                              resp.results(0).group_tables(kSwa).blocks().end()) ==
        std::vector<uint32_t>{credit[kSwa][0], credit[kSwa][1]});
  // A worker that goes gives every group's credit back, and its request's blocks.
  raw.attachment.reset();
  for (int i = 0; i < 100 && Counts(**observer).owned != 0; ++i) absl::SleepFor(absl::Milliseconds(20));
  CHECK(Counts(**observer).owned == 0);
  CHECK(Counts(**observer).reserved_bytes == 0);
}

}  // namespace
}  // namespace kvd::testing
