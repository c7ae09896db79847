// Canonical CBOR and vLLM's sha256_cbor block hashes. Expected values were produced by Python's
// cbor2.dumps(x, canonical=True) and hashlib.sha256 (tests/python/test_router_events.py computes
// them live against a running daemon).
#include <catch2/catch.hpp>

#include "absl/strings/escaping.h"
#include "server/events/cbor_writer.h"
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
  const std::vector<std::string> extra = {"lora-x", "tenant"};
  const RouterHash h2 = hasher.BlockHash(&h1, b2, extra);
  REQUIRE(Hex(h2) == "446521088b97dc4ce8a3f88ac4a1c03ecdd8d68d2d860a2e6a21d89d496d3fb0");
  REQUIRE(RouterHasher::EventId(h2) == 7647631812305174448ull);
  const Token b3[] = {70000, 4294967295u, 0, 23};  // every integer head width
  REQUIRE(RouterHasher::EventId(hasher.BlockHash(&h2, b3, {})) == 8496768549588427766ull);
  // Another seed is another chain.
  REQUIRE(RouterHasher("0").BlockHash(nullptr, b1, {}) != h1);
}

TEST_CASE("Router extra keys follow vLLM's order; the salt only on the first block", "[events]") {
  REQUIRE(RouterExtraKeys("", {}, "", "", true).empty());
  REQUIRE(RouterExtraKeys("lora", {"img1", "img2"}, "salt", "", true) ==
          std::vector<std::string>{"lora", "img1", "img2", "salt"});
  REQUIRE(RouterExtraKeys("lora", {}, "salt", "", false) == std::vector<std::string>{"lora"});
  REQUIRE(RouterExtraKeys("", {}, "", "fp8", false) == std::vector<std::string>{"fp8"});
}

}  // namespace
}  // namespace kvd
