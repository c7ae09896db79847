#include "proto/vocab/kv_format.h"

#include <array>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvd {
namespace {

constexpr std::array<std::pair<absl::string_view, int32_t>, 7> kDtypes = {{
    {"float32", 4}, {"float16", 2}, {"bfloat16", 2}, {"float8_e4m3fn", 1}, {"float8_e5m2", 1},
    {"int8", 1}, {"uint8", 1},
}};

// K and V stored (2), or one latent vector (1); 0 for an unknown arrangement.
int32_t VectorsPerToken(absl::string_view arrangement) {
  if (arrangement == "token_kv_head_dim" || arrangement == "kv_token_head_dim") return 2;
  if (arrangement == "token_latent") return 1;
  return 0;
}

}  // namespace

int32_t KvDtypeSize(absl::string_view dtype) {
  for (const auto& [name, size] : kDtypes) {
    if (name == dtype) return size;
  }
  return 0;
}

absl::Status KvFormat::Validate(int64_t bytes_per_token_per_layer) const {
  if (!declared()) return absl::OkStatus();
  const int32_t size = KvDtypeSize(dtype);
  if (size == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dtype '", dtype, "' is not one of float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int8, uint8"));
  }
  const bool shape = kv_heads != 0 || head_dim != 0 || !arrangement.empty();
  if (!shape) return absl::OkStatus();  // a dtype alone is a valid declaration
  if (kv_heads <= 0 || kv_heads > 4096) return absl::InvalidArgumentError("kv_heads must be in (0, 4096]");
  if (head_dim <= 0 || head_dim > 65536) return absl::InvalidArgumentError("head_dim must be in (0, 65536]");
  const int32_t vectors = VectorsPerToken(arrangement);
  if (vectors == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_arrangement '", arrangement, "' is not one of token_kv_head_dim, kv_token_head_dim, token_latent"));
  }
  const int64_t bytes = int64_t{vectors} * kv_heads * head_dim * size;
  if (bytes != bytes_per_token_per_layer) {
    return absl::InvalidArgumentError(absl::StrCat(
        arrangement, " of ", kv_heads, " kv_heads x ", head_dim, " head_dim in ", dtype, " is ", bytes,
        " bytes per token and layer, but bytes_per_token_per_layer is ", bytes_per_token_per_layer));
  }
  return absl::OkStatus();
}

absl::Status CheckKvFormat(absl::string_view pool_name, const KvFormat& pool, const KvFormat& expected) {
  auto differ = [&](absl::string_view field, const auto& have, const auto& want) {
    return absl::FailedPreconditionError(absl::StrCat("pool '", pool_name, "' holds ", field, " ", have,
                                                      ", the worker expects ", want));
  };
  auto shown = [](const std::string& s) { return s.empty() ? std::string("(undeclared)") : s; };
  if (!expected.dtype.empty() && expected.dtype != pool.dtype) {
    return differ("dtype", shown(pool.dtype), expected.dtype);
  }
  if (expected.kv_heads != 0 && expected.kv_heads != pool.kv_heads) {
    return differ("kv_heads", pool.kv_heads, expected.kv_heads);
  }
  if (expected.head_dim != 0 && expected.head_dim != pool.head_dim) {
    return differ("head_dim", pool.head_dim, expected.head_dim);
  }
  if (!expected.arrangement.empty() && expected.arrangement != pool.arrangement) {
    return differ("kv_arrangement", shown(pool.arrangement), expected.arrangement);
  }
  return absl::OkStatus();
}

}  // namespace kvd
