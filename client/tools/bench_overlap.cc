#include "client/tools/bench_overlap.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"

namespace kvd::bench {
namespace {

uint64_t Mix(uint64_t x) {  // SplitMix64's finalizer
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace

PrefillClock::PrefillClock(double tokens_per_second, const std::string& lock_path, int64_t chunk_tokens)
    : tokens_per_second_(tokens_per_second), lock_path_(lock_path), chunk_tokens_(std::max<int64_t>(1, chunk_tokens)) {}

PrefillClock::~PrefillClock() {
  if (fd_ >= 0) close(fd_);
}

absl::Status PrefillClock::Open() {
  if (lock_path_.empty() || tokens_per_second_ <= 0) return absl::OkStatus();
  fd_ = open(lock_path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd_ < 0) return absl::NotFoundError(absl::StrCat("prefill lock file ", lock_path_, " cannot be opened"));
  return absl::OkStatus();
}

void PrefillClock::Compute(int64_t tokens) const {
  if (tokens_per_second_ <= 0 || tokens <= 0) return;
  if (fd_ < 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(tokens / tokens_per_second_));
    return;
  }
  for (int64_t done = 0; done < tokens; done += chunk_tokens_) {
    const int64_t n = std::min(chunk_tokens_, tokens - done);
    flock(fd_, LOCK_EX);  // the node's one engine
    std::this_thread::sleep_for(std::chrono::duration<double>(n / tokens_per_second_));
    flock(fd_, LOCK_UN);
  }
}

std::vector<Token> FanoutPrompt(uint64_t seed, int k, int64_t context_tokens, int64_t own_tokens) {
  std::vector<Token> out;
  out.reserve(context_tokens + own_tokens);
  const uint64_t ctx = Mix(seed ^ 0xC0FFEEULL);
  for (int64_t i = 0; i < context_tokens; ++i) out.push_back(static_cast<Token>(Mix(ctx + i) & 0x1FFFF));
  const uint64_t own = Mix(ctx ^ Mix(static_cast<uint64_t>(k) + 1));
  for (int64_t i = 0; i < own_tokens; ++i) out.push_back(static_cast<Token>(Mix(own + i) & 0x1FFFF));
  return out;
}

}  // namespace kvd::bench
