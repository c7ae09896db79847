// KV groups of a hybrid pool: layer lists, the checks of docs/hybrid.md §2.1 and what they
// compute (the default capacity split of §2.3, first_block, region offsets).
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/vocab/pool_geometry.h"

namespace kvd {
namespace {

constexpr int64_t kRegionAlignment = int64_t{2} << 20;  // 2 MiB, as gpu/slab_layout.h's slabs

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

const char* CapacityKey(const KvGroup& g) { return g.attention() ? "capacity_blocks" : "capacity_slots"; }

bool GoodGroupName(const std::string& name) {
  if (name.empty() || name.size() > 32) return false;
  for (char c : name) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-')) return false;
  }
  return true;
}

}  // namespace

std::string KvGroupKindName(KvGroupKind kind) {
  switch (kind) {
    case KvGroupKind::kFull: return "full";
    case KvGroupKind::kSlidingWindow: return "sliding_window";
    case KvGroupKind::kChunkedLocal: return "chunked_local";
    case KvGroupKind::kState: return "state";
  }
  return "full";
}

bool ParseKvGroupKind(absl::string_view name, KvGroupKind* kind) {
  for (KvGroupKind k : {KvGroupKind::kFull, KvGroupKind::kSlidingWindow, KvGroupKind::kChunkedLocal,
                        KvGroupKind::kState}) {
    if (name == KvGroupKindName(k)) {
      *kind = k;
      return true;
    }
  }
  return false;
}

absl::StatusOr<std::vector<int32_t>> ParseLayerSpec(absl::string_view spec) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("'", spec, "' ", why,
                                                   "; allowed: a layer index, \"a-b\" or \"a-b/s\""));
  };
  absl::string_view range = spec;
  int32_t stride = 1;
  if (const size_t slash = spec.find('/'); slash != absl::string_view::npos) {
    range = spec.substr(0, slash);
    if (!absl::SimpleAtoi(spec.substr(slash + 1), &stride) || stride <= 0) return bad("has no stride > 0 after '/'");
  }
  int32_t first = 0;
  int32_t last = 0;
  if (const size_t dash = range.find('-', 1); dash != absl::string_view::npos) {
    if (!absl::SimpleAtoi(range.substr(0, dash), &first) || !absl::SimpleAtoi(range.substr(dash + 1), &last)) {
      return bad("is not a range of layer indices");
    }
  } else {
    if (stride != 1 || range.size() != spec.size()) return bad("has a stride without a range");
    if (!absl::SimpleAtoi(range, &first)) return bad("is not a layer index");
    last = first;
  }
  if (first < 0 || last < first || last >= 4096) return bad("is not a range a-b with 0 <= a <= b < 4096");
  std::vector<int32_t> layers;
  for (int32_t l = first; l <= last; l += stride) layers.push_back(l);
  return layers;
}

std::vector<std::string> FormatLayers(const std::vector<int32_t>& layers) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < layers.size()) {
    // The longest run from i with one positive stride; two layers alone stay two entries.
    size_t j = i + 1;
    if (j < layers.size() && layers[j] > layers[i]) {
      const int32_t stride = layers[j] - layers[i];
      while (j + 1 < layers.size() && layers[j + 1] - layers[j] == stride) ++j;
      if (j - i >= 2) {
        out.push_back(stride == 1 ? absl::StrCat(layers[i], "-", layers[j])
                                  : absl::StrCat(layers[i], "-", layers[j], "/", stride));
        i = j + 1;
        continue;
      }
    }
    out.push_back(absl::StrCat(layers[i]));
    ++i;
  }
  return out;
}

int PoolGeometry::GroupOf(int64_t index) const {
  if (index < 0 || index >= capacity_blocks) return -1;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (index < groups[g].first_block + groups[g].capacity) return static_cast<int>(g);
  }
  return groups.empty() ? 0 : -1;
}

int64_t PoolGeometry::GroupLayerUnitBytes(int g) const {
  const KvGroup& k = groups[g];
  if (!k.attention()) return k.bytes_per_state;
  return int64_t{block_tokens} * (k.bytes_per_token != 0 ? k.bytes_per_token : bytes_per_token_per_layer);
}

int64_t PoolGeometry::GroupUnitsFor(int g, int64_t tokens) const {
  const KvGroup& k = groups[g];
  const int64_t all = CeilDiv(tokens, block_tokens);
  const int64_t step = step_tokens_or_default();
  switch (k.kind) {
    case KvGroupKind::kFull: return all;
    case KvGroupKind::kSlidingWindow: return std::min(all, CeilDiv(k.window - 1 + step, block_tokens) + 1);
    case KvGroupKind::kChunkedLocal: return std::min(all, CeilDiv(k.chunk - 1 + step, block_tokens));
    case KvGroupKind::kState: return 2;
  }
  return all;
}

absl::Status PoolGeometry::ResolveGroups() {
  if (groups.empty()) {
    if (capacity_bytes != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "capacity_bytes: ", capacity_bytes, " is for pools with groups; a pool without groups sets capacity_blocks"));
    }
    return absl::OkStatus();
  }
  if (groups.size() > kMaxKvGroups) {
    return absl::InvalidArgumentError(
        absl::StrCat("groups: ", groups.size(), " groups; allowed: 1 to ", kMaxKvGroups));
  }
  std::map<int32_t, size_t> owner;  // layer -> group
  for (size_t j = 0; j < groups.size(); ++j) {
    KvGroup& k = groups[j];
    const std::string at = absl::StrCat("groups[", j, "].");
    const auto bad = [&](absl::string_view field, const auto& value, absl::string_view allowed) {
      return absl::InvalidArgumentError(absl::StrCat(at, field, ": ", value, " ", allowed));
    };
    if (!GoodGroupName(k.name)) return bad("name", absl::StrCat("'", k.name, "'"), "is not allowed; allowed: [a-z0-9_-]{1,32}");
    for (size_t i = 0; i < j; ++i) {
      if (groups[i].name == k.name) {
        return bad("name", absl::StrCat("'", k.name, "'"), absl::StrCat("is also groups[", i, "]'s; names are unique in a pool"));
      }
    }
    if (k.layers.empty()) return bad("layers", "[]", "lists no layer; allowed: at least one layer in [0, num_layers)");
    for (int32_t l : k.layers) {
      if (l < 0 || l >= num_layers) {
        return bad("layers", l, absl::StrCat("is not a layer of the pool; allowed: [0, ", num_layers, ")"));
      }
      auto [it, fresh] = owner.emplace(l, j);
      if (!fresh) {
        return absl::InvalidArgumentError(absl::StrCat(at, "layers: layer ", l, " is in groups ",
                                                       groups[it->second].name, " and ", k.name,
                                                       "; every layer is in exactly one group"));
      }
    }
    const std::string kind = KvGroupKindName(k.kind);
    const auto foreign = [&](absl::string_view field, int64_t value, absl::string_view kinds) {
      return bad(field, value, absl::StrCat("is not a key of kind ", kind, "; allowed only on ", kinds));
    };
    if (k.window != 0 && k.kind != KvGroupKind::kSlidingWindow) return foreign("window", k.window, "sliding_window");
    if (k.chunk != 0 && k.kind != KvGroupKind::kChunkedLocal) return foreign("chunk", k.chunk, "chunked_local");
    if (k.attention()) {
      if (k.bytes_per_state != 0) return foreign("bytes_per_state", k.bytes_per_state, "state");
      if (k.checkpoint_every_blocks != 0) {
        return foreign("checkpoint_every_blocks", k.checkpoint_every_blocks, "state");
      }
      if (k.bytes_per_token == 0) k.bytes_per_token = bytes_per_token_per_layer;
      if (k.bytes_per_token < 0 || k.bytes_per_token > (int64_t{1} << 24)) {
        return bad("bytes_per_token", k.bytes_per_token, "is out of range; allowed: (0, 16 MiB]");
      }
      if (absl::Status s = kv.Validate(k.bytes_per_token); !s.ok()) {
        return bad("bytes_per_token", k.bytes_per_token, absl::StrCat("disagrees with the pool's KV format: ", s.message()));
      }
    } else {
      if (k.bytes_per_token != 0) return foreign("bytes_per_token", k.bytes_per_token, "attention kinds");
      if (k.bytes_per_state <= 0 || k.bytes_per_state > (int64_t{1} << 34)) {
        return bad("bytes_per_state", k.bytes_per_state, "is out of range; allowed: (0, 16 GiB]");
      }
      if (k.checkpoint_every_blocks == 0) {
        return bad("checkpoint_every_blocks", "(unset)",
                   absl::StrCat("is required on a state group (no default: it trades hit rate against memory); allowed: [1, ",
                                max_model_len / block_tokens, "]"));
      }
      if (k.checkpoint_every_blocks < 1 || k.checkpoint_every_blocks > max_model_len / block_tokens) {
        return bad("checkpoint_every_blocks", k.checkpoint_every_blocks,
                   absl::StrCat("is out of range; allowed: [1, max_model_len / block_tokens = ",
                                max_model_len / block_tokens, "]"));
      }
    }
    if (k.kind == KvGroupKind::kSlidingWindow && (k.window < 1 || k.window >= max_model_len)) {
      return bad("window", k.window,
                 absl::StrCat("is out of range; allowed: [1, max_model_len = ", max_model_len,
                              ") (a window >= max_model_len is full attention: declare kind full)"));
    }
    if (k.kind == KvGroupKind::kChunkedLocal &&
        (k.chunk < block_tokens || k.chunk > max_model_len || k.chunk % block_tokens != 0)) {
      return bad("chunk", k.chunk,
                 absl::StrCat("is not allowed; allowed: a multiple of block_tokens (", block_tokens,
                              ") up to max_model_len (", max_model_len, ")"));
    }
    if (k.capacity < 0 || k.capacity > (int64_t{1} << 31)) {
      return bad(CapacityKey(k), k.capacity, "is out of range; allowed: (0, 2^31]");
    }
  }
  for (int32_t l = 0; l < num_layers; ++l) {
    if (!owner.contains(l)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "groups: layer ", l, " is in no group; every layer in [0, num_layers = ", num_layers, ") is in exactly one"));
    }
  }
  if (layout != PoolLayout::kLayerMajor) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout: ", PoolLayoutName(layout), " is not allowed with groups; allowed: layer_major (a block-major "
        "block would mix groups whose blocks differ)"));
  }
  if (step_tokens != 0 && (step_tokens < block_tokens || step_tokens > max_model_len)) {
    return absl::InvalidArgumentError(absl::StrCat("step_tokens: ", step_tokens, " is out of range; allowed: [block_tokens = ",
                                                   block_tokens, ", max_model_len = ", max_model_len, "]"));
  }

  // The default split (docs/hybrid.md §2.3): the groups without a capacity share what capacity_bytes
  // leaves after the others, sized for the same number R of requests of design_tokens.
  const int64_t design = std::min<int64_t>(max_model_len, 8192);
  int64_t fixed_bytes = 0;
  int64_t per_request = 0;
  std::vector<int64_t> design_units(groups.size());
  for (size_t j = 0; j < groups.size(); ++j) {
    const KvGroup& k = groups[j];
    const int g = static_cast<int>(j);
    design_units[j] = k.attention()
                          ? GroupUnitsFor(g, design)
                          : 2 + CeilDiv(design, int64_t{k.checkpoint_every_blocks} * block_tokens) + 1;
    if (k.capacity != 0) {
      fixed_bytes += k.capacity * GroupUnitBytes(g);
    } else {
      if (capacity_bytes == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "groups[", j, "].", CapacityKey(k), ": (unset) and the pool sets no capacity_bytes to split; allowed: set "
            "the pool's capacity_bytes, or every group's ", CapacityKey(k), " / capacity_slots"));
      }
      per_request += design_units[j] * GroupUnitBytes(g);
    }
  }
  if (capacity_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("capacity_bytes: ", capacity_bytes, " is out of range; allowed: > 0"));
  }
  if (capacity_bytes != 0 && fixed_bytes > capacity_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("capacity_bytes: ", capacity_bytes, " is less than the groups' own ",
                                                   "capacities take (", fixed_bytes, " bytes)"));
  }
  if (per_request > 0) {
    const int64_t requests = (capacity_bytes - fixed_bytes) / per_request;
    if (requests == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "capacity_bytes: ", capacity_bytes, " holds no request of ", design, " tokens (", per_request,
          " bytes over the groups without a capacity); allowed: at least ", fixed_bytes + per_request));
    }
    for (size_t j = 0; j < groups.size(); ++j) {
      if (groups[j].capacity == 0) groups[j].capacity = requests * design_units[j];
    }
  }

  int64_t first = 0;
  int64_t offset = 0;
  for (size_t j = 0; j < groups.size(); ++j) {
    KvGroup& k = groups[j];
    const int g = static_cast<int>(j);
    const int64_t need = GroupUnitsFor(g, max_model_len);
    if (k.capacity < need) {
      return absl::InvalidArgumentError(absl::StrCat(
          "groups[", j, "].", CapacityKey(k), ": ", k.capacity, " cannot hold one request of max_model_len ",
          max_model_len, " tokens, which reserves ", need, "; allowed: >= ", need));
    }
    k.first_block = first;
    k.region_offset_bytes = offset;
    first += k.capacity;
    offset = RoundUp(offset + GroupRegionBytes(g), kRegionAlignment);
  }
  if (first > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(
        absl::StrCat("groups: ", first, " units in all; allowed: at most 2^31 (one index space per pool)"));
  }
  capacity_blocks = first;
  return absl::OkStatus();
}

absl::Status CheckExpectedGroups(const PoolGeometry& pool, const std::vector<KvGroup>& expected) {
  const auto refuse = [&](const std::string& why) {
    return absl::FailedPreconditionError(absl::StrCat("pool '", pool.name, "' ", why));
  };
  if (expected.empty()) {
    if (!pool.hybrid()) return absl::OkStatus();
    return refuse(absl::StrCat("has ", pool.groups.size(),
                               " KV groups; this worker declares none: it would index the slab as one group"));
  }
  if (!pool.hybrid()) {
    return refuse(absl::StrCat("has no KV groups (one implicit full group); this worker declares ", expected.size()));
  }
  if (expected.size() != pool.groups.size()) {
    return refuse(absl::StrCat("has ", pool.groups.size(), " KV groups; this worker declares ", expected.size()));
  }
  for (size_t j = 0; j < expected.size(); ++j) {
    const KvGroup& have = pool.groups[j];
    const KvGroup& want = expected[j];
    const auto differ = [&](absl::string_view field, const auto& h, const auto& w) {
      return refuse(absl::StrCat("group ", j, " (", have.name, ") holds ", field, " ", h, ", the worker expects ", w));
    };
    if (want.name != have.name) return differ("name", have.name, want.name.empty() ? "(none)" : want.name);
    if (want.kind != have.kind) return differ("kind", KvGroupKindName(have.kind), KvGroupKindName(want.kind));
    if (!want.layers.empty() && want.layers != have.layers) {
      return differ("layers", absl::StrJoin(FormatLayers(have.layers), ","), absl::StrJoin(FormatLayers(want.layers), ","));
    }
    if (want.window != 0 && want.window != have.window) return differ("window", have.window, want.window);
    if (want.chunk != 0 && want.chunk != have.chunk) return differ("chunk", have.chunk, want.chunk);
    if (want.checkpoint_every_blocks != 0 && want.checkpoint_every_blocks != have.checkpoint_every_blocks) {
      return differ("checkpoint_every_blocks", have.checkpoint_every_blocks, want.checkpoint_every_blocks);
    }
    if (want.bytes_per_token != 0 && want.bytes_per_token != have.bytes_per_token) {
      return differ("bytes_per_token", have.bytes_per_token, want.bytes_per_token);
    }
    if (want.bytes_per_state != 0 && want.bytes_per_state != have.bytes_per_state) {
      return differ("bytes_per_state", have.bytes_per_state, want.bytes_per_state);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvd
