#include "client/tools/trace.h"

#include <cstdlib>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvd::bench {
namespace {

// The text after `"key":`, or an empty view when the key is absent.
absl::string_view ValueOf(absl::string_view line, absl::string_view key) {
  const std::string quoted = absl::StrCat("\"", key, "\"");
  size_t at = line.find(quoted);
  if (at == absl::string_view::npos) return {};
  absl::string_view rest = line.substr(at + quoted.size());
  rest = absl::StripLeadingAsciiWhitespace(rest);
  if (!absl::ConsumePrefix(&rest, ":")) return {};
  return absl::StripLeadingAsciiWhitespace(rest);
}

absl::StatusOr<int64_t> IntField(absl::string_view line, absl::string_view key) {
  absl::string_view v = ValueOf(line, key);
  size_t end = v.find_first_of(",}");
  int64_t out = 0;
  if (v.empty() || end == absl::string_view::npos ||
      !absl::SimpleAtoi(absl::StripAsciiWhitespace(v.substr(0, end)), &out)) {
    return absl::InvalidArgumentError(absl::StrCat("trace line: bad or missing '", key, "'"));
  }
  return out;
}

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

absl::StatusOr<TraceRequest> ParseTraceLine(const std::string& line) {
  TraceRequest r;
  auto ts = IntField(line, "timestamp");
  if (!ts.ok()) return ts.status();
  r.timestamp_ms = *ts;
  auto in = IntField(line, "input_length");
  if (!in.ok()) return in.status();
  r.input_length = *in;
  auto out = IntField(line, "output_length");
  if (!out.ok()) return out.status();
  r.output_length = *out;
  absl::string_view ids = ValueOf(line, "hash_ids");
  if (!absl::ConsumePrefix(&ids, "[")) {
    return absl::InvalidArgumentError("trace line: bad or missing 'hash_ids'");
  }
  size_t close = ids.find(']');
  if (close == absl::string_view::npos) return absl::InvalidArgumentError("trace line: unclosed 'hash_ids'");
  for (absl::string_view item : absl::StrSplit(ids.substr(0, close), ',', absl::SkipWhitespace())) {
    uint64_t id = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(item), &id)) {
      return absl::InvalidArgumentError("trace line: non-integer hash id");
    }
    r.hash_ids.push_back(id);
  }
  if (r.input_length < 0 || r.output_length < 0) {
    return absl::InvalidArgumentError("trace line: negative length");
  }
  if (static_cast<int64_t>(r.hash_ids.size()) * kTraceBlockTokens < r.input_length) {
    return absl::InvalidArgumentError("trace line: fewer hash_ids than input_length needs");
  }
  return r;
}

absl::StatusOr<std::vector<TraceRequest>> LoadTrace(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open trace '", path, "'"));
  std::vector<TraceRequest> out;
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (absl::StripAsciiWhitespace(line).empty()) continue;
    auto r = ParseTraceLine(line);
    if (!r.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": ", r.status().message()));
    out.push_back(std::move(*r));
  }
  return out;
}

std::vector<Token> TraceTokens(const TraceRequest& request, uint64_t seed) {
  std::vector<Token> tokens(request.input_length);
  for (int64_t i = 0; i < request.input_length; ++i) {
    const uint64_t h = request.hash_ids[i / kTraceBlockTokens];
    // 17 bits: a realistic vocabulary size (~128k); collisions between blocks stay negligible
    // because a block is 512 such tokens.
    tokens[i] = static_cast<Token>(
        SplitMix64((h * kTraceBlockTokens + i % kTraceBlockTokens) ^ (seed * 0x9E3779B97F4A7C15ULL)) & 0x1FFFF);
  }
  return tokens;
}

}  // namespace kvd::bench
