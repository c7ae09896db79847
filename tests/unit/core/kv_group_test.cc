// KV groups of a hybrid pool (docs/hybrid.md §2.1-2.3): layer lists, every validation rule's
// message, the default capacity split, first_block and region offsets, the attach check, and the
// core's guard (a hybrid pool hits nothing until its lookup serves every group).
#include <catch2/catch.hpp>

#include "proto/vocab/pool_geometry.h"
#include "tests/unit/core/test_util.h"

namespace kvd {
namespace {

using testing::Concat;
using testing::Seq;
using testing::Spec;

// gpt-oss-like: 8 layers, odd ones full, even ones a 128-token window; 16-token blocks.
PoolGeometry Swa() {
  PoolGeometry g;
  g.name = "oss";
  g.block_tokens = 16;
  g.num_layers = 8;
  g.bytes_per_token_per_layer = 256;
  g.max_model_len = 4096;
  g.groups = {KvGroup{.name = "full", .kind = KvGroupKind::kFull, .layers = {1, 3, 5, 7}, .capacity = 512},
              KvGroup{.name = "swa", .kind = KvGroupKind::kSlidingWindow, .layers = {0, 2, 4, 6}, .window = 128,
                      .capacity = 200}};
  return g;
}

// qwen3-next-like: attention every fourth layer, recurrent state in the others.
PoolGeometry Mixed() {
  PoolGeometry g;
  g.name = "next";
  g.block_tokens = 16;
  g.num_layers = 8;
  g.bytes_per_token_per_layer = 256;
  g.max_model_len = 4096;
  g.step_tokens = 256;
  g.capacity_bytes = int64_t{64} << 20;
  g.groups = {KvGroup{.name = "attn", .kind = KvGroupKind::kFull, .layers = {3, 7}},
              KvGroup{.name = "gdn", .kind = KvGroupKind::kState, .layers = {0, 1, 2, 4, 5, 6},
                      .bytes_per_state = 100000, .checkpoint_every_blocks = 64}};
  return g;
}

std::string Error(PoolGeometry g) {
  const absl::Status s = g.ResolveGroups();
  REQUIRE(absl::IsInvalidArgument(s));
  return std::string(s.message());
}

TEST_CASE("layer lists: indices, ranges and strided ranges, and back", "[kv_group]") {
  CHECK(*ParseLayerSpec("7") == std::vector<int32_t>{7});
  CHECK(*ParseLayerSpec("0-3") == std::vector<int32_t>{0, 1, 2, 3});
  CHECK(*ParseLayerSpec("1-9/4") == std::vector<int32_t>{1, 5, 9});
  CHECK(*ParseLayerSpec("1-10/4") == std::vector<int32_t>{1, 5, 9});
  for (const char* bad : {"", "x", "3-1", "-1", "1-", "1-5/0", "1-5/x", "7/2", "0-5000"}) {
    INFO(bad);
    const auto r = ParseLayerSpec(bad);
    REQUIRE(absl::IsInvalidArgument(r.status()));
    CHECK(r.status().message().find("allowed: a layer index, \"a-b\" or \"a-b/s\"") != std::string::npos);
  }
  CHECK(FormatLayers({1, 3, 5, 7}) == std::vector<std::string>{"1-7/2"});
  CHECK(FormatLayers({0, 1, 2, 4, 5, 6}) == std::vector<std::string>{"0-2", "4-6"});
  CHECK(FormatLayers({3, 7}) == std::vector<std::string>{"3", "7"});
  CHECK(FormatLayers({9, 2, 0}) == std::vector<std::string>{"9", "2", "0"});
  for (const std::vector<int32_t>& layers :
       {std::vector<int32_t>{1, 3, 5, 7, 8, 9, 10, 20}, std::vector<int32_t>{5}, std::vector<int32_t>{4, 2, 0, 1}}) {
    std::vector<int32_t> back;
    for (const std::string& s : FormatLayers(layers)) {
      const auto part = ParseLayerSpec(s);
      REQUIRE(part.ok());
      back.insert(back.end(), part->begin(), part->end());
    }
    CHECK(back == layers);
  }
}

TEST_CASE("groups concatenate into one index space; regions start on 2 MiB", "[kv_group]") {
  PoolGeometry g = Swa();
  REQUIRE(g.ResolveGroups().ok());
  REQUIRE(g.Validate().ok());
  CHECK(g.capacity_blocks == 712);
  CHECK(g.groups[0].first_block == 0);
  CHECK(g.groups[1].first_block == 512);
  CHECK(g.GroupLayerUnitBytes(0) == 16 * 256);
  CHECK(g.GroupUnitBytes(1) == 4 * 16 * 256);
  CHECK(g.groups[0].region_offset_bytes == 0);
  // 4 layers x 512 blocks x 4 KiB = 8 MiB: the next region starts right after it.
  CHECK(g.groups[1].region_offset_bytes == int64_t{8} << 20);
  CHECK(g.GroupOf(0) == 0);
  CHECK(g.GroupOf(511) == 0);
  CHECK(g.GroupOf(512) == 1);
  CHECK(g.GroupOf(711) == 1);
  CHECK(g.GroupOf(712) == -1);
  CHECK(g.GroupOf(-1) == -1);
  // An attention group inherits the pool's bytes per token.
  CHECK(g.groups[0].bytes_per_token == 256);

  PoolGeometry plain;  // no groups: today's pool, one index space of capacity_blocks
  plain.name = "p";
  REQUIRE(plain.ResolveGroups().ok());
  CHECK(plain.GroupOf(0) == 0);
  CHECK(plain.GroupOf(plain.capacity_blocks) == -1);
}

TEST_CASE("the default split sizes every group for the same number of design requests", "[kv_group]") {
  PoolGeometry g = Mixed();
  REQUIRE(g.ResolveGroups().ok());
  // design = min(max_model_len, 8192) = 4096 tokens: attn 256 blocks of 2 x 16 x 256 B = 2 MiB;
  // gdn 2 + ceil(4096 / (64 x 16)) + 1 = 7 slots of 6 x 100000 B = 4.2 MB. R = floor(64 MiB / 6.297 MB) = 10.
  const int64_t per_request = 256 * (2 * 16 * 256) + 7 * (6 * 100000);
  const int64_t r = (int64_t{64} << 20) / per_request;
  REQUIRE(r == 10);
  CHECK(g.groups[0].capacity == r * 256);
  CHECK(g.groups[1].capacity == r * 7);
  CHECK(g.capacity_blocks == r * 256 + r * 7);
  CHECK(g.groups[1].first_block == r * 256);
  CHECK(g.groups[1].region_offset_bytes == int64_t{20} << 20);  // 2 x 2560 x 4 KiB = 20 MiB
  // What the groups take fits capacity_bytes; only the alignment of each region may add to it.
  CHECK(g.GroupRegionBytes(0) + g.GroupRegionBytes(1) <= g.capacity_bytes);

  // A group with its own capacity keeps it; the others share what is left.
  PoolGeometry fixed = Mixed();
  fixed.groups[1].capacity = 20;
  REQUIRE(fixed.ResolveGroups().ok());
  CHECK(fixed.groups[1].capacity == 20);
  CHECK(fixed.groups[0].capacity == ((int64_t{64} << 20) - 20 * 600000) / (256 * 8192) * 256);

  // Resolving twice changes nothing (print-config writes the resolved capacities back).
  PoolGeometry again = g;
  REQUIRE(again.ResolveGroups().ok());
  CHECK(again.capacity_blocks == g.capacity_blocks);
  CHECK(again.groups[1].region_offset_bytes == g.groups[1].region_offset_bytes);
}

TEST_CASE("rule 1: 1 to 8 groups, unique well-formed names", "[kv_group]") {
  PoolGeometry many = Swa();
  for (int i = 0; i < 7; ++i) many.groups.push_back(many.groups[0]);
  CHECK(Error(many) == "groups: 9 groups; allowed: 1 to 8");
  PoolGeometry dup = Swa();
  dup.groups[1].name = "full";
  CHECK(Error(dup) == "groups[1].name: 'full' is also groups[0]'s; names are unique in a pool");
  PoolGeometry upper = Swa();
  upper.groups[0].name = "Full";
  CHECK(Error(upper) == "groups[0].name: 'Full' is not allowed; allowed: [a-z0-9_-]{1,32}");
}

TEST_CASE("rule 2: every layer in exactly one group; bytes agree with the KV format", "[kv_group]") {
  PoolGeometry missing = Swa();
  missing.groups[1].layers = {0, 2, 4};
  CHECK(Error(missing) == "groups: layer 6 is in no group; every layer in [0, num_layers = 8) is in exactly one");
  PoolGeometry twice = Swa();
  twice.groups[1].layers = {0, 2, 3, 4, 6};
  CHECK(Error(twice) == "groups[1].layers: layer 3 is in groups full and swa; every layer is in exactly one group");
  PoolGeometry outside = Swa();
  outside.groups[1].layers = {0, 2, 4, 6, 8};
  CHECK(Error(outside) == "groups[1].layers: 8 is not a layer of the pool; allowed: [0, 8)");
  PoolGeometry empty = Swa();
  empty.groups[0].layers.clear();
  CHECK(Error(empty).find("groups[0].layers: [] lists no layer") == 0);
  PoolGeometry format = Swa();
  format.kv = KvFormat{"bfloat16", 2, 32, "token_kv_head_dim"};  // 256 bytes: the pool's
  REQUIRE(PoolGeometry(format).ResolveGroups().ok());
  format.groups[1].bytes_per_token = 512;
  CHECK(Error(format).find("groups[1].bytes_per_token: 512 disagrees with the pool's KV format: token_kv_head_dim "
                           "of 2 kv_heads x 32 head_dim in bfloat16 is 256 bytes") == 0);
}

TEST_CASE("rule 3: a key of another kind is refused", "[kv_group]") {
  PoolGeometry window = Swa();
  window.groups[0].window = 64;
  CHECK(Error(window) == "groups[0].window: 64 is not a key of kind full; allowed only on sliding_window");
  PoolGeometry chunk = Swa();
  chunk.groups[1].chunk = 64;
  CHECK(Error(chunk) == "groups[1].chunk: 64 is not a key of kind sliding_window; allowed only on chunked_local");
  PoolGeometry state_bytes = Swa();
  state_bytes.groups[0].bytes_per_state = 10;
  CHECK(Error(state_bytes) == "groups[0].bytes_per_state: 10 is not a key of kind full; allowed only on state");
  PoolGeometry token_bytes = Mixed();
  token_bytes.groups[1].bytes_per_token = 10;
  CHECK(Error(token_bytes) == "groups[1].bytes_per_token: 10 is not a key of kind state; allowed only on attention kinds");
  PoolGeometry k = Swa();
  k.groups[0].checkpoint_every_blocks = 4;
  CHECK(Error(k) == "groups[0].checkpoint_every_blocks: 4 is not a key of kind full; allowed only on state");
}

TEST_CASE("rule 4: window in [1, max_model_len)", "[kv_group]") {
  for (int32_t w : {0, 4096, 5000}) {
    PoolGeometry g = Swa();
    g.groups[1].window = w;
    CHECK(Error(g) == absl::StrCat("groups[1].window: ", w, " is out of range; allowed: [1, max_model_len = 4096) "
                                   "(a window >= max_model_len is full attention: declare kind full)"));
  }
  PoolGeometry odd = Swa();
  odd.groups[1].window = 6;  // need not be a multiple of block_tokens
  CHECK(odd.ResolveGroups().ok());
}

TEST_CASE("rule 5: chunk a multiple of block_tokens, at most max_model_len", "[kv_group]") {
  for (int32_t c : {0, 24, 4112}) {
    PoolGeometry g = Swa();
    g.groups[1].kind = KvGroupKind::kChunkedLocal;
    g.groups[1].window = 0;
    g.groups[1].chunk = c;
    CHECK(Error(g) == absl::StrCat("groups[1].chunk: ", c, " is not allowed; allowed: a multiple of block_tokens (16) "
                                   "up to max_model_len (4096)"));
  }
}

TEST_CASE("rule 6: a state group names k and its state bytes", "[kv_group]") {
  PoolGeometry no_k = Mixed();
  no_k.groups[1].checkpoint_every_blocks = 0;
  CHECK(Error(no_k) == "groups[1].checkpoint_every_blocks: (unset) is required on a state group (no default: it trades "
                       "hit rate against memory); allowed: [1, 256]");
  PoolGeometry big_k = Mixed();
  big_k.groups[1].checkpoint_every_blocks = 257;
  CHECK(Error(big_k) == "groups[1].checkpoint_every_blocks: 257 is out of range; allowed: [1, max_model_len / "
                        "block_tokens = 256]");
  PoolGeometry no_bytes = Mixed();
  no_bytes.groups[1].bytes_per_state = 0;
  CHECK(Error(no_bytes) == "groups[1].bytes_per_state: 0 is out of range; allowed: (0, 16 GiB]");
}

TEST_CASE("rule 7: layer-major, a capacity for every group, enough for one max_model_len request", "[kv_group]") {
  PoolGeometry block_major = Swa();
  block_major.layout = PoolLayout::kBlockMajor;
  CHECK(Error(block_major).find("layout: block_major is not allowed with groups; allowed: layer_major") == 0);
  PoolGeometry unset = Swa();
  unset.groups[1].capacity = 0;
  CHECK(Error(unset) == "groups[1].capacity_blocks: (unset) and the pool sets no capacity_bytes to split; allowed: "
                        "set the pool's capacity_bytes, or every group's capacity_blocks / capacity_slots");
  PoolGeometry small = Swa();
  small.groups[0].capacity = 255;
  CHECK(Error(small) == "groups[0].capacity_blocks: 255 cannot hold one request of max_model_len 4096 tokens, which "
                        "reserves 256; allowed: >= 256");
  // The window group's reservation: ceil((W - 1 + S) / bt) + 1 with S = min(2048, max_model_len).
  PoolGeometry window = Swa();
  window.groups[1].capacity = 136;
  CHECK(Error(window).find("groups[1].capacity_blocks: 136 cannot hold one request") == 0);
  window.groups[1].capacity = 137;
  CHECK(window.ResolveGroups().ok());
  PoolGeometry slots = Mixed();
  slots.groups[1].capacity = 1;
  CHECK(Error(slots).find("groups[1].capacity_slots: 1 cannot hold one request") == 0);
  PoolGeometry tiny = Mixed();
  tiny.capacity_bytes = 1 << 20;
  CHECK(Error(tiny).find("capacity_bytes: 1048576 holds no request of 4096 tokens") == 0);
  PoolGeometry plain;
  plain.name = "p";
  plain.capacity_bytes = 1 << 20;
  CHECK(Error(plain) == "capacity_bytes: 1048576 is for pools with groups; a pool without groups sets capacity_blocks");
}

TEST_CASE("rule 8: step_tokens in [block_tokens, max_model_len]", "[kv_group]") {
  for (int32_t s : {8, 4097}) {
    PoolGeometry g = Swa();
    g.step_tokens = s;
    CHECK(Error(g) == absl::StrCat("step_tokens: ", s, " is out of range; allowed: [block_tokens = 16, max_model_len = 4096]"));
  }
  PoolGeometry g = Swa();
  CHECK(g.step_tokens_or_default() == 2048);
  g.max_model_len = 1024;
  CHECK(g.step_tokens_or_default() == 1024);
}

TEST_CASE("Validate refuses groups that were not resolved", "[kv_group]") {
  PoolGeometry g = Swa();
  CHECK(g.Validate().message().find("is not the groups' sum 712 (call ResolveGroups)") != std::string::npos);
  REQUIRE(g.ResolveGroups().ok());
  CHECK(g.Validate().ok());
  g.groups[1].region_offset_bytes = 0;
  CHECK(absl::IsInvalidArgument(g.Validate()));
}

TEST_CASE("the attach check: a hybrid pool refuses a worker declaring none or other groups", "[kv_group]") {
  PoolGeometry g = Swa();
  REQUIRE(g.ResolveGroups().ok());
  CHECK(CheckExpectedGroups(g, g.groups).ok());
  std::vector<KvGroup> named = {KvGroup{.name = "full", .kind = KvGroupKind::kFull},
                                KvGroup{.name = "swa", .kind = KvGroupKind::kSlidingWindow}};
  CHECK(CheckExpectedGroups(g, named).ok());  // fields left unset are not compared
  const absl::Status none = CheckExpectedGroups(g, {});
  CHECK(absl::IsFailedPrecondition(none));
  CHECK(none.message() == "pool 'oss' has 2 KV groups; this worker declares none: it would index the slab as one group");
  std::vector<KvGroup> window = named;
  window[1].window = 64;
  CHECK(CheckExpectedGroups(g, window).message() ==
        "pool 'oss' group 1 (swa) holds window 128, the worker expects 64");
  std::vector<KvGroup> layers = named;
  layers[0].layers = {1, 3, 5};
  CHECK(CheckExpectedGroups(g, layers).message() ==
        "pool 'oss' group 0 (full) holds layers 1-7/2, the worker expects 1-5/2");
  std::vector<KvGroup> kind = named;
  kind[1].kind = KvGroupKind::kChunkedLocal;
  CHECK(CheckExpectedGroups(g, kind).message() ==
        "pool 'oss' group 1 (swa) holds kind sliding_window, the worker expects chunked_local");
  CHECK(CheckExpectedGroups(g, {named[0]}).message() == "pool 'oss' has 2 KV groups; this worker declares 1");
  PoolGeometry plain;
  plain.name = "p";
  CHECK(CheckExpectedGroups(plain, {}).ok());
  CHECK(CheckExpectedGroups(plain, named).message() ==
        "pool 'p' has no KV groups (one implicit full group); this worker declares 2");
}

TEST_CASE("a hybrid pool with a full group hits what every group serves", "[kv_group]") {
  FakeClock clock;
  CacheOptions o = testing::SmallOptions();
  PoolGeometry h = o.pools[0];
  h.name = "h";
  h.groups = {KvGroup{.name = "full", .kind = KvGroupKind::kFull, .layers = {0}, .capacity = 64},
              KvGroup{.name = "swa", .kind = KvGroupKind::kSlidingWindow, .layers = {1}, .window = 6, .capacity = 64}};
  REQUIRE(h.ResolveGroups().ok());
  o.pools.push_back(h);
  auto cache = testing::MakeCache(o, &clock);
  REQUIRE(cache->pools()[1].groups.size() == 2);
  for (const std::string pool : {"m", "h"}) {
    INFO(pool);
    const std::vector<Token> prompt = Seq(1, 16);
    RequestSpec a = Spec("a-" + pool, prompt, 0, pool);
    const AcquireResult ra = testing::Start(*cache, a);
    testing::PublishAll(*cache, a, prompt, ra);
    REQUIRE(cache->Release(a.id, true).ok());
    // The same chain published in both pools; the window blocks of positions [2, 4) came with it.
    const int64_t hit = 16;
    CHECK(*cache->PeekPrefixLen(Namespace{.pool = pool}, Concat(prompt, {99})) == hit);
    RequestSpec b = Spec("b-" + pool, Concat(prompt, {99}), 0, pool);
    CHECK(testing::Start(*cache, b).cached_tokens == hit);
  }
}

}  // namespace
}  // namespace kvd
