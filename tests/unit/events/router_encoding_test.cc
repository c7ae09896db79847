// Router-event payloads byte for byte. The expected bytes were written by Python's msgpack
// (msgpack.packb(..., use_bin_type=True)) from the lists and dicts vLLM's msgspec structs encode
// to (vllm/distributed/kv_events.py at 0181ea3173e5: array_like writes every field, maps leave out
// fields at their defaults), not by this encoder: a pool without groups keeps the pre-hybrid
// stream exactly, and a hybrid pool's events carry group_idx where llm-d reads it.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "server/events/router_event_encoding.h"
#include "server/events/router_event_publisher.h"

namespace kvd {
namespace {

std::vector<RouterEvent> Events(bool grouped) {
  std::vector<RouterEvent> out(4);
  out[0].kind = CacheEventKind::kStored;
  out[0].medium = "GPU";
  out[0].ids = {1, (uint64_t{1} << 63) + 5};
  out[0].has_parent = true;
  out[0].parent_id = 7;
  out[0].tokens = {1, 2, 3, 4, 5, 6, 7, 8};
  out[0].block_size = 4;
  out[1].kind = CacheEventKind::kStored;
  out[1].medium = grouped ? "CPU" : "GPU";
  out[1].ids = {9};
  out[1].tokens = {70000, 1, 2, 3};
  out[1].block_size = 4;
  out[1].lora_name = "lora-x";
  out[2].kind = CacheEventKind::kRemoved;
  out[2].medium = "GPU";
  out[2].ids = {1};
  out[3].kind = CacheEventKind::kCleared;
  if (grouped) {
    out[0].group = RouterEventGroup{0, "full_attention", 0};
    out[1].group = RouterEventGroup{1, "sliding_window", 128};
    out[2].group = RouterEventGroup{0, "full_attention", 0};
  }
  return out;
}

std::string Hex(const std::string& bytes) { return absl::BytesToHexString(bytes); }

TEST_CASE("A pool without groups encodes vLLM's pre-hybrid events, byte for byte", "[events]") {
  CHECK(Hex(EncodeRouterBatch(1.5, Events(false), 2, false)) ==
        "93cb3ff80000000000009498ab426c6f636b53746f7265649201cf80000000000000050798010203040506070804c0a3475055c0"
        "98ab426c6f636b53746f7265649109c094ce0001117001020304c0a3475055a66c6f72612d7893ac426c6f636b52656d6f766564"
        "9101a347505591b0416c6c426c6f636b73436c656172656402");
  CHECK(Hex(EncodeRouterBatch(1.5, Events(false), 2, true)) ==
        "83a27473cb3ff8000000000000a66576656e74739488a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
        "9201cf8000000000000005b1706172656e745f626c6f636b5f6861736807a9746f6b656e5f696473980102030405060708aa626c"
        "6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c088a474797065ab426c6f636b"
        "53746f726564ac626c6f636b5f6861736865739109b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647394ce"
        "00011170010203aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65a66c6f"
        "72612d7883a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739101a66d656469756da347505581a474"
        "797065b0416c6c426c6f636b73436c6561726564b2646174615f706172616c6c656c5f72616e6b02");
}

TEST_CASE("A hybrid pool's events carry group_idx, kind and window at vLLM's places", "[events]") {
  // Arrays: extra_keys nil at [8], group_idx [9], kv_cache_spec_kind [10], window [11] (nil when
  // the group has none); BlockRemoved: group_idx [3].
  CHECK(Hex(EncodeRouterBatch(1.5, Events(true), 2, false)) ==
        "93cb3ff8000000000000949cab426c6f636b53746f7265649201cf80000000000000050798010203040506070804c0a3475055c0"
        "c000ae66756c6c5f617474656e74696f6ec09cab426c6f636b53746f7265649109c094ce0001117001020304c0a3435055a66c6f"
        "72612d78c001ae736c6964696e675f77696e646f77cc8094ac426c6f636b52656d6f7665649101a34750550091b0416c6c426c6f"
        "636b73436c656172656402");
  // Maps: extra_keys and an absent window left out (their defaults).
  CHECK(Hex(EncodeRouterBatch(1.5, Events(true), 2, true)) ==
        "83a27473cb3ff8000000000000a66576656e7473948aa474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
        "9201cf8000000000000005b1706172656e745f626c6f636b5f6861736807a9746f6b656e5f696473980102030405060708aa626c"
        "6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f69647800b2"
        "6b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e8ba474797065ab426c6f636b53746f726564ac"
        "626c6f636b5f6861736865739109b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647394ce00011170010203"
        "aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65a66c6f72612d78a96772"
        "6f75705f69647801b26b765f63616368655f737065635f6b696e64ae736c6964696e675f77696e646f77bc6b765f63616368655f"
        "737065635f736c6964696e675f77696e646f77cc8084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865"
        "739101a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c6561726564b2646174"
        "615f706172616c6c656c5f72616e6b02");
}

TEST_CASE("A batch's timestamp is a float64 even when it is a whole second", "[events]") {
  // msgpack.packb([1700000000.0, [], 0]): msgspec's ts is a float; an integer there is not.
  CHECK(Hex(EncodeRouterBatch(1700000000.0, {}, 0, false)) == "93cb41d954fc400000009000");
  CHECK(Hex(EncodeRouterBatch(1700000000.0, {}, 0, true)).substr(0, 26) == "83a27473cb41d954fc40000000");
}

TEST_CASE("kvd's group kinds read as vLLM's kv_cache_spec_kind words", "[events]") {
  CHECK(RouterSpecKind("full") == "full_attention");
  CHECK(RouterSpecKind("sliding_window") == "sliding_window");
  CHECK(RouterSpecKind("chunked_local") == "chunked_local_attention");
  CHECK(RouterSpecKind("state") == "mamba");
  CHECK(RouterSpecKind("mla").empty());
}

TEST_CASE("A hybrid pool announces its first full group, by its index in the pool's order", "[events]") {
  PoolGeometry g;
  g.name = "hy";
  KvGroup swa;
  swa.name = "swa";
  swa.kind = KvGroupKind::kSlidingWindow;
  swa.window = 6;
  KvGroup full;
  full.name = "full";
  full.kind = KvGroupKind::kFull;
  KvGroup rec;
  rec.name = "rec";
  rec.kind = KvGroupKind::kState;
  g.groups = {swa, full, rec, full};
  CHECK(SpineGroupOf(g) == RouterEventGroup{1, "full_attention", 0});
  g.groups = {swa, rec};  // no full group: no spine, no events; the first group stands in
  CHECK(SpineGroupOf(g) == RouterEventGroup{0, "sliding_window", 6});
}

}  // namespace
}  // namespace kvd
