#include "server/core/event_log.h"

#include <catch2/catch.hpp>
#include <random>
#include <tuple>
#include <vector>

namespace kvd {
namespace {

CacheEvent Stored(BlockIndex b) {
  CacheEvent e;
  e.kind = CacheEventKind::kStored;
  e.block = b;
  return e;
}

TEST_CASE("EventLog numbers events and replays what a watcher missed", "[core][events]") {
  EventLog log(4);
  for (BlockIndex b = 0; b < 3; ++b) REQUIRE(log.Append(Stored(b)) == b + 1);
  auto r = log.ReadAfter(1, 10);
  REQUIRE_FALSE(r.resync);
  REQUIRE(r.events.size() == 2);
  REQUIRE(r.events[0].sequence == 2);
  REQUIRE(r.events[1].sequence == 3);
  REQUIRE(log.ReadAfter(3, 10).events.empty());
  REQUIRE(log.ReadAfter(0, 2).events.size() == 2);
}

TEST_CASE("EventLog tells a watcher that fell behind to resync", "[core][events]") {
  EventLog log(2);
  for (BlockIndex b = 0; b < 5; ++b) log.Append(Stored(b));
  REQUIRE(log.ReadAfter(1, 10).resync);
  auto r = log.ReadAfter(3, 10);
  REQUIRE_FALSE(r.resync);
  REQUIRE(r.events.size() == 2);
  REQUIRE(r.events[0].sequence == 4);
}

TEST_CASE("EventLog replays every field of an event, payload included", "[core][events]") {
  EventLog log(8);
  CacheEvent e = Stored(7);
  e.time = absl::FromUnixMillis(1234567);
  e.pool = "llama";
  e.adapter = "sql-lora";
  e.key = BlockKey{1, 2};
  e.parent_key = BlockKey{3, 4};
  e.has_parent = true;
  e.block_tokens = 4;
  e.tokens = {10, 11, 12, 13};
  e.medium = "disk";
  log.Append(e);
  CacheEvent removed;
  removed.kind = CacheEventKind::kRemoved;
  removed.pool = "llama";
  removed.key = BlockKey{1, 2};
  log.Append(removed);
  auto r = log.ReadAfter(0, 10);
  REQUIRE(r.events.size() == 2);
  const CacheEvent& got = r.events[0];
  REQUIRE(got.sequence == 1);
  REQUIRE(got.kind == CacheEventKind::kStored);
  REQUIRE(got.time == e.time);
  REQUIRE(got.pool == "llama");
  REQUIRE(got.adapter == "sql-lora");
  REQUIRE(got.key == e.key);
  REQUIRE(got.parent_key == e.parent_key);
  REQUIRE(got.has_parent);
  REQUIRE(got.block == 7);
  REQUIRE(got.block_tokens == 4);
  REQUIRE(got.tokens == e.tokens);
  REQUIRE(got.medium == "disk");
  REQUIRE(r.events[1].kind == CacheEventKind::kRemoved);
  REQUIRE(r.events[1].tokens.empty());
  REQUIRE(r.events[1].adapter.empty());
}

TEST_CASE("EventLog's memory is fixed: long blocks shorten replay, never grow the log", "[core][events]") {
  EventLog log(1024);
  const size_t bytes = log.memory_bytes();
  CacheEvent big = Stored(0);
  big.pool = "m";
  big.tokens.assign(4096, 9);  // 16 KiB of tokens each: the byte ring holds only a few
  uint64_t seq = 0;
  for (int i = 0; i < 100; ++i) {
    big.tokens[0] = static_cast<Token>(i);
    seq = log.Append(big);
  }
  REQUIRE(log.memory_bytes() == bytes);
  REQUIRE(log.ReadAfter(0, 1000).resync);  // its payload was overwritten: resync, not a gap
  auto recent = log.ReadAfter(seq - 2, 10);
  REQUIRE_FALSE(recent.resync);
  REQUIRE(recent.events.size() == 2);
  REQUIRE(recent.events[1].tokens.size() == 4096);
  REQUIRE(recent.events[1].tokens[0] == 99);
  // One event larger than the whole byte ring cannot be replayed whole: resync.
  CacheEvent huge = Stored(1);
  huge.tokens.assign(bytes, 1);
  const uint64_t h = log.Append(huge);
  REQUIRE(log.ReadAfter(h - 1, 10).resync);
  REQUIRE(log.memory_bytes() == bytes);
  // A 16-token block fits kPayloadBytesPerEvent with its names: a full ring of them replays.
  EventLog small(4096);
  CacheEvent b16 = Stored(2);
  b16.pool = "llama-3-8b";
  b16.adapter = "lora";
  b16.tokens.assign(16, 5);
  for (int i = 0; i < 10000; ++i) small.Append(b16);
  auto all = small.ReadAfter(10000 - 4096, 5000);
  REQUIRE_FALSE(all.resync);
  REQUIRE(all.events.size() == 4096);
  REQUIRE(small.ReadAfter(10000 - 4097, 10).resync);
}

CacheEvent ChainBlock(const BlockKey& key, const BlockKey* parent, BlockIndex block) {
  CacheEvent e = Stored(block);
  e.time = absl::FromUnixMillis(5);
  e.pool = "llama";
  e.adapter = "lora";
  e.key = key;
  e.has_parent = parent != nullptr;
  if (parent != nullptr) e.parent_key = *parent;
  e.block_tokens = 16;
  e.tokens.assign(16, static_cast<Token>(block));
  return e;
}

// Every field the log keeps (it drops media keys, method and salt).
auto KeptFields(const CacheEvent& e) {
  return std::tie(e.sequence, e.kind, e.time, e.pool, e.adapter, e.medium, e.key, e.has_parent, e.parent_key,
                  e.block, e.block_tokens, e.tokens);
}

void RequireSame(const CacheEvent& got, const CacheEvent& want) { REQUIRE(KeptFields(got) == KeptFields(want)); }

TEST_CASE("EventLog keeps a chain of stored blocks, and a removal pass, as one record each", "[core][events]") {
  EventLog log(64);
  std::vector<CacheEvent> appended;
  for (uint64_t b = 0; b < 40; ++b) {
    const BlockKey key{b + 1, 7};
    const BlockKey parent{b, 7};
    appended.push_back(ChainBlock(key, b == 0 ? nullptr : &parent, static_cast<BlockIndex>(b)));
    appended.back().sequence = log.Append(appended.back());
  }
  REQUIRE(log.num_runs() == 1);
  for (uint64_t b = 40; b-- > 30;) {  // an eviction pass, leaf to root
    CacheEvent e;
    e.kind = CacheEventKind::kRemoved;
    e.time = absl::FromUnixMillis(6);
    e.pool = "llama";
    e.adapter = "lora";
    e.key = BlockKey{b + 1, 7};
    e.block = static_cast<BlockIndex>(b);
    e.block_tokens = 16;
    appended.push_back(e);
    appended.back().sequence = log.Append(e);
  }
  REQUIRE(log.num_runs() == 2);
  // A watcher resuming anywhere, inside a run too, gets exactly the events it missed.
  for (uint64_t seen = 0; seen <= appended.size(); ++seen) {
    auto r = log.ReadAfter(seen, 1000);
    REQUIRE_FALSE(r.resync);
    REQUIRE(r.events.size() == appended.size() - seen);
    for (size_t i = 0; i < r.events.size(); ++i) RequireSame(r.events[i], appended[seen + i]);
  }
  // Batches that end inside a run resume where they stopped.
  std::vector<CacheEvent> batched;
  for (uint64_t seen = 0;;) {
    auto r = log.ReadAfter(seen, 7);
    if (r.events.empty()) break;
    batched.insert(batched.end(), r.events.begin(), r.events.end());
    seen = batched.back().sequence;
  }
  REQUIRE(batched.size() == appended.size());
  // Anything else starts a new run: another parent, time, adapter or kind.
  const BlockKey other{999, 7};
  CacheEvent next = ChainBlock(BlockKey{41, 7}, &other, 41);
  log.Append(next);
  REQUIRE(log.num_runs() == 3);
  next = ChainBlock(BlockKey{42, 7}, &next.key, 42);
  next.time = absl::FromUnixMillis(8);
  log.Append(next);
  REQUIRE(log.num_runs() == 4);
  CacheEvent lora2 = ChainBlock(BlockKey{43, 7}, &next.key, 43);
  lora2.time = next.time;
  lora2.adapter = "other";
  log.Append(lora2);
  REQUIRE(log.num_runs() == 5);
}

TEST_CASE("EventLog splits a run longer than half its byte ring, so recent events stay replayable", "[core][events]") {
  EventLog log(64);  // 64 KiB of payload (the minimum): ~780 16-token entries
  for (uint64_t b = 0; b < 5000; ++b) {
    const BlockKey parent{b, 3};
    log.Append(ChainBlock(BlockKey{b + 1, 3}, b == 0 ? nullptr : &parent, static_cast<BlockIndex>(b)));
  }
  REQUIRE(log.num_runs() > 1);
  auto r = log.ReadAfter(5000 - 32, 100);
  REQUIRE_FALSE(r.resync);
  REQUIRE(r.events.size() == 32);
  REQUIRE(r.events.back().key == BlockKey{5000, 3});
  REQUIRE(r.events.front().parent_key == BlockKey{5000 - 32, 3});
}

TEST_CASE("EventLog replays exactly what was appended, runs or not (randomized against a list)", "[core][events]") {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    std::mt19937_64 rng(seed);
    const size_t capacity = 16 + rng() % 200;
    EventLog log(capacity);
    std::vector<CacheEvent> model;
    BlockKey last_stored{};
    int64_t now_ms = 0;
    for (int step = 0; step < 3000; ++step) {
      CacheEvent e;
      const int dice = static_cast<int>(rng() % 100);
      e.kind = dice < 70 ? CacheEventKind::kStored : dice < 97 ? CacheEventKind::kRemoved : CacheEventKind::kCleared;
      if (rng() % 8 == 0) ++now_ms;
      e.time = absl::FromUnixMillis(now_ms);
      if (e.kind != CacheEventKind::kCleared) {
        e.pool = rng() % 6 == 0 ? "bb" : "a";
        e.adapter = rng() % 5 == 0 ? "x" : "";
        e.medium = rng() % 9 == 0 ? "disk" : "";
        e.key = BlockKey{rng(), rng()};
        e.block = static_cast<BlockIndex>(rng() % 1000);
        e.block_tokens = rng() % 7 == 0 ? 4 : 16;
      }
      if (e.kind == CacheEventKind::kStored) {
        const int p = static_cast<int>(rng() % 10);
        e.has_parent = p < 8;
        e.parent_key = p < 7 ? last_stored : p < 8 ? BlockKey{rng(), 1} : BlockKey{};
        e.tokens.assign(rng() % 11 == 0 ? 3 : static_cast<size_t>(e.block_tokens), static_cast<Token>(rng()));
        e.tokens[0] = static_cast<Token>(step);
        last_stored = e.key;
      }
      e.sequence = log.Append(e);
      REQUIRE(e.sequence == model.size() + 1);
      model.push_back(e);
      if (step % 3 != 0) continue;
      const uint64_t seen = rng() % (model.size() + 1);
      const size_t max_events = 1 + rng() % 64;
      auto r = log.ReadAfter(seen, max_events);
      // The last capacity/2 events are always replayable (a run takes at most half the byte ring).
      if (model.size() - seen <= capacity / 2) REQUIRE_FALSE(r.resync);
      if (model.size() - seen > capacity) REQUIRE(r.resync);  // no deeper than configured
      if (r.resync) {
        REQUIRE(r.events.empty());
        continue;
      }
      REQUIRE(r.events.size() == std::min<size_t>(max_events, model.size() - seen));
      for (size_t i = 0; i < r.events.size(); ++i) RequireSame(r.events[i], model[seen + i]);
    }
    REQUIRE(log.num_runs() < model.size());  // chains did coalesce
  }
}

}  // namespace
}  // namespace kvd
