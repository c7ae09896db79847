// What a prefix hit saves: the prefill compute of the tokens it did not recompute, under a
// documented cost model of a dense decoder-only transformer (docs/performance.md, "Compute saved").
//
// Per layer, every prompt token costs the same linear work (the Q, K, V and O projections and a
// gated MLP: 2 FLOPs per weight), and causal attention costs 4 × hidden FLOPs per (query, key)
// pair (scores and the weighted sum over values, all heads together): the token at position p
// (0-based) attends to p + 1 keys. So prefilling positions [begin, end) costs
//     layers × ((end - begin) × linear + 4 × hidden × Σ_{p=begin}^{end-1} (p + 1)).
// A hit of the first h tokens saves the cost of [0, h): the tokens after it still attend to the
// cached ones, which stays in the remaining cost. The embedding and the LM head are left out (the
// head runs for the last token only, hit or not). The defaults are Llama-3-8B's shape.
//
// ReuseTally adds up, over a replay, prompt and hit tokens and prompt and saved FLOPs.
#pragma once

#include <cstdint>

namespace kvd::bench {

struct ModelShape {
  int64_t layers = 32;
  int64_t hidden = 4096;
  int64_t heads = 32;
  int64_t kv_heads = 8;   // grouped-query attention: K and V are hidden × kv_heads / heads wide
  int64_t ffn = 14336;    // the gated MLP's inner width (three hidden × ffn matrices)
};

class PrefillCost {
 public:
  explicit PrefillCost(const ModelShape& shape = ModelShape());

  // FLOPs of one token's linear work, all layers.
  double LinearFlopsPerToken() const { return linear_; }
  // FLOPs of one (query, key) attention pair, all layers.
  double AttentionFlopsPerPair() const { return attention_; }
  // FLOPs to prefill positions [begin, end). REQUIRES: 0 <= begin <= end.
  double Flops(int64_t begin, int64_t end) const;

 private:
  double linear_ = 0;
  double attention_ = 0;
};

struct ReuseTally {
  int64_t requests = 0;
  int64_t prompt_tokens = 0;
  int64_t hit_tokens = 0;
  double prompt_flops = 0;  // prefill of every prompt in full
  double saved_flops = 0;   // prefill of the hit prefixes

  // One request of `prompt` tokens whose first `hit` were reused.
  void Add(const PrefillCost& cost, int64_t prompt, int64_t hit);
  double hit_rate() const { return prompt_tokens == 0 ? 0 : double(hit_tokens) / prompt_tokens; }
  double saved_fraction() const { return prompt_flops == 0 ? 0 : saved_flops / prompt_flops; }
};

}  // namespace kvd::bench
