// Operations on a hybrid pool (docs/hybrid.md §2.9) against the real daemon: /metrics and kvdctl
// count every KV group's units (free, owned, cached; a state group's cached units are its
// checkpoints), the groups add up to the pool, a refused publish changes no count, a hit a group
// shortens is counted against it, a released request leaves nothing owned, and a pool without
// groups mints no group series.
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <google/protobuf/util/json_util.h>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "kvd/v1/kvd.pb.h"
#include "tests/integration/harness.h"

namespace kvd::testing {
namespace {

std::vector<Token> Concat(std::vector<Token> a, const std::vector<Token>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Groups listed swa, full, rec (the full group is not the first); 4-token blocks.
const char* kHybridPool =
    "pools:\n"
    "  - name: hy\n"
    "    block_tokens: 4\n"
    "    num_layers: 4\n"
    "    bytes_per_token_per_layer: 16\n"
    "    max_model_len: 64\n"
    "    step_tokens: 8\n"
    "    groups:\n"
    "      - {name: swa, kind: sliding_window, layers: [0], window: 6, capacity_blocks: 24}\n"
    "      - {name: full, kind: full, layers: [\"1-3/2\"], capacity_blocks: 40}\n"
    "      - {name: rec, kind: state, layers: [2], bytes_per_state: 100, checkpoint_every_blocks: 2, "
    "capacity_slots: 6}\n";

struct GroupCounts {
  int64_t free = 0, owned = 0, referenced = 0, evictable = 0;
  int64_t sum() const { return free + owned + referenced + evictable; }
  int64_t Get(const std::string& state) const {
    return state == "free" ? free : state == "owned" ? owned : state == "cached_referenced" ? referenced : evictable;
  }
  bool operator==(const GroupCounts& o) const {
    return free == o.free && owned == o.owned && referenced == o.referenced && evictable == o.evictable;
  }
};

GroupCounts Scrape(const std::string& body, const std::string& group, const std::string& kind) {
  const auto units = [&](const std::string& state) {
    return MetricValue(body, absl::StrCat("kvd_group_units{pool=\"hy\",group=\"", group, "\",kind=\"", kind,
                                          "\",state=\"", state, "\"}"));
  };
  return {units("free"), units("owned"), units("cached_referenced"), units("cached_evictable")};
}

TEST_CASE("Metrics and kvdctl count a hybrid pool per KV group", "[integration][hybrid][ops]") {
  DaemonProcess d(kHybridPool);
  const struct {
    std::string name, kind;
    int64_t capacity, unit_bytes;
  } groups[] = {{"swa", "sliding_window", 24, 4 * 16}, {"full", "full", 40, 4 * 16 * 2}, {"rec", "state", 6, 100}};
  auto scrape = [&] {
    absl::StatusOr<std::string> body = HttpGet(d.metrics_port(), "/metrics");
    REQUIRE(body.ok());
    return *body;
  };
  std::string body = scrape();
  for (const auto& g : groups) {
    INFO(g.name);
    CHECK(Scrape(body, g.name, g.kind) == GroupCounts{g.capacity, 0, 0, 0});
    CHECK(MetricValue(body, absl::StrCat("kvd_group_capacity_units{pool=\"hy\",group=\"", g.name, "\",kind=\"",
                                         g.kind, "\"}")) == g.capacity);
    CHECK(MetricValue(body, absl::StrCat("kvd_group_bytes{pool=\"hy\",group=\"", g.name, "\",state=\"total\"}")) ==
          g.capacity * g.unit_bytes);
  }

  auto c = client::Client::Connect({.target = d.target()});
  REQUIRE(c.ok());
  auto started = (*c)->Start(PoolRequest("a", Range(1, 17), 0, "hy"));
  REQUIRE(started.ok());
  client::KvRequest& r = **started;
  const BlockIndex spare = r.group_table("rec")->blocks[1];
  // Live: 5 full blocks, the window's 2 (the step horizon: 8 tokens), 2 state slots.
  body = scrape();
  CHECK(Scrape(body, "full", "full") == GroupCounts{35, 5, 0, 0});
  CHECK(Scrape(body, "swa", "sliding_window") == GroupCounts{22, 2, 0, 0});
  CHECK(Scrape(body, "rec", "state") == GroupCounts{4, 2, 0, 0});
  CHECK(MetricValue(body, "kvd_group_bytes{pool=\"hy\",group=\"full\",state=\"reserved\"}") > 0);

  // A careless publish naming a slot the request does not hold: refused, no count moves.
  const std::string before = scrape();
  CHECK_FALSE(r.Publish(Range(1, 8), std::vector<StateCheckpoint>{{2, 8, spare + 1000}}).ok());
  body = scrape();
  for (const auto& g : groups) CHECK(Scrape(body, g.name, g.kind) == Scrape(before, g.name, g.kind));

  // Four blocks published, the state at 8 only (the window holds blocks 0 and 1 so far).
  const absl::StatusOr<PublishResult> published = r.Publish(Range(1, 16), std::vector<StateCheckpoint>{{2, 8, spare}});
  REQUIRE(published.ok());
  REQUIRE(published->checkpoint_outcomes == std::vector<CheckpointOutcome>{CheckpointOutcome::kKept});
  body = scrape();
  // The checkpoint is cached and nobody reads it; the request took a fresh spare.
  CHECK(Scrape(body, "rec", "state") == GroupCounts{3, 2, 0, 1});
  CHECK(MetricValue(body, "kvd_state_checkpoints{pool=\"hy\",group=\"rec\",state=\"evictable\"}") == 1);
  CHECK(MetricValue(body, "kvd_state_checkpoints{pool=\"hy\",group=\"rec\",state=\"referenced\"}") == 0);

  // Another request sharing all 4 blocks: the full group would serve 16 tokens, the window and the
  // state only 8 — one lookup limited, 8 tokens lost, counted against the group that shortened it.
  auto second = (*c)->Start(PoolRequest("b", Concat(Range(1, 16), Range(500, 5)), 0, "hy"));
  REQUIRE(second.ok());
  CHECK((*second)->cached_tokens() == 8);
  REQUIRE((*second)->Release(/*completed=*/true).ok());
  body = scrape();
  int64_t limited = 0, lost = 0;
  for (const auto& g : groups) {
    limited += MetricValue(body, absl::StrCat("kvd_hybrid_limited_hits_total{pool=\"hy\",group=\"", g.name, "\"}"));
    lost += MetricValue(body, absl::StrCat("kvd_hybrid_limited_tokens_total{pool=\"hy\",group=\"", g.name, "\"}"));
  }
  CHECK(limited == 1);
  CHECK(lost == 8);
  CHECK(MetricValue(body, "kvd_hybrid_limited_hits_total{pool=\"hy\",group=\"full\"}") == 0);

  REQUIRE(r.Release(/*completed=*/true).ok());
  body = scrape();
  // Released: the unit (2 full blocks, the 2 window blocks the checkpoint reads, the checkpoint)
  // stays cached and evictable; blocks 2 and 3, which no checkpoint makes servable, went (U2);
  // nothing is owned.
  CHECK(Scrape(body, "full", "full") == GroupCounts{38, 0, 0, 2});
  CHECK(Scrape(body, "swa", "sliding_window") == GroupCounts{22, 0, 0, 2});
  CHECK(Scrape(body, "rec", "state") == GroupCounts{5, 0, 0, 1});
  for (const auto& g : groups) CHECK(Scrape(body, g.name, g.kind).sum() == g.capacity);
  // The groups add up to the pool's kvd_blocks.
  for (const char* state : {"free", "owned", "cached_referenced", "cached_evictable"}) {
    int64_t sum = 0;
    for (const auto& g : groups) {
      sum += Scrape(body, g.name, g.kind).Get(state);
    }
    CHECK(sum == MetricValue(body, absl::StrCat("kvd_blocks{pool=\"hy\",state=\"", state, "\"}")));
  }

  // kvdctl: Report carries the groups (JSON), and `pools` shows their counts.
  auto ctl = [&](std::vector<std::string> args) {
    args.insert(args.begin(), "--target=" + d.target());
    ProcessResult p = RunProcess(KVDCTL_BINARY, args);
    INFO(p.out);
    REQUIRE(p.exit_code == 0);
    return p.out;
  };
  v1::ReportResponse report;
  REQUIRE(google::protobuf::util::JsonStringToMessage(ctl({"--json", "status"}), &report).ok());
  REQUIRE(report.pools_size() == 1);
  REQUIRE(report.pools(0).groups_size() == 3);
  CHECK(report.pools(0).groups(1).name() == "full");
  CHECK(report.pools(0).groups(1).cached() == 2);
  CHECK(report.pools(0).groups(2).cached() == 1);
  CHECK(report.pools(0).groups(2).free() == 5);
  CHECK(report.pools(0).groups(0).limited_hits() + report.pools(0).groups(2).limited_hits() == 1);
  CHECK(report.pools(0).groups(0).limited_tokens() + report.pools(0).groups(2).limited_tokens() == 8);
  const std::string pools = ctl({"pools"});
  CHECK(pools.find("EVICTABLE") != pools.rfind("EVICTABLE"));  // the group table has the counts too

  // A pool without groups: no group series at all.
  DaemonProcess plain(SmallPoolConfig());
  absl::StatusOr<std::string> plain_body = HttpGet(plain.metrics_port(), "/metrics");
  REQUIRE(plain_body.ok());
  CHECK(plain_body->find("kvd_group_") == std::string::npos);
  CHECK(plain_body->find("kvd_state_checkpoints") == std::string::npos);
}

}  // namespace
}  // namespace kvd::testing
