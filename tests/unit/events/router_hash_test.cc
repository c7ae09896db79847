// Canonical CBOR and vLLM's sha256_cbor block hashes. Expected values were produced by Python's
// cbor2.dumps(x, canonical=True) and hashlib.sha256 (tests/python/test_router_events.py computes
// them live against a running daemon).
#include <catch2/catch.hpp>

#include "absl/strings/escaping.h"
#include "server/events/cbor_writer.h"
#include "proto/vocab/media_span.h"
#include "server/events/router_hash.h"

namespace kvd {
namespace {

std::string Hex(const std::string& bytes) { return absl::BytesToHexString(bytes); }
std::string Hex(const RouterHash& h) { return Hex(std::string(h.begin(), h.end())); }

TEST_CASE("CborWriter writes integer heads in their shortest form", "[events]") {
  const std::pair<int64_t, const char*> ints[] = {
      {0, "00"},         {23, "17"},           {24, "1818"},        {255, "18ff"},
      {256, "190100"},   {65535, "19ffff"},     {65536, "1a00010000"}, {-1, "20"},
      {-24, "37"},       {-25, "3818"},         {-256, "38ff"},      {-257, "390100"}};
  for (const auto& [v, want] : ints) {
    CborWriter w;
    w.Int(v);
    INFO(v);
    REQUIRE(Hex(w.data()) == want);
  }
  CborWriter w;
  w.Uint(4294967295u);
  w.Uint(4294967296u);
  w.Uint(UINT64_MAX);
  REQUIRE(Hex(w.data()) == "1affffffff1b00000001000000001bffffffffffffffff");
}

TEST_CASE("CborWriter writes strings, arrays and null like cbor2", "[events]") {
  CborWriter w;
  w.Bytes({});
  const uint8_t ab[] = {'a', 'b'};
  w.Bytes(ab);
  w.Text("");
  w.Text("a");
  w.Null();
  w.Array(0);
  REQUIRE(Hex(w.data()) == "40426162606161f680");
  CborWriter nested;  // [1, [2, 3]]
  nested.Array(2);
  nested.Uint(1);
  nested.Array(2);
  nested.Uint(2);
  nested.Uint(3);
  REQUIRE(Hex(nested.data()) == "8201820203");
  CborWriter long_text;
  long_text.Text(std::string(24, 'x'));
  REQUIRE(Hex(long_text.data()).substr(0, 4) == "7818");
  CborWriter long_array;  // tuple(range(30)) starts 98 1e 00 01 ...
  long_array.Array(30);
  REQUIRE(Hex(long_array.data()) == "981e");
}

TEST_CASE("Router hashes equal vLLM's sha256_cbor chain", "[events]") {
  const RouterHasher hasher("1234");
  REQUIRE(Hex(hasher.root()) == "dfa66c9da4dad0601316e0b63a2909b4068e72830385ddbd16e0c980c76c9e12");
  const Token b1[] = {1, 2, 3, 4};
  const RouterHash h1 = hasher.BlockHash(nullptr, b1, {});
  REQUIRE(Hex(h1) == "6cbb08a604ade4f149180a474cf5ed34659a3d2dddef8b287292cf72cc6e1f2a");
  REQUIRE(RouterHasher::EventId(h1) == 8255889158886530858ull);
  const Token b2[] = {5, 6, 7, 8};
  const std::vector<RouterExtraKey> extra = {{"lora-x"}, {"tenant"}};
  const RouterHash h2 = hasher.BlockHash(&h1, b2, extra);
  REQUIRE(Hex(h2) == "446521088b97dc4ce8a3f88ac4a1c03ecdd8d68d2d860a2e6a21d89d496d3fb0");
  REQUIRE(RouterHasher::EventId(h2) == 7647631812305174448ull);
  const Token b3[] = {70000, 4294967295u, 0, 23};  // every integer head width
  REQUIRE(RouterHasher::EventId(hasher.BlockHash(&h2, b3, {})) == 8496768549588427766ull);
  // Another seed is another chain.
  REQUIRE(RouterHasher("0").BlockHash(nullptr, b1, {}) != h1);
}

TEST_CASE("Positioned media hash as vLLM's (identifier, offset from the block start) pairs", "[events]") {
  // Python: sha256(cbor2.dumps((h1, (5, 6, 7, 8), ("lora-x", ("img-9", -3), ("img-7", 2))), canonical=True))
  const RouterHasher hasher("1234");
  const Token b1[] = {1, 2, 3, 4};
  const Token b2[] = {5, 6, 7, 8};
  const RouterHash h1 = hasher.BlockHash(nullptr, b1, {});
  const std::vector<RouterExtraKey> extra = {{"lora-x"}, {"img-9", true, -3}, {"img-7", true, 2}};
  const RouterHash h2 = hasher.BlockHash(&h1, b2, extra);
  REQUIRE(Hex(h2) == "2cc79d104b9a0ad0d09d8e212d32e157450d8d666c2036715b5bdc1f8800d205");
  REQUIRE(RouterHasher::EventId(h2) == 6583097308315963909ull);
}

TEST_CASE("Router extra keys follow vLLM's order; the salt only on the first block", "[events]") {
  using K = std::vector<RouterExtraKey>;
  REQUIRE(RouterExtraKeys("", {}, "", "", 0, 16).empty());
  REQUIRE(RouterExtraKeys("lora", {"img1", "img2"}, "salt", "", 0, 16) == K{{"lora"}, {"img1"}, {"img2"}, {"salt"}});
  REQUIRE(RouterExtraKeys("lora", {}, "salt", "", 16, 32) == K{{"lora"}});
  REQUIRE(RouterExtraKeys("", {}, "", "fp8", 16, 32) == K{{"fp8"}});
}

TEST_CASE("A pool's model fingerprint keys its first block, after the salt and before the method", "[events]") {
  using K = std::vector<RouterExtraKey>;
  REQUIRE(RouterExtraKeys("lora", {}, "salt", "fp8", 0, 16, "llama@v2") == K{{"lora"}, {"salt"}, {"llama@v2"}, {"fp8"}});
  REQUIRE(RouterExtraKeys("", {}, "", "", 16, 32, "llama@v2").empty());  // the chain carries it on
  // Two pools of one name whose weights differ announce different ids for the same tokens.
  const RouterHasher hasher("0");
  const std::vector<Token> tokens = {1, 2, 3, 4};
  const RouterHash v1 = hasher.BlockHash(nullptr, tokens, RouterExtraKeys("", {}, "", "", 0, 4, "llama@v1"));
  const RouterHash v2 = hasher.BlockHash(nullptr, tokens, RouterExtraKeys("", {}, "", "", 0, 4, "llama@v2"));
  const RouterHash none = hasher.BlockHash(nullptr, tokens, RouterExtraKeys("", {}, "", "", 0, 4));
  REQUIRE(RouterHasher::EventId(v1) != RouterHasher::EventId(v2));
  REQUIRE(RouterHasher::EventId(v1) != RouterHasher::EventId(none));
  const std::vector<Token> next = {5, 6, 7, 8};
  REQUIRE(RouterHasher::EventId(hasher.BlockHash(&v1, next, {})) != RouterHasher::EventId(hasher.BlockHash(&v2, next, {})));
}

TEST_CASE("A positioned media item keys only the blocks it overlaps, with its offset in each", "[events]") {
  // An image on positions [5, 11) with 4-token blocks: blocks 1 ([4, 8)) and 2 ([8, 12)).
  const std::vector<std::string> media = {PositionedMediaKey({"img", 5, 6})};
  using K = std::vector<RouterExtraKey>;
  REQUIRE(RouterExtraKeys("", media, "", "", 0, 4).empty());
  REQUIRE(RouterExtraKeys("", media, "", "", 4, 8) == K{{"img", true, 1}});
  REQUIRE(RouterExtraKeys("", media, "", "", 8, 12) == K{{"img", true, -3}});
  REQUIRE(RouterExtraKeys("", media, "", "", 12, 16).empty());
  // Two items in one block, in prompt order, between the adapter and the salt.
  const std::vector<std::string> two = {PositionedMediaKey({"a", 1, 1}), PositionedMediaKey({"b", 3, 2})};
  REQUIRE(RouterExtraKeys("lora", two, "salt", "", 0, 4) == K{{"lora"}, {"a", true, 1}, {"b", true, 3}, {"salt"}});
  // The key form round-trips; other media keys are not positioned.
  const std::optional<MediaSpan> span = ParsePositionedMediaKey(PositionedMediaKey({"sha:1+2", 7, 9}));
  REQUIRE(span.has_value());
  REQUIRE((span->identifier == "sha:1+2" && span->offset == 7 && span->length == 9));
  for (const char* other : {"img1", "mm@", "mm@1+2", "mm@x+2:id", "mm@-1+2:id", "mm@3:id"}) {
    INFO(other);
    REQUIRE_FALSE(ParsePositionedMediaKey(other).has_value());
  }
}

}  // namespace
}  // namespace kvd
