#include "proto/vocab/kv_format.h"

#include <catch2/catch.hpp>

#include "proto/vocab/pool_geometry.h"

namespace kvd {
namespace {

TEST_CASE("an undeclared format is valid for any geometry", "[kv_format]") {
  CHECK(KvFormat{}.Validate(12345).ok());
}

TEST_CASE("declared numbers must add up to bytes_per_token_per_layer", "[kv_format]") {
  const KvFormat llama{"bfloat16", 8, 128, "token_kv_head_dim"};
  CHECK(llama.Validate(2 * 8 * 128 * 2).ok());
  const absl::Status off = llama.Validate(8192);
  CHECK(absl::IsInvalidArgument(off));
  CHECK(off.message().find("8192") != std::string::npos);
  CHECK(KvFormat{"bfloat16", 1, 576, "token_latent"}.Validate(576 * 2).ok());
  CHECK(KvFormat{"float8_e4m3fn", 8, 128, "kv_token_head_dim"}.Validate(2 * 8 * 128).ok());
  CHECK(KvFormat{"float16", 0, 0, ""}.Validate(7).ok());  // a dtype alone declares no shape
}

TEST_CASE("unknown names and half declarations are refused, naming the field", "[kv_format]") {
  auto message = [](const KvFormat& f) { return std::string(f.Validate(4096).message()); };
  CHECK(message({"float31", 0, 0, ""}).find("dtype 'float31'") != std::string::npos);
  CHECK(message({"float16", 8, 128, "heads_first"}).find("kv_arrangement 'heads_first'") != std::string::npos);
  CHECK(message({"float16", 8, 0, "token_kv_head_dim"}).find("head_dim") != std::string::npos);
  CHECK(message({"", 8, 128, "token_kv_head_dim"}).find("dtype") != std::string::npos);
  CHECK(message({"float16", -1, 128, "token_kv_head_dim"}).find("kv_heads") != std::string::npos);
}

TEST_CASE("a pool's Validate names the pool when its format is wrong", "[kv_format]") {
  PoolGeometry g;
  g.name = "llama";
  g.bytes_per_token_per_layer = 4096;
  g.kv = {"bfloat16", 8, 64, "token_kv_head_dim"};  // 2048 bytes
  const absl::Status s = g.Validate();
  CHECK(absl::IsInvalidArgument(s));
  CHECK(s.message().find("pool 'llama'") != std::string::npos);
}

TEST_CASE("a model fingerprint is bounded printable ASCII, and a pool's Validate names the pool", "[kv_format]") {
  CHECK(CheckModelFingerprint("").ok());
  CHECK(CheckModelFingerprint("meta-llama/Llama-3.1-8B-Instruct@0e9e39f2,fp8").ok());
  CHECK(CheckModelFingerprint(std::string(kMaxModelFingerprintBytes, 'x')).ok());
  const absl::Status long_one = CheckModelFingerprint(std::string(kMaxModelFingerprintBytes + 1, 'x'));
  CHECK(absl::IsInvalidArgument(long_one));
  CHECK(long_one.message() == "model_fingerprint is 257 bytes; at most 256 are allowed");
  CHECK(CheckModelFingerprint("llama v1").message() ==
        "model_fingerprint has byte 0x20 at offset 5; only printable ASCII without spaces is allowed");
  CHECK(!CheckModelFingerprint("llama\nv1").ok());
  CHECK(!CheckModelFingerprint("llama\x7f").ok());
  CHECK(!CheckModelFingerprint("llam\xc3\xa4").ok());
  PoolGeometry g;
  g.name = "llama";
  g.model_fingerprint = "v1\x01";
  const absl::Status s = g.Validate();
  CHECK(absl::IsInvalidArgument(s));
  CHECK(s.message().find("pool 'llama': model_fingerprint has byte 0x01") != std::string::npos);
}

TEST_CASE("expectations: every declared field must match", "[kv_format]") {
  const KvFormat pool{"bfloat16", 8, 128, "token_kv_head_dim"};
  CHECK(CheckKvFormat("p", pool, {}).ok());
  CHECK(CheckKvFormat("p", pool, {"bfloat16", 8, 0, ""}).ok());
  const absl::Status dtype = CheckKvFormat("p", pool, {"float16", 0, 0, ""});
  CHECK(absl::IsFailedPrecondition(dtype));
  CHECK(dtype.message() == "pool 'p' holds dtype bfloat16, the worker expects float16");
  CHECK(absl::IsFailedPrecondition(CheckKvFormat("p", pool, {"", 4, 0, ""})));
  CHECK(absl::IsFailedPrecondition(CheckKvFormat("p", pool, {"", 0, 0, "token_latent"})));
  const absl::Status undeclared = CheckKvFormat("p", KvFormat{}, {"bfloat16", 0, 0, ""});
  CHECK(undeclared.message().find("(undeclared)") != std::string::npos);
}

}  // namespace
}  // namespace kvd
