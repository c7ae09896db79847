// What kvd-bench needs to replay overlap honestly (kvd-reuse-2 item 4): a prefill delay between a
// request's start and its publish, optionally shared by the whole node, and the agent fan-out
// workload's prompts.
//
// PrefillClock models the engine's prefill: `tokens` computed at `tokens_per_second`. Unshared,
// every request sleeps its own tokens / rate (a node with compute to spare: overlapping requests
// do not slow each other). Shared (`lock_path` set), the rate is the node's: each request computes
// in chunks of `chunk_tokens`, each chunk taken under an exclusive flock(2) on the file every
// worker process opens, so concurrent prefills queue for one engine as on a real node and a prefix
// computed twice costs the second computation's time too.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "proto/vocab/types.h"

namespace kvd::bench {

class PrefillClock {
 public:
  // `tokens_per_second` <= 0: no delay at all.
  PrefillClock(double tokens_per_second, const std::string& lock_path, int64_t chunk_tokens = 2048);
  ~PrefillClock();
  PrefillClock(const PrefillClock&) = delete;
  PrefillClock& operator=(const PrefillClock&) = delete;

  // Opens the shared lock file when there is one (NOT_FOUND naming it otherwise).
  absl::Status Open();
  // Blocks for the time `tokens` take to prefill.
  void Compute(int64_t tokens) const;
  bool enabled() const { return tokens_per_second_ > 0; }

 private:
  double tokens_per_second_;
  std::string lock_path_;
  int64_t chunk_tokens_;
  int fd_ = -1;
};

// The agent fan-out's prompts: a new shared context of `context_tokens` (new for every `seed`)
// followed by request `k`'s own `own_tokens`, unlike any other request's.
std::vector<Token> FanoutPrompt(uint64_t seed, int k, int64_t context_tokens, int64_t own_tokens);

}  // namespace kvd::bench
