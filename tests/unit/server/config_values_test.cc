#include "server/config_values.h"

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"

namespace kvd {
namespace {

TEST_CASE("Sizes take whole bytes or a binary or decimal unit", "[config]") {
  const std::pair<const char*, int64_t> good[] = {
      {"0", 0}, {"4096", 4096}, {"8GiB", int64_t{8} << 30}, {"8 GiB", int64_t{8} << 30},
      {"8gib", int64_t{8} << 30}, {"1.5GiB", int64_t{3} << 29}, {"512MB", 512000000}, {"2KiB", 2048},
      {"3kb", 3000}, {"1TiB", int64_t{1} << 40}, {"7B", 7}, {" 64MiB ", int64_t{64} << 20},
  };
  for (const auto& [text, bytes] : good) {
    INFO(text);
    absl::StatusOr<int64_t> v = ParseSize("host_bytes", text);
    REQUIRE(v.ok());
    REQUIRE(*v == bytes);
  }
  for (const char* text : {"-5", "-5GiB", "8 GiBs", "GiB", "", "1.5", "8XB", "0.3B", "1e9", "huge", "99999999TiB",
                           "1Gb", "8Mib", "2 Kb", "Xb"}) {
    INFO(text);
    absl::StatusOr<int64_t> v = ParseSize("host_bytes", text);
    REQUIRE(v.status().code() == absl::StatusCode::kInvalidArgument);
    // One line naming the key and the value.
    REQUIRE(v.status().message().find(absl::StrCat("host_bytes: '", text, "'")) == 0);
    REQUIRE(v.status().message().find('\n') == absl::string_view::npos);
  }
  // Bits are not guessed at: the message says both byte spellings.
  REQUIRE(ParseSize("budget_bytes", "1Gb").status().message() ==
          "budget_bytes: '1Gb' is ambiguous: Gb reads as gigabits; write 1GB (10^9 bytes) or 1GiB (2^30 bytes)");
}

TEST_CASE("Durations take seconds or units", "[config]") {
  REQUIRE(*ParseDurationValue("lease_ttl_s", "10") == absl::Seconds(10));
  REQUIRE(*ParseDurationValue("lease_ttl_s", "0.25") == absl::Milliseconds(250));
  REQUIRE(*ParseDurationValue("lease_ttl_s", "500ms") == absl::Milliseconds(500));
  REQUIRE(*ParseDurationValue("lease_ttl_s", "5m") == absl::Minutes(5));
  REQUIRE(*ParseDurationValue("lease_ttl_s", "1h30m") == absl::Minutes(90));
  REQUIRE(*ParseDurationValue("lease_ttl_s", "-3") == absl::Seconds(-3));  // ranges: Validate's
  for (const char* text : {"soon", "", "5 minutes", "inf", "nan", "3x"}) {
    INFO(text);
    REQUIRE(ParseDurationValue("lease_ttl_s", text).status().message().find(absl::StrCat("lease_ttl_s: '", text, "'")) == 0);
  }
}

TEST_CASE("A listen address is a Unix socket in any spelling, or HOST:PORT", "[config]") {
  REQUIRE(*NormalizeListen("listen", "unix:///run/kvd/kvd.sock") == "unix:///run/kvd/kvd.sock");
  REQUIRE(*NormalizeListen("listen", "unix:/run/kvd/kvd.sock") == "unix:///run/kvd/kvd.sock");
  REQUIRE(*NormalizeListen("listen", "/tmp/x.sock") == "unix:///tmp/x.sock");
  REQUIRE(*NormalizeListen("listen", "127.0.0.1:50051") == "127.0.0.1:50051");
  REQUIRE(*NormalizeListen("listen", "[::1]:50051") == "[::1]:50051");
  REQUIRE(*NormalizeListen("listen", "localhost:0") == "localhost:0");
  for (const char* text : {"kvd.sock", "unix:kvd.sock", "unix://relative.sock", "localhost", "host:port",
                           "host:70000", "./x.sock", ":50051", "/"}) {
    INFO(text);
    absl::StatusOr<std::string> v = NormalizeListen("--listen", text);
    REQUIRE(v.status().code() == absl::StatusCode::kInvalidArgument);
    REQUIRE(v.status().message().find(absl::StrCat("--listen: '", text, "'")) == 0);
  }
}

}  // namespace
}  // namespace kvd
