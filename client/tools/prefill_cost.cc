#include "client/tools/prefill_cost.h"

namespace kvd::bench {

PrefillCost::PrefillCost(const ModelShape& s) {
  const double h = static_cast<double>(s.hidden);
  const double kv = h * static_cast<double>(s.kv_heads) / static_cast<double>(s.heads);
  const double weights = 2 * h * h + 2 * h * kv + 3 * h * static_cast<double>(s.ffn);
  linear_ = static_cast<double>(s.layers) * 2 * weights;
  attention_ = static_cast<double>(s.layers) * 4 * h;
}

double PrefillCost::Flops(int64_t begin, int64_t end) const {
  const double b = static_cast<double>(begin), e = static_cast<double>(end);
  // Σ_{p=begin}^{end-1} (p + 1) = (end (end + 1) - begin (begin + 1)) / 2
  return (e - b) * linear_ + attention_ * (e * (e + 1) - b * (b + 1)) / 2;
}

void ReuseTally::Add(const PrefillCost& cost, int64_t prompt, int64_t hit) {
  ++requests;
  prompt_tokens += prompt;
  hit_tokens += hit;
  prompt_flops += cost.Flops(0, prompt);
  saved_flops += cost.Flops(0, hit);
}

}  // namespace kvd::bench
