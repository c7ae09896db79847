// TierStore: PeekPrefixLen and Prefetch on a hybrid pool (docs/hybrid.md §2.9). A peek answers
// what a start would hit once InstallUnits brought the tiers' units back, from the records'
// headers in memory; a prefetch runs that install ahead of the start, so the start is a G1 hit.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/vocab/status_macros.h"
#include "server/store/tier_store.h"

namespace kvd {

int64_t TierStore::PeekUnits(const Namespace& ns, absl::Span<const Token> tokens) {
  absl::StatusOr<PoolId> pool_or = PoolOf(ns.pool);
  if (!pool_or.ok()) return 0;
  const PoolId pool = *pool_or;
  const PoolGeometry& g = pools_[pool];
  if (!g.hybrid() || spine_groups_[pool] < 0) return 0;
  const int32_t bt = g.block_tokens;
  const int64_t len = std::min<int64_t>(static_cast<int64_t>(tokens.size()), g.max_model_len);
  if (len <= 1) return 0;
  const int64_t max_blocks = (len - 1) / bt;  // as InstallUnits
  absl::StatusOr<int64_t> first = cache_->SpineMatch(ns, tokens);
  if (!first.ok() || *first >= max_blocks) return 0;
  const absl::Span<const Token> prompt = tokens.first(static_cast<size_t>(len));
  const std::vector<BlockKey> keys = ChainKeys(ns, prompt, bt, max_blocks);
  std::vector<std::vector<UnitComponent>> units;
  {
    absl::MutexLock lock(&mu_);
    std::vector<std::pair<BlockKey, Entry*>> run = UnitRunLocked(pool, prompt, keys, *first, max_blocks);
    while (!run.empty() && !EndsAtEveryState(pool, run.back().second->header)) run.pop_back();
    for (const auto& [key, e] : run) {
      std::vector<UnitComponent> parts;
      for (const UnitRecordPart& p : e->header.parts) parts.push_back(UnitComponent{p.group, 0, p.tail});
      units.push_back(std::move(parts));
    }
  }
  if (units.empty()) return 0;
  // The headers' parts were copied above: the engine's lock is taken with this store's released.
  absl::StatusOr<int64_t> hit = cache_->PeekInstalled(ns, prompt, *first, units);
  return hit.ok() ? *hit : 0;
}

absl::StatusOr<bool> TierStore::PrefetchUnits(const Namespace& ns, absl::Span<const Token> tokens,
                                              const WorkerId& owner, std::function<void(PrefetchInfo)> done) {
  KVD_ASSIGN_OR_RETURN(PoolId pool, PoolOf(ns.pool));
  if (!pools_[pool].hybrid() || spine_groups_[pool] < 0) return false;
  PrefetchInfo info;
  {
    absl::MutexLock lock(&mu_);
    int64_t& held = prefetches_of_[owner];
    if (held >= options_.max_prefetch_handles_per_worker) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "worker '", owner.value(), "' holds ", held, " prefetch handles (max_prefetch_handles_per_worker); release some"));
    }
    ++held;
    info.handle = next_prefetch_++;
    prefetches_[info.handle] = Prefetched{owner, {}};  // the units go to G1: nothing is held below it
  }
  // The same install a start runs (its run, its checks, a damaged unit dropped), ahead of it.
  RequestSpec spec;
  spec.ns = ns;
  spec.prompt.assign(tokens.begin(), tokens.end());
  const int64_t before = cache_->SpineMatch(ns, tokens).value_or(0);
  auto finish = [this, ns, prompt = spec.prompt, before, info, done](bool installing) mutable {
    const int64_t after = installing ? cache_->SpineMatch(ns, prompt).value_or(0) : before;
    info.found_blocks = std::max<int64_t>(after - before, 0);
    done(info);
  };
  if (!InstallUnits(spec, [finish]() mutable { finish(true); })) finish(false);
  return true;
}

}  // namespace kvd
