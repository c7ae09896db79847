// Hybrid pools (docs/hybrid.md, build step 1) against the real daemon: configuration errors name
// pools[i].groups[j].<field>, --print-config round-trips groups, ListPools and kvdctl list them,
// Attach refuses a worker declaring none or other groups, and each group's layer written through
// one client's group view at a group-local index reads back through another client's mapping at
// the slab offset docs/hybrid.md §2.2 gives.
#include <algorithm>
#include <cstring>
#include <map>
#include <fstream>

#include <catch2/catch.hpp>
#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "kvd/v1/kvd.grpc.pb.h"
#include "tests/integration/harness.h"

namespace kvd::testing {
namespace {

// Four layers: full attention in 1 and 3, a 6-token window in 0, recurrent state in 2.
std::string HybridPool(const std::string& groups_extra = "", const std::string& pool_extra = "") {
  return absl::StrCat(
      "pools:\n"
      "  - name: hy\n"
      "    block_tokens: 4\n"
      "    num_layers: 4\n"
      "    bytes_per_token_per_layer: 16\n"
      "    max_model_len: 64\n",
      pool_extra,
      "    groups:\n"
      "      - {name: full, kind: full, layers: [\"1-3/2\"], capacity_blocks: 40}\n"
      "      - {name: swa, kind: sliding_window, layers: [0], window: 6, capacity_blocks: 24}\n"
      "      - {name: rec, kind: state, layers: [2], bytes_per_state: 100, checkpoint_every_blocks: 2, "
      "capacity_slots: 6}\n",
      groups_extra);
}

ProcessResult PrintConfig(const TempDir& dir, const std::string& yaml, const std::string& name = "c.yaml",
                          std::vector<std::string> flags = {}) {
  const std::string path = dir.path() + "/" + name;
  std::ofstream(path) << yaml;
  flags.insert(flags.begin(), {"--config=" + path, "--print-config", "--listen=unix://" + dir.path() + "/k.sock"});
  return RunProcess(KvdBinary(), flags, absl::Seconds(10));
}

TEST_CASE("Hybrid pool config errors exit 2 naming pools[i].groups[j].<field>", "[integration][hybrid]") {
  TempDir dir;
  const auto refused = [&](const std::string& yaml, const std::string& message, std::vector<std::string> flags = {}) {
    const ProcessResult r = PrintConfig(dir, yaml, "bad.yaml", flags);
    INFO(yaml << "\n-> " << r.out);
    CHECK(r.exit_code == 2);
    CHECK(r.out.find(message) != std::string::npos);
  };
  const std::string full = "      - {name: full, kind: full, layers: [\"1-3/2\"], capacity_blocks: 40}\n";
  const auto with = [&](const std::string& swa, const std::string& rec, const std::string& pool_extra = "") {
    return absl::StrCat("pools:\n  - name: hy\n    block_tokens: 4\n    num_layers: 4\n"
                        "    bytes_per_token_per_layer: 16\n    max_model_len: 64\n",
                        pool_extra, "    groups:\n", full, swa, rec);
  };
  const std::string swa = "      - {name: swa, kind: sliding_window, layers: [0], window: 6, capacity_blocks: 24}\n";
  const std::string rec =
      "      - {name: rec, kind: state, layers: [2], bytes_per_state: 100, checkpoint_every_blocks: 2, capacity_slots: 6}\n";
  refused(with("      - {name: swa, kind: sliding_window, layers: [0], window: 0, capacity_blocks: 24}\n", rec),
          "pools[0].groups[1].window: 0 is out of range; allowed: [1, max_model_len = 64)");
  refused(with("      - {name: swa, kind: sliding_window, layers: [0], window: 6, chunk: 8, capacity_blocks: 24}\n", rec),
          "pools[0].groups[1].chunk: 8 is not a key of kind sliding_window; allowed only on chunked_local");
  refused(with("      - {name: swa, kind: sliding, layers: [0], window: 6}\n", rec),
          "pools[0].groups[1].kind: 'sliding' is not allowed; allowed: full, sliding_window, chunked_local, state");
  refused(with(swa, "      - {name: rec, kind: state, layers: [2], bytes_per_state: 100, capacity_slots: 6}\n"),
          "pools[0].groups[2].checkpoint_every_blocks: (unset) is required on a state group");
  refused(with(swa, "      - {name: rec, kind: state, layers: [], bytes_per_state: 100, checkpoint_every_blocks: 2, "
                    "capacity_slots: 6}\n"),
          "pools[0].groups[2].layers: [] lists no layer");
  refused(with(swa, "      - {name: rec, kind: state, layers: [\"4-5\"], bytes_per_state: 100, checkpoint_every_blocks: 2, "
                    "capacity_slots: 6}\n"),
          "pools[0].groups[2].layers: 4 is not a layer of the pool; allowed: [0, 4)");
  refused(with(swa, "      - {name: rec, kind: state, layers: [\"2/3\"], bytes_per_state: 100, checkpoint_every_blocks: 2}\n"),
          "pools[0].groups[2].layers[0]: '2/3' has a stride without a range");
  refused(with(swa, "      - {name: rec, kind: state, layers: [2], bytes_per_state: 100, checkpoint_every_blocks: 2, "
                    "capacity_blocks: 6}\n"),
          "pools[0].groups[2].capacity_blocks: 6 is not a key of kind state; allowed: capacity_slots");
  refused(with(swa, rec, "    capacity_blocks: 64\n"),
          "pools[0].capacity_blocks: 64 is ambiguous in a pool with groups; allowed: the pool's capacity_bytes");
  refused(with(swa, rec, "    layout: block_major\n"), "pools[0].layout: block_major is not allowed with groups");
  refused(with(swa, rec, "    step_tokens: 2\n"), "pools[0].step_tokens: 2 is out of range");
  refused(with(swa, ""), "pools[0].groups: layer 2 is in no group");
  refused(with("      - {name: swa, kind: sliding_window, layers: [0], window: 6, capacity_blocks: 10}\n", rec),
          "pools[0].groups[1].capacity_blocks: 10 cannot hold one request of max_model_len 64 tokens, which reserves 16");
  refused(with("      - {name: swa, kind: sliding_window, layers: [0], window: 6}\n", rec),
          "pools[0].groups[1].capacity_blocks: (unset) and the pool sets no capacity_bytes to split");
}

TEST_CASE("--print-config round-trips a hybrid pool, with the default split resolved", "[integration][hybrid]") {
  TempDir dir;
  const std::string yaml =
      "pools:\n"
      "  - name: next\n"
      "    block_tokens: 16\n"
      "    num_layers: 8\n"
      "    bytes_per_token_per_layer: 256\n"
      "    max_model_len: 4096\n"
      "    capacity_bytes: 64MiB\n"
      "    step_tokens: 256\n"
      "    groups:\n"
      "      - {name: attn, kind: full, layers: [3, 7]}\n"
      "      - {name: gdn, kind: state, layers: [\"0-2\", \"4-6\"], bytes_per_state: 100000, checkpoint_every_blocks: 64}\n";
  const ProcessResult a = PrintConfig(dir, yaml, "first.yaml");
  INFO(a.out);
  REQUIRE(a.exit_code == 0);
  // R = 10 requests of 4096 tokens (tests/unit/core/kv_group_test.cc): 2560 blocks and 70 slots.
  CHECK(a.out.find("capacity_bytes: 67108864\n") != std::string::npos);
  CHECK(a.out.find("step_tokens: 256\n") != std::string::npos);
  CHECK(a.out.find("{name: attn, kind: full, layers: [3, 7], bytes_per_token: 256, capacity_blocks: 2560}") !=
        std::string::npos);
  CHECK(a.out.find("{name: gdn, kind: state, layers: [0-2, 4-6], bytes_per_state: 100000, checkpoint_every_blocks: 64, "
                   "checkpoint_at_end: true, capacity_slots: 70}") != std::string::npos);
  const ProcessResult b = PrintConfig(dir, a.out, "second.yaml");
  REQUIRE(b.exit_code == 0);
  CHECK(b.out == a.out);
}

std::string AttachWith(v1::Kvd::Stub& stub, const std::vector<v1::GroupInfo>& groups, grpc::StatusCode* code) {
  grpc::ClientContext ctx;
  auto stream = stub.Attach(&ctx);
  v1::AttachRequest hello;
  hello.mutable_hello()->set_pid(getpid());
  v1::PoolExpectation* e = hello.mutable_hello()->add_expect_pools();
  e->set_pool("hy");
  for (const v1::GroupInfo& g : groups) *e->add_groups() = g;
  stream->Write(hello);
  v1::AttachResponse resp;
  if (stream->Read(&resp) && resp.has_attached()) {
    ctx.TryCancel();
    *code = grpc::StatusCode::OK;
    return "";
  }
  const grpc::Status s = stream->Finish();
  *code = s.error_code();
  return s.error_message();
}

v1::GroupInfo Group(const std::string& name, const std::string& kind) {
  v1::GroupInfo g;
  g.set_name(name);
  g.set_kind(kind);
  return g;
}

TEST_CASE("Attach: a hybrid pool refuses a worker declaring no groups or other groups", "[integration][hybrid]") {
  DaemonProcess d(HybridPool());
  auto stub = v1::Kvd::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
  grpc::StatusCode code;
  std::vector<v1::GroupInfo> groups = {Group("full", "full"), Group("swa", "sliding_window"), Group("rec", "state")};
  groups[1].set_window(6);
  groups[0].add_layers(1);
  groups[0].add_layers(3);
  groups[2].set_checkpoint_every_blocks(2);
  groups[2].set_bytes_per_state(100);
  CHECK(AttachWith(*stub, groups, &code).empty());
  CHECK(code == grpc::StatusCode::OK);

  CHECK(AttachWith(*stub, {}, &code) ==
        "pool 'hy' has 3 KV groups; this worker declares none: it would index the slab as one group");
  CHECK(code == grpc::StatusCode::FAILED_PRECONDITION);
  std::vector<v1::GroupInfo> window = groups;
  window[1].set_window(7);
  CHECK(AttachWith(*stub, window, &code) == "pool 'hy' group 1 (swa) holds window 6, the worker expects 7");
  CHECK(code == grpc::StatusCode::FAILED_PRECONDITION);
  std::vector<v1::GroupInfo> layers = groups;
  layers[0].set_layers(1, 2);
  CHECK(AttachWith(*stub, layers, &code) == "pool 'hy' group 0 (full) holds layers 1,3, the worker expects 1,2");
  std::vector<v1::GroupInfo> k = groups;
  k[2].set_checkpoint_every_blocks(4);
  CHECK(AttachWith(*stub, k, &code) ==
        "pool 'hy' group 2 (rec) holds checkpoint_every_blocks 2, the worker expects 4");
  std::vector<v1::GroupInfo> kind = groups;
  kind[1].set_kind("sliding");
  AttachWith(*stub, kind, &code);
  CHECK(code == grpc::StatusCode::INVALID_ARGUMENT);

  // A pool without groups refuses a worker that declares some, and serves one that declares none.
  DaemonProcess plain(SmallPoolConfig());
  auto plain_stub = v1::Kvd::NewStub(grpc::CreateChannel(plain.target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  auto stream = plain_stub->Attach(&ctx);
  v1::AttachRequest hello;
  hello.mutable_hello()->set_pid(getpid());
  v1::PoolExpectation* e = hello.mutable_hello()->add_expect_pools();
  e->set_pool("default");
  *e->add_groups() = Group("full", "full");
  stream->Write(hello);
  v1::AttachResponse resp;
  REQUIRE_FALSE(stream->Read(&resp));
  const grpc::Status s = stream->Finish();
  CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(s.error_message() == "pool 'default' has no KV groups (one implicit full group); this worker declares 1");
}

TEST_CASE("Host backend: each group's layer written through its group view reads back at its slab offset",
          "[integration][hybrid]") {
  DaemonProcess d(HybridPool());
  auto writer = client::Client::Connect({.target = d.target()});
  REQUIRE(writer.ok());
  auto reader = client::Client::Connect({.target = d.target()});
  REQUIRE(reader.ok());
  auto wp = (*writer)->FindPool("hy");
  auto rp = (*reader)->FindPool("hy");
  REQUIRE(wp.ok());
  REQUIRE(rp.ok());
  const PoolGeometry& g = (*wp)->geometry;
  REQUIRE(g.groups.size() == 3);
  CHECK(g.capacity_blocks == 40 + 24 + 6);
  CHECK(g.groups[1].first_block == 40);
  CHECK(g.groups[2].first_block == 64);
  // Regions on 2 MiB: full is 2 layers x 40 x 64 B, swa 24 x 64 B, rec 6 x 100 B.
  CHECK(g.groups[1].region_offset_bytes == 2 << 20);
  CHECK(g.groups[2].region_offset_bytes == 4 << 20);
  CHECK((*wp)->slab_bytes[0] == 6 << 20);

  struct Case {
    std::string group;
    int64_t local;
    int32_t j;
  };
  const std::vector<Case> cases = {{"full", 0, 0}, {"full", 39, 1}, {"swa", 5, 0}, {"swa", 23, 0}, {"rec", 0, 0},
                                   {"rec", 5, 0}};
  for (const Case& c : cases) {
    INFO(c.group << " unit " << c.local << " layer " << c.j);
    auto view = client::GroupKv(**wp, c.group);
    REQUIRE(view.ok());
    const int gi = c.group == "full" ? 0 : c.group == "swa" ? 1 : 2;
    const int64_t unit = gi == 2 ? 100 : 4 * 16;
    REQUIRE(view->layer_unit_bytes == unit);
    std::string pattern(static_cast<size_t>(unit), '\0');
    for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<char>(1 + gi * 50 + c.local + c.j * 7 + i % 3);
    std::memcpy(view->Unit(c.j, c.local), pattern.data(), pattern.size());

    // The other process's mapping, at the offset of docs/hybrid.md §2.2 ...
    const KvGroup& k = (*rp)->geometry.groups[gi];
    const uint8_t* at = (*rp)->shard_base[0] + k.region_offset_bytes + (c.j * k.capacity + c.local) * unit;
    CHECK(std::memcmp(at, pattern.data(), pattern.size()) == 0);
    // ... and by pool-wide index and model layer through the client's LayerPointer.
    const BlockIndex index = static_cast<BlockIndex>(k.first_block + c.local);
    CHECK(view->Local(index) == c.local);
    auto pointer = (*reader)->LayerPointer((*rp)->id, index, k.layers[c.j]);
    REQUIRE(pointer.ok());
    CHECK(*pointer == at);
    std::string back(pattern.size(), '\0');
    REQUIRE((*reader)->ReadLayer((*rp)->id, index, k.layers[c.j], 0, back.data(), unit).ok());
    CHECK(back == pattern);
  }
  // A layer outside the index's group, and an index past the groups, are refused.
  CHECK((*reader)->LayerPointer((*rp)->id, 40, 1).status().code() == absl::StatusCode::kOutOfRange);
  CHECK((*reader)->LayerPointer((*rp)->id, 70, 0).status().code() == absl::StatusCode::kOutOfRange);
  CHECK(client::GroupKv(**rp, "nope").status().code() == absl::StatusCode::kNotFound);

  // kvdctl pools lists the groups.
  const ProcessResult ctl = RunProcess(KVDCTL_BINARY, {"--target=" + d.target(), "pools"});
  INFO(ctl.out);
  REQUIRE(ctl.exit_code == 0);
  CHECK(ctl.out.find("GROUP") != std::string::npos);
  CHECK(ctl.out.find("sliding_window") != std::string::npos);
  CHECK(ctl.out.find("window 6") != std::string::npos);
  CHECK(ctl.out.find("k 2, tail") != std::string::npos);
  CHECK(ctl.out.find("1-3/2") == std::string::npos);  // two layers print as "1,3"
  CHECK(ctl.out.find("1,3") != std::string::npos);
}

TEST_CASE("A hybrid pool serves requests with no prefix reuse yet", "[integration][hybrid]") {
  DaemonProcess d(HybridPool());
  auto c = client::Client::Connect({.target = d.target()});
  REQUIRE(c.ok());
  RequestSpec a = PoolRequest("first", Range(1, 12), 0, "hy");
  auto ra = (*c)->Start(a);
  REQUIRE(ra.ok());
  const std::vector<Token> prompt = Range(1, 12);
  std::vector<BlockIndex> blocks((*ra)->blocks().begin(), (*ra)->blocks().begin() + 3);
  REQUIRE((*c)->Publish(a.id, prompt, blocks).ok());
  REQUIRE((*ra)->Release(true).ok());
  RequestSpec b = PoolRequest("second", Range(1, 13), 0, "hy");
  auto rb = (*c)->Start(b);
  REQUIRE(rb.ok());
  CHECK((*rb)->cached_tokens() == 0);
}

// The pool-wide counts Report gives for pool "hy" (per-group counts are not on the wire).
struct Counts {
  int64_t free = 0, owned = 0, cached = 0, evictable = 0, reserved = 0;
  bool operator==(const Counts&) const = default;
};
Counts HyCounts(client::Client& c) {
  absl::StatusOr<CacheReport> r = c.Report();
  REQUIRE(r.ok());
  for (const PoolReport& p : r->pools) {
    if (p.name == "hy") return {p.free_blocks, p.owned_blocks, p.cached_blocks, p.evictable_blocks, p.reserved_blocks};
  }
  FAIL("no pool hy in Report");
  return {};
}

// The pattern a test writes into group unit `local` (layer j).
std::string UnitPattern(int64_t bytes, int64_t local, int32_t j, char group) {
  std::string out(static_cast<size_t>(bytes), '\0');
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(group + local * 3 + j * 11 + i % 5);
  return out;
}

TEST_CASE("A worker keeps one table per group: grows report computed tokens and drop released window blocks",
          "[integration][hybrid]") {
  // step_tokens 8: a window group holds [floor(max(0, c - 5) / 4), ceil(min(n, c + 8) / 4)).
  DaemonProcess d(HybridPool("", "    step_tokens: 8\n"));
  // No credit: the counts below are the requests' alone (hybrid_credit_test.cc places credit).
  auto c = client::Client::Connect({.target = d.target(), .step_credit_blocks = 0});
  REQUIRE(c.ok());
  auto observer = client::Client::Connect({.target = d.target(), .map_slabs = false});
  REQUIRE(observer.ok());
  auto pool = (*c)->FindPool("hy");
  REQUIRE(pool.ok());
  const Counts idle = HyCounts(**observer);
  CHECK(idle.free == 70);

  auto req = (*c)->Start(PoolRequest("hybrid", Range(1, 12), 20, "hy"));
  REQUIRE(req.ok());
  client::KvRequest& r = **req;
  REQUIRE(r.group_tables().size() == 3);
  const GroupTable* full = r.group_table("full");
  const GroupTable* swa = r.group_table("swa");
  const GroupTable* rec = r.group_table("rec");
  REQUIRE((full != nullptr && swa != nullptr && rec != nullptr));
  CHECK(r.group_table("nope") == nullptr);
  CHECK(full->blocks == r.blocks());
  CHECK(full->blocks.size() == 3);
  CHECK((swa->first_block_position == 0 && swa->blocks.size() == 2));  // [0, ceil(min(12, 0 + 8) / 4))
  CHECK(rec->blocks.size() == 2);
  CHECK(HyCounts(**observer).owned == 3 + 2 + 2);

  // Each group's units written at their group-local index; every table block is the group's own.
  std::map<BlockIndex, std::string> written;  // pool-wide index -> layer 0's bytes
  auto write_tables = [&] {
    for (const GroupTable& t : r.group_tables()) {
      auto view = client::GroupKv(**pool, t.name);
      REQUIRE(view.ok());
      for (BlockIndex b : t.blocks) {
        const int64_t local = view->Local(b);
        INFO(t.name << " block " << b);
        REQUIRE(local >= 0);
        if (written.contains(b)) continue;
        for (int32_t j = 0; j < static_cast<int32_t>(view->layers.size()); ++j) {
          const std::string bytes = UnitPattern(view->layer_unit_bytes, local, j, t.name[0]);
          std::memcpy(view->Unit(j, local), bytes.data(), bytes.size());
          if (j == 0) written[b] = bytes;
        }
      }
    }
  };
  auto still_there = [&] {
    for (const GroupTable& t : r.group_tables()) {
      auto view = client::GroupKv(**pool, t.name);
      for (BlockIndex b : t.blocks) {
        INFO(t.name << " block " << b);
        CHECK(std::memcmp(view->Unit(0, view->Local(b)), written[b].data(), written[b].size()) == 0);
      }
    }
  };
  write_tables();
  // The first block published: the full block and the window block at position 0 become cached.
  REQUIRE(r.Publish(Range(1, 4)).ok());
  const Counts published = HyCounts(**observer);
  CHECK(published.owned == 5);
  CHECK(published.cached == 2);
  CHECK(published.evictable == 0);

  // Step 1: the prompt is computed (c = 12), 4 tokens more. Window [7/4, ceil(16/4)) = [1, 4): the
  // published window block 0 leaves the table; no state checkpoint reads it, so in a pool with a
  // state group it is freed (docs/hybrid.md §2.8, U4) and may come back at once as position 2's
  // or 3's; those are handed out.
  const BlockIndex swa1 = swa->blocks[1];
  REQUIRE(r.Extend(4, 12).ok());
  swa = r.group_table("swa");
  full = r.group_table("full");
  CHECK(r.num_tokens() == 16);
  CHECK(swa->first_block_position == 1);
  REQUIRE(swa->blocks.size() == 3);
  CHECK(swa->blocks[0] == swa1);
  CHECK(full->blocks.size() == 4);
  CHECK(full->blocks == r.blocks());
  CHECK(r.group_table("rec")->blocks.size() == 2);
  Counts after = HyCounts(**observer);
  CHECK(after.owned == published.owned + 3);  // full 3, swa 2 and 3
  CHECK(after.free == published.free - 3 + 1);
  CHECK(after.cached == published.cached - 1);  // window block 0 is not cached any more
  CHECK(after.evictable == published.evictable);
  still_there();
  write_tables();

  // Step 2: c = 16, n = 20. Window [11/4, 5) = [2, 5): the unpublished window block 1 is freed
  // (and may come back at once as position 4's).
  const std::vector<BlockIndex> window = swa->blocks;
  REQUIRE(r.Extend(4, 16).ok());
  swa = r.group_table("swa");
  CHECK(swa->first_block_position == 2);
  REQUIRE(swa->blocks.size() == 3);
  CHECK(swa->blocks[0] == window[1]);
  CHECK(swa->blocks[1] == window[2]);
  CHECK(r.group_table("full")->blocks.size() == 5);
  const Counts step2 = HyCounts(**observer);
  CHECK(step2.owned == after.owned + 1);  // full 4 and swa 4 in, swa 1 out
  CHECK(step2.free == after.free - 1);
  CHECK(step2.cached == after.cached);
  still_there();
  write_tables();

  // Careless or hostile reports change nothing: computed tokens going back, or past n.
  const std::vector<GroupTable> before = r.group_tables();
  absl::Status back = r.Extend(4, 8);
  CHECK(back.code() == absl::StatusCode::kInvalidArgument);
  CHECK(back.message().find("computed_tokens 8") != std::string::npos);
  CHECK(back.message().find("last report (16)") != std::string::npos);
  absl::Status past = r.Extend(1, 30);
  CHECK(past.code() == absl::StatusCode::kInvalidArgument);
  CHECK(past.message().find("computed_tokens 30") != std::string::npos);
  CHECK(past.message().find("its tokens (21)") != std::string::npos);
  CHECK(r.num_tokens() == 20);
  CHECK(HyCounts(**observer) == step2);
  REQUIRE(r.group_tables().size() == before.size());
  for (size_t g = 0; g < before.size(); ++g) {
    CHECK(r.group_tables()[g].first_block_position == before[g].first_block_position);
    CHECK(r.group_tables()[g].blocks == before[g].blocks);
  }

  // Step 3: 0 computed means unchanged (c stays 16), n = 24: the window reaches ceil(24 / 4).
  REQUIRE(r.Extend(4).ok());
  CHECK(r.group_table("swa")->first_block_position == 2);
  CHECK(r.group_table("swa")->blocks.size() == 4);
  REQUIRE(r.Extend(0, 24).ok());  // c = 24: window [19/4, 6) = [4, 6)
  CHECK(r.group_table("swa")->first_block_position == 4);
  CHECK(r.group_table("swa")->blocks.size() == 2);
  CHECK(r.group_table("full")->blocks.size() == 6);
  still_there();

  // End publishes the full table and lets everything go: nothing stays owned or reserved.
  auto end = r.End(6, Range(13, 12), /*completed=*/true);
  REQUIRE(end.ok());
  CHECK(end->kept + end->already_cached == 6);
  const Counts done = HyCounts(**observer);
  CHECK(done.owned == 0);
  CHECK(done.reserved == 0);
  CHECK(done.free + done.cached == 70);
  CHECK(done.evictable == done.cached);
  CHECK((*observer)->Report()->live_requests == 0);

  // The same through steps: a StepRequest keeps the tables, a grow reports computed tokens.
  client::StepRequest s;
  client::StepBatch batch;
  batch.Start(&s, PoolRequest("stepped", Range(100, 8), 16, "hy"));
  auto answer = (*c)->Step(batch);
  REQUIRE(answer.ok());
  REQUIRE(answer->items[0].status.ok());
  REQUIRE(s.group_tables.size() == 3);
  CHECK(s.group_table("swa")->blocks.size() == 2);  // [0, ceil(min(8, 8) / 4))
  CHECK(s.group_table("full")->blocks == s.blocks);
  const BlockIndex first_window = s.group_table("swa")->blocks[0];
  for (int step = 0; step < 3; ++step) {
    batch.Clear();
    batch.Grow(&s, 4, s.num_tokens);
    answer = (*c)->Step(batch);
    REQUIRE(answer.ok());
    REQUIRE(answer->items[0].status.ok());
    CHECK(answer->sent);  // this client asks no credit: every grow is a round trip
  }
  // c = 16, n = 20: window [11/4, 5) = [2, 5); the full table covers every position.
  CHECK(s.num_tokens == 20);
  CHECK(s.group_table("swa")->first_block_position == 2);
  CHECK(s.group_table("swa")->blocks.size() == 3);
  CHECK(s.group_table("swa")->blocks[0] != first_window);
  CHECK(s.group_table("full")->blocks.size() == 5);
  CHECK(s.group_table("full")->blocks == s.blocks);
  batch.Clear();
  batch.Grow(&s, 1, 4);  // back below 16
  answer = (*c)->Step(batch);
  REQUIRE(answer.ok());
  CHECK(answer->items[0].status.code() == absl::StatusCode::kInvalidArgument);
  CHECK(s.num_tokens == 20);
  CHECK(s.group_table("swa")->first_block_position == 2);
  batch.Clear();
  batch.End(&s, 0, {}, /*completed=*/true);
  answer = (*c)->Step(batch);
  REQUIRE(answer.ok());
  REQUIRE(answer->items[0].status.ok());
  CHECK(HyCounts(**observer).owned == 0);
  CHECK(HyCounts(**observer).reserved == 0);
}

// Prefix reuse on a hybrid pool (docs/hybrid.md §2.6, §2.7): one worker publishes a prompt with
// the state at a checkpoint; another worker's start hits there and reads, through its own group
// views, the first worker's full blocks, window blocks and checkpoint slot.
std::vector<Token> Concat(std::vector<Token> a, const std::vector<Token>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST_CASE("A second worker's start hits at a published checkpoint: window blocks and checkpoint slot",
          "[integration][hybrid]") {
  DaemonProcess d(HybridPool("", "    step_tokens: 8\n"));
  auto a = client::Client::Connect({.target = d.target()});
  auto b = client::Client::Connect({.target = d.target()});
  REQUIRE((a.ok() && b.ok()));
  auto pool_a = (*a)->FindPool("hy");
  auto pool_b = (*b)->FindPool("hy");
  REQUIRE((pool_a.ok() && pool_b.ok()));
  constexpr int kRec = 2;

  auto first = (*a)->Start(PoolRequest("first", Range(1, 17), 0, "hy"));
  REQUIRE(first.ok());
  client::KvRequest& r = **first;
  CHECK(r.cached_tokens() == 0);
  const GroupTable full_a = *r.group_table("full");
  const GroupTable swa_a = *r.group_table("swa");
  REQUIRE(swa_a.first_block_position == 0);
  REQUIRE(swa_a.blocks.size() == 2);
  const BlockIndex spare = r.group_table("rec")->blocks[1];
  // The engine computes positions [0, 8) of every group and the state at 8 into its spare.
  auto write = [&](const std::string& group, BlockIndex unit) {
    auto view = client::GroupKv(**pool_a, group);
    REQUIRE(view.ok());
    const int64_t local = view->Local(unit);
    for (int32_t j = 0; j < static_cast<int32_t>(view->layers.size()); ++j) {
      const std::string bytes = UnitPattern(view->layer_unit_bytes, local, j, group[0]);
      std::memcpy(view->Unit(j, local), bytes.data(), bytes.size());
    }
  };
  auto reads = [&](const std::string& group, BlockIndex unit) {
    auto view = client::GroupKv(**pool_b, group);
    REQUIRE(view.ok());
    const int64_t local = view->Local(unit);
    bool same = true;
    for (int32_t j = 0; j < static_cast<int32_t>(view->layers.size()); ++j) {
      const std::string bytes = UnitPattern(view->layer_unit_bytes, local, j, group[0]);
      same = same && std::memcmp(view->Unit(j, local), bytes.data(), bytes.size()) == 0;
    }
    return same;
  };
  for (int i = 0; i < 2; ++i) {
    write("full", full_a.blocks[i]);
    write("swa", swa_a.blocks[i]);
  }
  write("rec", spare);
  const absl::StatusOr<PublishResult> published =
      r.Publish(Range(1, 8), std::vector<StateCheckpoint>{{kRec, 8, spare}});
  REQUIRE(published.ok());
  REQUIRE(published->checkpoint_outcomes == std::vector<CheckpointOutcome>{CheckpointOutcome::kKept});
  // The kept slot left the first request's table for a fresh spare.
  const GroupTable* rec_a = r.group_table("rec");
  CHECK(rec_a->blocks.size() == 2);
  CHECK(std::find(rec_a->blocks.begin(), rec_a->blocks.end(), spare) == rec_a->blocks.end());

  // Two blocks shared: the hit ends at the checkpoint, with the window before it and the state.
  auto second = (*b)->Start(PoolRequest("second", Concat(Range(1, 8), Range(500, 9)), 0, "hy"));
  REQUIRE(second.ok());
  client::KvRequest& s = **second;
  CHECK(s.cached_tokens() == 8);
  const GroupTable* full_b = s.group_table("full");
  const GroupTable* swa_b = s.group_table("swa");
  const GroupTable* rec_b = s.group_table("rec");
  REQUIRE((full_b != nullptr && swa_b != nullptr && rec_b != nullptr));
  CHECK(std::vector<BlockIndex>(full_b->blocks.begin(), full_b->blocks.begin() + 2) ==
        std::vector<BlockIndex>(full_a.blocks.begin(), full_a.blocks.begin() + 2));
  CHECK(swa_b->first_block_position == 0);
  REQUIRE(swa_b->blocks.size() >= 2);
  CHECK(swa_b->blocks[0] == swa_a.blocks[0]);
  CHECK(swa_b->blocks[1] == swa_a.blocks[1]);
  CHECK(rec_b->checkpoint_slot == spare);
  CHECK(rec_b->blocks.size() == 1);  // the running slot; the checkpoint stands for the spare
  CHECK(full_a.checkpoint_slot == -1);
  // The bytes the first worker wrote, read through the second worker's views.
  for (int i = 0; i < 2; ++i) {
    CHECK(reads("full", full_b->blocks[i]));
    CHECK(reads("swa", swa_b->blocks[i]));
  }
  CHECK(reads("rec", static_cast<BlockIndex>(rec_b->checkpoint_slot)));
  CHECK(*(*b)->PeekPrefixLen(Namespace{.pool = "hy"}, Concat(Range(1, 8), {7})) == 8);

  // The same through a step: a publish item with the state at 8 (already cached there: the slot
  // stays the request's), then an end item.
  client::StepRequest t;
  client::StepBatch batch;
  batch.Start(&t, PoolRequest("stepped", Concat(Range(1, 8), Range(700, 9)), 0, "hy"));
  auto answer = (*b)->Step(batch);
  REQUIRE(answer.ok());
  REQUIRE(answer->items[0].status.ok());
  CHECK(t.acquired.cached_tokens == 8);
  CHECK(t.group_table("rec")->checkpoint_slot == spare);
  batch.Clear();
  const BlockIndex running = t.group_table("rec")->blocks[0];
  batch.Publish(&t, Concat(Range(1, 8), Range(700, 8)), 4, {{kRec, 8, running}});
  answer = (*b)->Step(batch);
  REQUIRE(answer.ok());
  REQUIRE(answer->items[0].status.ok());
  CHECK(answer->items[0].checkpoint_outcomes ==
        std::vector<CheckpointOutcome>{CheckpointOutcome::kAlreadyCached});
  CHECK(t.group_table("rec")->blocks == std::vector<BlockIndex>{running});
  batch.Clear();
  batch.End(&t, 0, {}, true);
  REQUIRE((*b)->Step(batch).ok());

  // One block shared (fewer than k = 2): no checkpoint there, no hit.
  auto third = (*b)->Start(PoolRequest("third", Concat(Range(1, 4), Range(900, 9)), 0, "hy"));
  REQUIRE(third.ok());
  CHECK((*third)->cached_tokens() == 0);
  CHECK((*third)->group_table("rec")->checkpoint_slot == -1);
  REQUIRE((*third)->Release(true).ok());
  REQUIRE(s.Release(true).ok());
  REQUIRE(r.End(0, {}, true).ok());
}

}  // namespace
}  // namespace kvd::testing
