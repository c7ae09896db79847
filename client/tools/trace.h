// Request traces for replay benchmarks: the Mooncake FAST'25 JSONL format, one request per line:
//   {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}
// `hash_ids` name 512-token prefix blocks: a hash stands for its block and everything before it.
//
// Traces carry no tokens. TraceTokens() derives them deterministically from each hash id and the
// position inside its block, so that requests sharing a hash_ids prefix share a token prefix and
// nothing else: a cache replaying the tokens sees exactly the trace's reuse.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/vocab/types.h"

namespace kvd::bench {

inline constexpr int kTraceBlockTokens = 512;

struct TraceRequest {
  int64_t timestamp_ms = 0;
  int64_t input_length = 0;
  int64_t output_length = 0;
  std::vector<uint64_t> hash_ids;
};

// Parses one JSONL line. INVALID_ARGUMENT naming the missing or malformed field.
absl::StatusOr<TraceRequest> ParseTraceLine(const std::string& line);
// Reads a whole trace file; blank lines are skipped. NOT_FOUND if the file cannot be opened.
absl::StatusOr<std::vector<TraceRequest>> LoadTrace(const std::string& path);

// The request's prompt: input_length tokens, 512 per hash id. `seed` selects another, equally
// deterministic token mapping (same sharing structure, different tokens).
std::vector<Token> TraceTokens(const TraceRequest& request, uint64_t seed = 0);

}  // namespace kvd::bench
