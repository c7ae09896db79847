// Generation checkpoints, preempt and resume on a hybrid pool, and a hot handoff of one, against
// the real daemon (docs/hybrid.md §2.9, kvd-hybrid step 7): a generation checkpointed on worker A
// with its state resumes on worker B reading A's bytes in every group (full blocks, the window
// before the position, the state as the checkpoint slot); a preempt through a step does the same;
// across --takeover the successor serves the same hit length and bytes and resumes a generation
// live at the handoff once its fence lifts; a resume into another grouping is refused naming it,
// and nothing is left owned or reserved at the end. A flush writes checkpointed and preempted
// generations whole; after a SIGKILL the restarted kvd resumes them exactly, a restart under
// another window restores none, and a record with a flipped byte is never resumed.
#include <signal.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <grpcpp/grpcpp.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "tests/integration/harness.h"
#include "tests/integration/raw_attachment.h"

namespace kvd::testing {
namespace {

constexpr int kRec = 2;

// Four layers: full attention in 1 and 3, a 6-token window in 0, recurrent state in 2 (k = 2);
// and a plain pool "m" beside it (another grouping). `window`: another window is another grouping.
std::string Config(const std::string& top = "", int window = 6) {
  return absl::StrCat(top,
                      "pools:\n"
                      "  - name: hy\n"
                      "    block_tokens: 4\n"
                      "    num_layers: 4\n"
                      "    bytes_per_token_per_layer: 16\n"
                      "    max_model_len: 64\n"
                      "    step_tokens: 8\n"
                      "    groups:\n"
                      "      - {name: full, kind: full, layers: [\"1-3/2\"], capacity_blocks: 40}\n"
                      "      - {name: swa, kind: sliding_window, layers: [0], window: ", window,
                      ", capacity_blocks: 24}\n"
                      "      - {name: rec, kind: state, layers: [2], bytes_per_state: 100, checkpoint_every_blocks: 2, "
                      "capacity_slots: 8}\n"
                      "  - name: m\n"
                      "    block_tokens: 4\n"
                      "    num_layers: 2\n"
                      "    bytes_per_token_per_layer: 16\n"
                      "    max_model_len: 64\n"
                      "    capacity_blocks: 32\n");
}

// What a worker writes into unit `unit` of `group`, layer j: a pattern of the unit and a tag.
std::string Pattern(int64_t bytes, BlockIndex unit, int32_t j, char tag) {
  std::string s(static_cast<size_t>(bytes), '\0');
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>((unit * 131 + j * 17 + i * 7 + tag) & 0xff);
  return s;
}
void Write(client::Client& c, const std::string& group, BlockIndex unit, char tag) {
  auto pool = c.FindPool("hy");
  REQUIRE(pool.ok());
  auto view = client::GroupKv(**pool, group);
  REQUIRE(view.ok());
  for (int32_t j = 0; j < static_cast<int32_t>(view->layers.size()); ++j) {
    const std::string bytes = Pattern(view->layer_unit_bytes, unit, j, tag);
    std::memcpy(view->Unit(j, view->Local(unit)), bytes.data(), bytes.size());
  }
}
// Whether `unit` of `group`, read through `c`'s own mapping, holds what Write(.., `written`, tag) put.
bool Holds(client::Client& c, const std::string& group, BlockIndex unit, BlockIndex written, char tag) {
  auto pool = c.FindPool("hy");
  REQUIRE(pool.ok());
  auto view = client::GroupKv(**pool, group);
  REQUIRE(view.ok());
  bool same = true;
  for (int32_t j = 0; j < static_cast<int32_t>(view->layers.size()); ++j) {
    const std::string bytes = Pattern(view->layer_unit_bytes, written, j, tag);
    same = same && std::memcmp(view->Unit(j, view->Local(unit)), bytes.data(), bytes.size()) == 0;
  }
  return same;
}

RequestSpec Resume(const std::string& id, std::vector<Token> prompt, const std::string& from,
                   const std::string& pool = "hy") {
  RequestSpec s = PoolRequest(id, std::move(prompt), 8, pool);
  s.resume_from = RequestId(from);
  return s;
}

// A generation of 10 prompt tokens on `c`, computed to 10 and written in every group: full blocks
// [0, 3), window blocks [0, 3), the state at 10 in its running slot. Returns the request.
struct Written {
  std::unique_ptr<client::KvRequest> req;
  std::vector<BlockIndex> full, swa;
  BlockIndex state = 0;
};
Written Generate(client::Client& c, const std::string& id, Token first) {
  Written w;
  auto r = c.Start(PoolRequest(id, Range(first, 10), 8, "hy"));
  REQUIRE(r.ok());
  w.req = std::move(*r);
  REQUIRE(w.req->Extend(0, 8).ok());  // reports 8 computed: the window's blocks up to 16 come
  w.full = w.req->group_table("full")->blocks;
  w.swa = w.req->group_table("swa")->blocks;
  REQUIRE(w.req->group_table("swa")->first_block_position == 0);
  REQUIRE(w.swa.size() == 3);
  w.state = w.req->group_table("rec")->blocks[0];
  for (int i = 0; i < 3; ++i) {
    Write(c, "full", w.full[i], 'f');
    Write(c, "swa", w.swa[i], 's');
  }
  Write(c, "rec", w.state, 'r');
  return w;
}

// What the resumed request reads, through `c`: A's bytes in every unit it needs.
void ReadsBack(client::Client& c, const AcquireResult& got, const Written& w, const std::string& what) {
  INFO(what);
  CHECK(got.resumed);
  CHECK(got.cached_tokens == 10);
  const GroupTable* full = nullptr;
  const GroupTable* swa = nullptr;
  const GroupTable* rec = nullptr;
  for (const GroupTable& t : got.group_tables) {
    if (t.name == "full") full = &t;
    if (t.name == "swa") swa = &t;
    if (t.name == "rec") rec = &t;
  }
  REQUIRE((full != nullptr && swa != nullptr && rec != nullptr));
  REQUIRE(full->blocks.size() >= 3);
  for (int i = 0; i < 3; ++i) CHECK(Holds(c, "full", full->blocks[i], w.full[i], 'f'));
  // A computation at 10 reads positions 5..9: window blocks 1 and 2.
  CHECK(swa->first_block_position == 1);
  REQUIRE(swa->blocks.size() >= 2);
  CHECK(Holds(c, "swa", swa->blocks[0], w.swa[1], 's'));
  CHECK(Holds(c, "swa", swa->blocks[1], w.swa[2], 's'));
  REQUIRE(rec->checkpoint_slot >= 0);
  CHECK(Holds(c, "rec", static_cast<BlockIndex>(rec->checkpoint_slot), w.state, 'r'));
  CHECK(rec->blocks.size() == 1);  // the running slot to copy it into
}

// What is still owned or reserved, one line per count that is not 0 (a failed report says so).
std::vector<std::string> Held(client::Client& c) {
  auto report = c.Report();
  if (!report.ok()) return {report.status().ToString()};
  std::vector<std::string> held;
  for (const PoolReport& p : report->pools) {
    if (p.owned_blocks != 0) held.push_back(absl::StrCat(p.name, ": ", p.owned_blocks, " blocks owned"));
    if (p.reserved_blocks != 0) held.push_back(absl::StrCat(p.name, ": ", p.reserved_blocks, " blocks reserved"));
  }
  if (report->reserved_bytes != 0) held.push_back(absl::StrCat(report->reserved_bytes, " bytes reserved"));
  return held;
}

void NothingHeld(client::Client& c) {
  const std::vector<std::string> held = Held(c);
  INFO(absl::StrJoin(held, "; "));
  CHECK(held.empty());
}

TEST_CASE("A hybrid generation checkpointed on worker A resumes on worker B with A's bytes in every group",
          "[integration][hybrid][hybrid_checkpoint]") {
  DaemonProcess d(Config());
  // No credit: NothingHeld counts the requests' blocks alone.
  auto a = client::Client::Connect({.target = d.target(), .step_credit_blocks = 0});
  auto b = client::Client::Connect({.target = d.target(), .step_credit_blocks = 0});
  REQUIRE((a.ok() && b.ok()));

  // Live checkpoint with the state, then the request ends interrupted.
  Written w = Generate(**a, "gen", 1);
  REQUIRE(w.req->Checkpoint(Range(1, 10), "engine", std::vector<StateCheckpoint>{{kRec, 10, w.state}}).ok());
  const std::vector<BlockIndex>& slots = w.req->group_table("rec")->blocks;
  CHECK(std::find(slots.begin(), slots.end(), w.state) == slots.end());  // a fresh spare in its place
  // Bad input changes nothing: a slot that is not the request's.
  const absl::Status foreign =
      w.req->Checkpoint(Range(1, 10), "x", std::vector<StateCheckpoint>{{kRec, 10, w.state}});
  CHECK(foreign.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(foreign.message(), "state_checkpoints"));
  REQUIRE(w.req->Release(/*completed=*/false).ok());

  // A start of the other grouping naming it is refused; the checkpoint stays resumable.
  const absl::StatusOr<std::unique_ptr<client::KvRequest>> cross = (*b)->Start(Resume("cross", Range(1, 9), "gen", "m"));
  CHECK(cross.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(cross.status().message(), "another KV grouping"));

  auto resumed = (*b)->Start(Resume("gen-b", Range(1, 10), "gen"));
  REQUIRE(resumed.ok());
  AcquireResult got;
  got.resumed = true;
  got.cached_tokens = (*resumed)->cached_tokens();
  got.group_tables = (*resumed)->group_tables();
  ReadsBack(**b, got, w, "Checkpoint + Release, resumed by Start");

  REQUIRE((*resumed)->Release(true).ok());

  // Worker B checkpoints another generation; worker A resumes it through a step's start.
  Written w2 = Generate(**b, "gen2", 1);
  REQUIRE(w2.req->Checkpoint(Range(1, 10), "e2", std::vector<StateCheckpoint>{{kRec, 10, w2.state}}).ok());
  REQUIRE(w2.req->Release(false).ok());
  client::StepBatch batch;
  client::StepRequest r;
  batch.Start(&r, Resume("gen3", Range(1, 10), "gen2"));
  auto started = (*a)->Step(batch);
  REQUIRE(started.ok());
  REQUIRE(started->items[0].status.ok());
  ReadsBack(**a, r.acquired, w2, "resumed by a step's start");
  CHECK(r.acquired.engine_state == "e2");
  // Preempted through a step with the state at 10 in the running slot; resumed by B.
  Write(**a, "rec", r.group_table("rec")->blocks[0], 'R');
  const BlockIndex running = r.group_table("rec")->blocks[0];
  batch.Clear();
  batch.Preempt(&r, Range(1, 10), "e3", {{kRec, 10, running}});
  auto preempted = (*a)->Step(batch);
  REQUIRE(preempted.ok());
  INFO(preempted->items[0].status.ToString());
  REQUIRE(preempted->items[0].status.ok());
  auto again = (*b)->Start(Resume("gen4", Range(1, 10), "gen3"));
  REQUIRE(again.ok());
  CHECK((*again)->cached_tokens() == 10);
  const GroupTable* rec = (*again)->group_table("rec");
  REQUIRE(rec->checkpoint_slot == static_cast<int64_t>(running));
  CHECK(Holds(**b, "rec", running, running, 'R'));
  REQUIRE((*again)->End(0, {}, true).ok());
  NothingHeld(**b);
}

TEST_CASE("Across --takeover a hybrid pool's hits, bytes and a live generation's checkpoint carry over",
          "[integration][hybrid][hybrid_checkpoint][handoff]") {
  DaemonProcess d(Config("lease_ttl_s: 4\n"));
  auto a = client::Client::Connect({.target = d.target()});
  REQUIRE(a.ok());
  // A published prompt with the state at 8 (one unit every group serves).
  auto p = (*a)->Start(PoolRequest("pub", Range(1, 17), 0, "hy"));
  REQUIRE(p.ok());
  const std::vector<BlockIndex> full = (*p)->group_table("full")->blocks;
  const std::vector<BlockIndex> swa = (*p)->group_table("swa")->blocks;
  const BlockIndex spare = (*p)->group_table("rec")->blocks[1];
  for (int i = 0; i < 2; ++i) {
    Write(**a, "full", full[i], 'F');
    Write(**a, "swa", swa[i], 'S');
  }
  Write(**a, "rec", spare, 'T');
  auto published = (*p)->Publish(Range(1, 8), std::vector<StateCheckpoint>{{kRec, 8, spare}});
  REQUIRE(published.ok());
  REQUIRE(published->checkpoint_outcomes == std::vector<CheckpointOutcome>{CheckpointOutcome::kKept});
  REQUIRE((*p)->End(0, {}, true).ok());
  const std::vector<Token> probe = {1, 2, 3, 4, 5, 6, 7, 8, 900, 901, 902};
  REQUIRE(*(*a)->PeekPrefixLen(Namespace{.pool = "hy"}, probe) == 8);
  // A generation live at the handoff, checkpointed with its state.
  Written w = Generate(**a, "live", 100);
  REQUIRE(w.req->Checkpoint(Range(100, 10), "live-state", std::vector<StateCheckpoint>{{kRec, 10, w.state}}).ok());

  REQUIRE(d.TakeOver());
  INFO(d.Log());
  REQUIRE(d.WaitPredecessorExit(absl::Seconds(10)).value_or(-1) == 0);
  auto c = client::Client::Connect({.target = d.target()});
  REQUIRE(c.ok());
  CHECK(*(*c)->PeekPrefixLen(Namespace{.pool = "hy"}, probe) == 8);
  auto hit = (*c)->Start(PoolRequest("hit", probe, 0, "hy"));
  REQUIRE(hit.ok());
  CHECK((*hit)->cached_tokens() == 8);
  for (int i = 0; i < 2; ++i) {
    CHECK((*hit)->group_table("full")->blocks[i] == full[i]);
    CHECK(Holds(**c, "full", full[i], full[i], 'F'));
    CHECK((*hit)->group_table("swa")->blocks[i] == swa[i]);
    CHECK(Holds(**c, "swa", swa[i], swa[i], 'S'));
  }
  CHECK((*hit)->group_table("rec")->checkpoint_slot == static_cast<int64_t>(spare));
  CHECK(Holds(**c, "rec", spare, spare, 'T'));
  REQUIRE((*hit)->End(0, {}, true).ok());

  // The live generation's checkpoint crossed; its tail stays fenced until its writer re-attaches
  // quiesced or the lease (4 s) passes (a refused resume changes nothing), then it resumes exactly.
  absl::StatusOr<std::unique_ptr<client::KvRequest>> resumed;
  for (int i = 0; i < 100; ++i) {
    resumed = (*c)->Start(Resume("live2", Range(100, 10), "live"));
    if (resumed.ok()) break;
    INFO(resumed.status().ToString());
    REQUIRE(absl::StrContains(resumed.status().message(), "cannot be resumed exactly"));
    absl::SleepFor(absl::Milliseconds(200));
  }
  REQUIRE(resumed.ok());
  AcquireResult got;
  got.resumed = true;
  got.cached_tokens = (*resumed)->cached_tokens();
  got.group_tables = (*resumed)->group_tables();
  ReadsBack(**c, got, w, "resumed on the successor");
  REQUIRE((*resumed)->End(0, {}, true).ok());
  // Every fence of the handoff lifts once its lease (4 s from the takeover) has passed: polled
  // for up to 10 s.
  for (int i = 0; i < 200 && !Held(**c).empty(); ++i) absl::SleepFor(absl::Milliseconds(50));
  NothingHeld(**c);
}

}  // namespace
}  // namespace kvd::testing

namespace kvd::testing {
namespace {

// A worker that dies right after checkpointing (its attach stream breaks, as a killed process's
// does): its checkpoint resumes exactly on another worker at once (the lost writer writes only
// past it), while what it may still be writing stays fenced from everyone until it re-attaches
// quiesced; then nothing is left owned or reserved.
TEST_CASE("A hybrid worker lost right after its checkpoint: resumed exactly, its other units fenced, nothing leaked",
          "[integration][hybrid][hybrid_checkpoint][fences]") {
  DaemonProcess d(Config());
  auto stub = v1::Kvd::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
  auto lost = AttachByHand(*stub);
  const std::string lost_id = lost->attached.worker_id();
  v1::StartRequest start;
  start.mutable_admit()->set_worker_id(lost_id);
  start.mutable_admit()->set_request_id("gen");
  start.mutable_admit()->mutable_namespace_()->set_pool("hy");
  for (Token t = 1; t <= 10; ++t) start.mutable_admit()->add_prompt(t);
  start.mutable_admit()->set_max_new_tokens(8);
  v1::StartResponse started;
  {
    grpc::ClientContext ctx;
    REQUIRE(stub->Start(&ctx, start, &started).ok());
  }
  std::set<uint32_t> held;  // every unit the lost worker held
  std::vector<uint32_t> full, swa;
  uint32_t running = 0;
  for (const v1::GroupTable& t : started.acquired().group_tables()) {
    held.insert(t.blocks().begin(), t.blocks().end());
    if (t.group() == "full") full.assign(t.blocks().begin(), t.blocks().end());
    if (t.group() == "swa") swa.assign(t.blocks().begin(), t.blocks().end());
    if (t.group() == "rec") running = t.blocks(0);
  }
  REQUIRE(full.size() == 3);
  REQUIRE(swa.size() == 2);
  // A slot that is not its own: refused naming the field; then its checkpoint at 8 tokens.
  v1::CheckpointRequest ckpt;
  ckpt.set_worker_id(lost_id);
  ckpt.set_request_id("gen");
  for (Token t = 1; t <= 8; ++t) ckpt.add_tokens(t);
  v1::StateCheckpoint* state = ckpt.add_state_checkpoints();
  state->set_group(kRec);
  state->set_position_tokens(8);
  state->set_slot(full[0]);
  {
    grpc::ClientContext ctx;
    v1::CheckpointResponse resp;
    const grpc::Status s = stub->Checkpoint(&ctx, ckpt, &resp);
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(s.error_message().find("state_checkpoints") != std::string::npos);
  }
  state->set_slot(running);
  v1::CheckpointResponse checkpointed;
  {
    grpc::ClientContext ctx;
    REQUIRE(stub->Checkpoint(&ctx, ckpt, &checkpointed).ok());
  }
  REQUIRE(checkpointed.fresh_slots_size() == 1);
  held.insert(static_cast<uint32_t>(checkpointed.fresh_slots(0)));
  lost->Break();  // killed
  absl::SleepFor(absl::Milliseconds(300));

  auto b = client::Client::Connect({.target = d.target()});
  REQUIRE(b.ok());
  auto resumed = (*b)->Start(Resume("gen-b", Range(1, 10), "gen"));
  REQUIRE(resumed.ok());
  CHECK((*resumed)->cached_tokens() == 8);
  const GroupTable* f = (*resumed)->group_table("full");
  const GroupTable* w = (*resumed)->group_table("swa");
  const GroupTable* r = (*resumed)->group_table("rec");
  CHECK(std::vector<BlockIndex>(f->blocks.begin(), f->blocks.begin() + 2) == std::vector<BlockIndex>{full[0], full[1]});
  CHECK(w->first_block_position == 0);
  CHECK(std::vector<BlockIndex>(w->blocks.begin(), w->blocks.begin() + 2) == std::vector<BlockIndex>{swa[0], swa[1]});
  CHECK(r->checkpoint_slot == static_cast<int64_t>(running));
  // Its fresh units are none of what the lost worker may still write.
  for (const GroupTable& t : (*resumed)->group_tables()) {
    for (size_t i = 0; i < t.blocks.size(); ++i) {
      const bool from_checkpoint = (t.name == "full" || t.name == "swa") && i < 2;
      if (!from_checkpoint) CHECK_FALSE(held.contains(t.blocks[i]));
    }
  }
  REQUIRE((*resumed)->End(0, {}, true).ok());
  // The lost worker re-attaches having quiesced: its fences lift; nothing stays owned or reserved.
  auto back = AttachByHand(*stub, "", getpid(), lost_id, /*quiesced=*/true);
  absl::SleepFor(absl::Milliseconds(200));
  NothingHeld(**b);
}

}  // namespace
}  // namespace kvd::testing

namespace kvd::testing {
namespace {

std::string DiskConfig(const std::string& disk, int window = 6) {
  return Config(absl::StrCat("tiers:\n  host_bytes: 65536\n  disk_dir: ", disk, "\n"), window);
}

v1::ReportResponse StubReport(const DaemonProcess& d) {
  auto stub = v1::Kvd::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::ReportResponse r;
  REQUIRE(stub->Report(&ctx, v1::ReportRequest(), &r).ok());
  return r;
}

v1::FlushResponse StubFlush(const DaemonProcess& d) {
  auto stub = v1::Kvd::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::FlushResponse r;
  REQUIRE(stub->Flush(&ctx, v1::FlushRequest(), &r).ok());
  return r;
}

// On a daemon with a disk tier: "gen" checkpointed with its state and ended interrupted, and
// "pre" (first token 100) preempted through a step, every unit written (ReadsBack's patterns);
// flushed durable, then the daemon is SIGKILLed. Returns what each wrote.
std::pair<Written, Written> CheckpointFlushKill(const std::string& disk) {
  DaemonProcess d(DiskConfig(disk));
  auto a = client::Client::Connect({.target = d.target(), .step_credit_blocks = 0});
  REQUIRE(a.ok());
  Written w = Generate(**a, "gen", 1);
  REQUIRE(w.req->Checkpoint(Range(1, 10), "engine", std::vector<StateCheckpoint>{{kRec, 10, w.state}}).ok());
  REQUIRE(w.req->Release(/*completed=*/false).ok());
  w.req.reset();

  client::StepRequest r;
  client::StepBatch batch;
  batch.Start(&r, PoolRequest("pre", Range(100, 10), 8, "hy"));
  auto started = (*a)->Step(batch);
  REQUIRE((started.ok() && started->items[0].status.ok()));
  batch.Clear();
  batch.Grow(&r, 0, 8);  // 8 computed: the window's blocks up to 16 come
  auto grown = (*a)->Step(batch);
  REQUIRE((grown.ok() && grown->items[0].status.ok()));
  Written p;
  p.full = r.group_table("full")->blocks;
  p.swa = r.group_table("swa")->blocks;
  REQUIRE(r.group_table("swa")->first_block_position == 0);
  REQUIRE(p.swa.size() == 3);
  p.state = r.group_table("rec")->blocks[0];
  for (int i = 0; i < 3; ++i) {
    Write(**a, "full", p.full[i], 'f');
    Write(**a, "swa", p.swa[i], 's');
  }
  Write(**a, "rec", p.state, 'r');
  batch.Clear();
  batch.Preempt(&r, Range(100, 10), "pre-engine", {{kRec, 10, p.state}});
  auto preempted = (*a)->Step(batch);
  REQUIRE((preempted.ok() && preempted->items[0].status.ok()));

  CHECK(StubReport(d).tiers().pending_checkpoints() == 2);  // only in memory so far
  const v1::FlushResponse f = StubFlush(d);
  INFO(f.DebugString());
  REQUIRE(f.durable());
  CHECK(StubReport(d).tiers().pending_checkpoints() == 0);
  d.Signal(SIGKILL);  // a crash: only what the flush made durable survives
  (void)d.WaitExit(absl::Seconds(10));
  return {std::move(w), std::move(p)};
}

// Resumes checkpoint `from` on `c`: whether it resumed (then its bytes are checked against `w`).
bool ResumedExactly(client::Client& c, const std::string& id, Token first, const std::string& from,
                    const Written& w, const std::string& engine_state) {
  auto resumed = c.Start(Resume(id, Range(first, 10), from));
  REQUIRE(resumed.ok());
  const bool exact = (*resumed)->resumed();
  if (exact) {
    AcquireResult got;
    got.resumed = true;
    got.cached_tokens = (*resumed)->cached_tokens();
    got.group_tables = (*resumed)->group_tables();
    ReadsBack(c, got, w, absl::StrCat(from, " resumed after the restart"));
    CHECK((*resumed)->engine_state() == engine_state);
  } else {
    CHECK((*resumed)->cached_tokens() == 0);
  }
  REQUIRE((*resumed)->End(0, {}, true).ok());
  return exact;
}

TEST_CASE("Hybrid generation checkpoints survive a flush and a SIGKILL; another window restores none",
          "[integration][hybrid][hybrid_checkpoint][tiers]") {
  TempDir disk;
  const auto [w, p] = CheckpointFlushKill(disk.path());
  {
    // Another window is another grouping: nothing restored, nothing leaked, the records kept.
    DaemonProcess d(DiskConfig(disk.path(), 7));
    const v1::ReportResponse r = StubReport(d);
    CHECK(r.tiers().restored_checkpoints() == 0);
    CHECK(r.tiers().incompatible() >= 2);
    CHECK(r.orphaned_checkpoints() == 0);
    auto b = client::Client::Connect({.target = d.target(), .step_credit_blocks = 0});
    REQUIRE(b.ok());
    CHECK_FALSE(ResumedExactly(**b, "gen-x", 1, "gen", w, "engine"));
    NothingHeld(**b);
    d.Signal(SIGKILL);
    (void)d.WaitExit(absl::Seconds(10));
  }
  DaemonProcess d(DiskConfig(disk.path()));
  const v1::ReportResponse r = StubReport(d);
  CHECK(r.tiers().restored_checkpoints() == 2);
  CHECK(r.orphaned_checkpoints() == 2);
  CHECK(r.tiers().pending_checkpoints() == 0);  // restored from disk: durable as they are
  auto b = client::Client::Connect({.target = d.target(), .step_credit_blocks = 0});
  REQUIRE(b.ok());
  CHECK(ResumedExactly(**b, "gen-b", 1, "gen", w, "engine"));
  CHECK(ResumedExactly(**b, "pre-b", 100, "pre", p, "pre-engine"));
  NothingHeld(**b);
  // Both completed: the next flush deletes their records, so no restart brings them back.
  REQUIRE(StubFlush(d).durable());
  d.Signal(SIGKILL);
  (void)d.WaitExit(absl::Seconds(10));
  DaemonProcess again(DiskConfig(disk.path()));
  CHECK(StubReport(again).tiers().restored_checkpoints() == 0);
  CHECK(StubReport(again).orphaned_checkpoints() == 0);
}

TEST_CASE("A hybrid checkpoint record with a flipped byte on disk is never resumed",
          "[integration][hybrid][hybrid_checkpoint][tiers]") {
  TempDir disk;
  const auto [w, p] = CheckpointFlushKill(disk.path());
  // The flush wrote both checkpoints in one segment; flip a byte of its last payload (pre's state).
  int flipped = 0;
  for (const auto& e : std::filesystem::directory_iterator(disk.path())) {
    if (e.path().filename().string().rfind("seg-", 0) != 0) continue;
    const std::streamoff at = static_cast<std::streamoff>(std::filesystem::file_size(e.path())) - 10;
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    char c = 0;
    f.seekg(at);
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(at);
    f.write(&c, 1);
    ++flipped;
  }
  REQUIRE(flipped == 1);
  DaemonProcess d(DiskConfig(disk.path()));
  auto b = client::Client::Connect({.target = d.target(), .step_credit_blocks = 0});
  REQUIRE(b.ok());
  const v1::ReportResponse r = StubReport(d);
  INFO(d.Log());
  CHECK(r.tiers().restored_checkpoints() + r.orphaned_checkpoints() <= 2);
  // Whichever record holds the flipped byte fails its checksum; the other resumes exactly.
  const bool gen = ResumedExactly(**b, "gen-b", 1, "gen", w, "engine");
  const bool pre = ResumedExactly(**b, "pre-b", 100, "pre", p, "pre-engine");
  CHECK(gen != pre);
  CHECK(r.tiers().restored_checkpoints() == 1);
  NothingHeld(**b);
}

}  // namespace
}  // namespace kvd::testing
