// The publisher end to end: a KvCache with a pool without groups and a hybrid pool publishes into
// a RouterEventPublisher; each topic's batch, read back through the replay socket, is exactly the
// encoder's bytes for the expected events — the plain pool's without group fields (vLLM's
// pre-hybrid shape), the hybrid pool's with its full group (index 1 here: groups swa, full).
#include <unistd.h>
#include <zmq.h>

#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/time/clock.h"
#include "server/events/router_event_encoding.h"
#include "server/events/router_event_publisher.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

std::string Be8(int64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((static_cast<uint64_t>(v) >> (8 * (7 - i))) & 0xff);
  return out;
}

// Every buffered batch, by topic: [empty, topic, seq, payload] replies to [empty, start 0].
std::map<std::string, std::vector<std::string>> Replay(const std::string& endpoint) {
  void* ctx = zmq_ctx_new();
  void* dealer = zmq_socket(ctx, ZMQ_DEALER);
  const int linger = 0, timeout_ms = 5000;
  zmq_setsockopt(dealer, ZMQ_LINGER, &linger, sizeof(linger));
  zmq_setsockopt(dealer, ZMQ_RCVTIMEO, &timeout_ms, sizeof(timeout_ms));
  REQUIRE(zmq_connect(dealer, endpoint.c_str()) == 0);
  const std::string start = Be8(0);
  zmq_send(dealer, "", 0, ZMQ_SNDMORE);
  zmq_send(dealer, start.data(), start.size(), 0);
  std::map<std::string, std::vector<std::string>> out;
  for (;;) {
    std::vector<std::string> frames;
    int more = 1;
    while (more != 0) {
      zmq_msg_t m;
      zmq_msg_init(&m);
      REQUIRE(zmq_msg_recv(&m, dealer, 0) >= 0);
      frames.emplace_back(static_cast<const char*>(zmq_msg_data(&m)), zmq_msg_size(&m));
      more = zmq_msg_more(&m);
      zmq_msg_close(&m);
    }
    REQUIRE(frames.size() == 4);
    if (frames[1].empty()) break;  // the end marker
    out[frames[1]].push_back(frames[3]);
  }
  zmq_close(dealer);
  zmq_ctx_term(ctx);
  return out;
}

// The batch timestamp: [ts, ...] starts 0x93 0xcb, then the float64 big-endian.
double TsOf(const std::string& payload) {
  REQUIRE(payload.size() > 10);
  REQUIRE(static_cast<uint8_t>(payload[1]) == 0xcb);
  uint64_t bits = 0;
  for (int i = 2; i < 10; ++i) bits = (bits << 8) | static_cast<uint8_t>(payload[i]);
  double ts = 0;
  std::memcpy(&ts, &bits, sizeof(ts));
  return ts;
}

TEST_CASE("A hybrid pool's router events carry its full group; a plain pool's are unchanged", "[events]") {
  PoolGeometry hy;
  hy.name = "hy";
  hy.block_tokens = 4;
  hy.num_layers = 2;
  hy.bytes_per_token_per_layer = 8;
  hy.max_model_len = 64;
  hy.step_tokens = 8;
  hy.groups.push_back(KvGroup{.name = "swa", .kind = KvGroupKind::kSlidingWindow, .layers = {0}, .window = 6,
                              .capacity = 16});
  hy.groups.push_back(KvGroup{.name = "full", .kind = KvGroupKind::kFull, .layers = {1}, .capacity = 16});
  REQUIRE(hy.ResolveGroups().ok());
  CacheOptions o = testing::SmallOptions();
  o.pools.push_back(hy);
  FakeClock clock;  // a whole second: the timestamp is still a float64
  std::unique_ptr<KvCache> cache = testing::MakeCache(o, &clock);

  const std::string dir = std::filesystem::temp_directory_path() / ("kvd-ev-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  RouterEventsOptions ro;
  ro.endpoint = "ipc://" + dir + "/events";
  ro.replay_endpoint = "ipc://" + dir + "/replay";
  ro.node = "n1";
  ro.hash_seed = "7";
  ro.pools = {"m", "hy"};
  ro.device_medium = "GPU";
  auto publisher = RouterEventPublisher::Start(ro);
  REQUIRE(publisher.ok());
  (*publisher)->Attach(cache.get());

  const std::vector<Token> prompt = testing::Seq(10, 9);  // two full blocks and one token
  for (const std::string pool : {"m", "hy"}) {
    const RequestSpec spec = testing::Spec("r-" + pool, prompt, 0, pool);
    const AcquireResult acq = testing::Start(*cache, spec);
    testing::PublishAll(*cache, spec, {prompt.begin(), prompt.begin() + 8}, acq);
    REQUIRE(cache->Release(spec.id, true).ok());
  }
  for (int i = 0; i < 500 && (*publisher)->Stats().batches < 2; ++i) absl::SleepFor(absl::Milliseconds(10));
  // The publisher drains its queue whenever it wakes: on a slow run (sanitizers) it may wake between
  // a publish's two block events and send them as two batches. Let any such second batch go out.
  absl::SleepFor(absl::Milliseconds(300));
  REQUIRE((*publisher)->Stats().batches >= 2);
  const auto batches = Replay(ro.replay_endpoint);
  publisher->reset();
  std::filesystem::remove_all(dir);

  // The chain both pools announce: vLLM's sha256_cbor ids of the two blocks.
  const RouterHasher hasher("7");
  const RouterHash h0 = hasher.BlockHash(nullptr, {prompt.data(), 4}, {});
  const RouterHash h1 = hasher.BlockHash(&h0, {prompt.data() + 4, 4}, {});
  RouterEvent stored;
  stored.kind = CacheEventKind::kStored;
  stored.medium = "GPU";
  stored.ids = {RouterHasher::EventId(h0), RouterHasher::EventId(h1)};
  stored.tokens = {prompt.begin(), prompt.begin() + 8};
  stored.block_size = 4;
  // One batch with both blocks, or (a drain between them) one batch per block, the second naming
  // the first as its parent.
  auto expect_chain = [&](const std::vector<std::string>& got, const RouterEvent& chain) {
    if (got.size() == 1) {
      CHECK(absl::BytesToHexString(got[0]) ==
            absl::BytesToHexString(EncodeRouterBatch(TsOf(got[0]), {chain}, 0, false)));
      return;
    }
    REQUIRE(got.size() == 2);
    RouterEvent first = chain;
    first.ids = {chain.ids[0]};
    first.tokens = {chain.tokens.begin(), chain.tokens.begin() + 4};
    RouterEvent second = chain;
    second.ids = {chain.ids[1]};
    second.tokens = {chain.tokens.begin() + 4, chain.tokens.end()};
    second.has_parent = true;
    second.parent_id = chain.ids[0];
    CHECK(absl::BytesToHexString(got[0]) ==
          absl::BytesToHexString(EncodeRouterBatch(TsOf(got[0]), {first}, 0, false)));
    CHECK(absl::BytesToHexString(got[1]) ==
          absl::BytesToHexString(EncodeRouterBatch(TsOf(got[1]), {second}, 0, false)));
  };
  REQUIRE(batches.size() == 2);
  expect_chain(batches.at("kv@n1@m"), stored);
  stored.group = RouterEventGroup{1, "full_attention", 0};
  expect_chain(batches.at("kv@n1@hy"), stored);
}

}  // namespace
}  // namespace kvd
