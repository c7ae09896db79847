// KvFormat: what the bytes of one token in one layer of a pool mean, declared with the pool so an
// engine can check that the pool holds KV the way its kernels read it.
//
// kvd never interprets these bytes; the declaration is a contract between the operator's config
// and every worker. A pool may leave it undeclared (all fields empty): workers then get only the
// byte geometry. When declared, the numbers must add up to the pool's bytes_per_token_per_layer:
//
//   arrangement          one layer of one block                        bytes per token and layer
//   token_kv_head_dim    [block_tokens][2 (K, V)][kv_heads][head_dim]  2 * kv_heads * head_dim * size
//   kv_token_head_dim    [2 (K, V)][block_tokens][kv_heads][head_dim]  2 * kv_heads * head_dim * size
//   token_latent         [block_tokens][kv_heads][head_dim] (MLA)      kv_heads * head_dim * size
//
// A worker states what it expects (Hello.expect_pools); Check answers FAILED_PRECONDITION naming
// the first field that differs, so a model with the wrong dtype or head count cannot attach and
// read another model's KV as its own.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvd {

struct KvFormat {
  std::string dtype;        // "" (undeclared) or a name of KvDtypeSize
  int32_t kv_heads = 0;     // 0: undeclared
  int32_t head_dim = 0;     // 0: undeclared
  std::string arrangement;  // "" (undeclared) or one of the table above

  bool declared() const { return !dtype.empty() || kv_heads != 0 || head_dim != 0 || !arrangement.empty(); }

  // INVALID_ARGUMENT naming the field that is unknown, missing or does not add up to
  // `bytes_per_token_per_layer`. An undeclared format is valid.
  absl::Status Validate(int64_t bytes_per_token_per_layer) const;
};

// Bytes of one element of `dtype` (float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int8,
// uint8), or 0 for a name kvd does not know.
int32_t KvDtypeSize(absl::string_view dtype);

// OK when every field `expected` declares (non-empty, non-zero) equals `pool`'s; else
// FAILED_PRECONDITION naming the pool, the field, both values. A pool that leaves a field
// undeclared does not meet an expectation of it.
absl::Status CheckKvFormat(absl::string_view pool_name, const KvFormat& pool, const KvFormat& expected);

}  // namespace kvd
