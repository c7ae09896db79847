// Who may write a request's blocks (block_ledger.h): the request from hand-out to publish or
// release, whatever path handed them out (Acquire, a grow, credit adopted, a resume); a pull alone
// between PinBlocks and UnpinBlocks; nobody once cached or free. And the invariant checker sees a
// block that reaches another request around the ledger.
#include <catch2/catch.hpp>

#include <optional>

#include "server/core/kv_cache.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using namespace kvd::testing;

void RequireOk(const absl::Status& s) {
  INFO(s.ToString());
  REQUIRE(s.ok());
}

// The writer of `b` in pool 0; REQUIREs it is a request of `worker`, and returns its epoch.
uint64_t RequestWriter(const KvCache& cache, BlockIndex b, const WorkerId& worker) {
  std::optional<Owner> w = cache.WriterForTesting(0, b);
  INFO("block " << b);
  REQUIRE(w.has_value());
  REQUIRE(w->kind == OwnerKind::kRequest);
  REQUIRE(w->attachment == worker);
  REQUIRE(w->epoch > 0);
  return w->epoch;
}

TEST_CASE("A request writes its blocks from hand-out to publish or release, under its own epoch", "[core][ledger]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  const WorkerId w("w0");
  const std::vector<Token> prompt = Seq(1, 10);  // 2 full blocks and 2 tokens
  RequestSpec r1 = Spec("r1", prompt, 8);
  AcquireResult acq = Start(*cache, r1);
  REQUIRE(acq.blocks.size() == 3);
  const uint64_t e1 = RequestWriter(*cache, acq.blocks[0], w);
  for (BlockIndex b : acq.blocks) CHECK(RequestWriter(*cache, b, w) == e1);

  // Credit adopted by a grow: the same worker writes it, now as the request.
  std::vector<CreditHeld> held;
  cache->Step(w, w, {}, {CreditWant{0, 2, {}}}, &held);
  REQUIRE(held.size() == 1);
  REQUIRE(held[0].blocks.size() == 2);
  const BlockIndex c = held[0].blocks[0];
  REQUIRE(cache->WriterForTesting(0, c)->kind == OwnerKind::kCredit);
  StepOp grow;
  grow.kind = StepOpKind::kGrow;
  grow.id = r1.id;
  grow.tokens = 4;  // 14 tokens: a 4th block
  grow.credit_blocks = {c};
  std::vector<StepOpResult> out = cache->Step(w, w, {grow}, {}, nullptr);
  RequireOk(out[0].status);
  REQUIRE(out[0].blocks == std::vector<BlockIndex>{c});
  CHECK(RequestWriter(*cache, c, w) == e1);
  CHECK(cache->WriterForTesting(0, held[0].blocks[1])->kind == OwnerKind::kCredit);
  RequireInvariants(*cache);

  // Published blocks are immutable: nobody writes them.
  PublishAll(*cache, r1, prompt, acq);
  CHECK_FALSE(cache->WriterForTesting(0, acq.blocks[0]).has_value());
  CHECK_FALSE(cache->WriterForTesting(0, acq.blocks[1]).has_value());
  CHECK(RequestWriter(*cache, acq.blocks[2], w) == e1);

  // Interrupted with a checkpoint: its blocks are kept, and written by nobody until resumed.
  RequireOk(cache->Checkpoint(r1.id, Seq(1, 10), "state"));
  RequireOk(cache->Release(r1.id, /*completed=*/false));
  for (BlockIndex b : acq.blocks) CHECK_FALSE(cache->WriterForTesting(0, b).has_value());
  CHECK_FALSE(cache->WriterForTesting(0, c).has_value());
  RequireInvariants(*cache);

  RequestSpec r2 = Spec("r2", prompt, 8);
  r2.resume_from = r1.id;
  AcquireResult resumed = Start(*cache, r2);
  REQUIRE(resumed.resumed);
  const uint64_t e2 = RequestWriter(*cache, resumed.blocks[2], w);
  CHECK(e2 != e1);  // a new epoch: nothing of r1's grant speaks for r2
  RequireInvariants(*cache);
  RequireOk(cache->Release(r2.id, /*completed=*/true));
  for (BlockIndex b : resumed.blocks) CHECK_FALSE(cache->WriterForTesting(0, b).has_value());
  RequireInvariants(*cache);
}

TEST_CASE("A pull writes a request's blocks alone until UnpinBlocks, and they go to nobody else", "[core][ledger]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(8), &clock);
  const WorkerId w("w0");
  const std::vector<Token> prompt = Seq(1, 12);  // 3 blocks
  RequestSpec r1 = Spec("r1", prompt);
  AcquireResult acq = Start(*cache, r1);
  const uint64_t e1 = RequestWriter(*cache, acq.blocks[0], w);

  RequireOk(cache->PinBlocks(r1.id, acq.blocks));
  std::optional<Owner> pull = cache->WriterForTesting(0, acq.blocks[2]);
  REQUIRE(pull.has_value());
  CHECK(pull->kind == OwnerKind::kPull);
  CHECK(pull->epoch != e1);
  RequireInvariants(*cache);
  // One writer: a second pull cannot take them, nor may the worker publish what the pull writes.
  CHECK(absl::IsFailedPrecondition(cache->PinBlocks(r1.id, acq.blocks)));
  CHECK(absl::IsFailedPrecondition(
      cache->Publish(r1.id, prompt, {acq.blocks[0], acq.blocks[1]}).status()));
  // The pull publishes what it wrote; the rest goes back to the request when it unpins.
  RequireOk(cache->AdoptPromoted(r1.id, 8));
  CHECK_FALSE(cache->WriterForTesting(0, acq.blocks[0]).has_value());
  CHECK_FALSE(cache->WriterForTesting(0, acq.blocks[1]).has_value());
  CHECK(cache->WriterForTesting(0, acq.blocks[2])->kind == OwnerKind::kPull);
  RequireInvariants(*cache);
  cache->UnpinBlocks(0, acq.blocks);
  CHECK(RequestWriter(*cache, acq.blocks[2], w) == e1);
  RequireInvariants(*cache);

  // The request ends while a pull still writes its block: the block stays the pull's, and no
  // other request is handed it until the pull is done.
  const BlockIndex pulled = acq.blocks[2];
  RequireOk(cache->PinBlocks(r1.id, {pulled}));
  RequireOk(cache->Release(r1.id, /*completed=*/true));
  CHECK(cache->WriterForTesting(0, pulled)->kind == OwnerKind::kPull);
  RequireInvariants(*cache);
  for (int i = 0; i < 5; ++i) {  // the other 5 blocks (the first two stay cached; evicted as needed)
    RequestSpec other = Spec("o" + std::to_string(i), Seq(1000 * (i + 1), 4));
    auto admitted = cache->Admit(other);
    REQUIRE(admitted.ok());
    if (admitted->decision != AdmitDecision::kAdmitted) break;
    auto got = cache->Acquire(other.id);
    if (!got.ok()) break;
    for (BlockIndex b : got->blocks) CHECK(b != pulled);
  }
  RequireInvariants(*cache);
  cache->UnpinBlocks(0, {pulled});
  CHECK_FALSE(cache->WriterForTesting(0, pulled).has_value());
  RequireInvariants(*cache);
}

TEST_CASE("The invariant checker sees a block handed to another request around the ledger", "[core][ledger]") {
  FakeClock clock;
  auto cache = MakeCache(SmallOptions(), &clock);
  RequestSpec r1 = Spec("r1", Seq(1, 8));
  RequestSpec r2 = Spec("r2", Seq(100, 4), 8);  // reserves 3 blocks, holds 1
  Start(*cache, r1);
  Start(*cache, r2);
  RequireInvariants(*cache);
  // BlockState, the tables and the references all agree afterwards: only the ledger still says
  // r1 writes the block.
  RequireOk(cache->HandBlockBypassingLedgerForTesting(r1.id, r2.id));
  absl::Status s = cache->CheckInvariantsForTesting();
  INFO(s.ToString());
  CHECK(absl::IsInternal(s));
  CHECK(s.message().find("ledger") != absl::string_view::npos);
}

}  // namespace
}  // namespace kvd
