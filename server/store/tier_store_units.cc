// TierStore: a hybrid pool's units (docs/hybrid.md §2.9). A spine node leaves G1 with the
// components that hang off it (its window blocks, its state checkpoints) and is stored as one kUnit
// record: one header, one checksum, one segment, so a unit is on a tier whole or not at all. Before
// a lookup, the units below G1 that extend G1's spine match come back into G1 (KvCache's
// BeginInstall / FinishInstall); the lookup then applies §2.6 to what is there.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/vocab/status_macros.h"
#include "server/store/tier_store.h"
#include "spdlog/spdlog.h"

namespace kvd {

int64_t TierStore::UnitRawLength(PoolId pool, absl::Span<const UnitRecordPart> parts) const {
  const PoolGeometry& g = pools_[pool];
  const int spine = spine_groups_[pool];
  if (!g.hybrid() || spine < 0) return -1;
  int64_t total = g.GroupUnitBytes(spine) * g.num_shards;
  std::vector<bool> seen(g.groups.size(), false);
  for (const UnitRecordPart& p : parts) {
    if (p.group >= g.groups.size() || static_cast<int>(p.group) == spine || seen[p.group] ||
        (p.tail && g.groups[p.group].attention())) {
      return -1;
    }
    seen[p.group] = true;
    total += g.GroupUnitBytes(p.group) * g.num_shards;
  }
  return total;
}

absl::Status TierStore::ReadFromDevice(const CachedBlockView& v, uint8_t* out) const {
  const PoolGeometry& g = pools_[v.pool];
  if (!g.hybrid()) return arena_->ReadBlock(v.pool, v.index, out);
  KVD_RETURN_IF_ERROR(arena_->ReadBlock(v.pool, v.index, out));
  int64_t at = g.GroupUnitBytes(spine_groups_[v.pool]) * g.num_shards;
  for (const UnitComponent& c : v.parts) {
    KVD_RETURN_IF_ERROR(arena_->ReadBlock(v.pool, c.index, out + at));
    at += g.GroupUnitBytes(c.group) * g.num_shards;
  }
  return absl::OkStatus();
}

bool TierStore::InstallUnits(const RequestSpec& spec, std::function<void()> done) {
  absl::StatusOr<PoolId> pool_or = PoolOf(spec.ns.pool);
  if (!pool_or.ok()) return false;
  const PoolId pool = *pool_or;
  const PoolGeometry& g = pools_[pool];
  if (!g.hybrid() || spine_groups_[pool] < 0) return false;
  const int32_t bt = g.block_tokens;
  const int64_t len = std::min<int64_t>(static_cast<int64_t>(spec.prompt.size()), g.max_model_len);
  if (len <= 1) return false;
  const int64_t max_blocks = (len - 1) / bt;  // leave one token to compute
  absl::StatusOr<int64_t> first = cache_->SpineMatch(spec.ns, spec.prompt);
  if (!first.ok() || *first >= max_blocks) return false;
  const absl::Span<const Token> prompt = absl::MakeConstSpan(spec.prompt).first(static_cast<size_t>(len));
  const std::vector<BlockKey> keys = ChainKeys(spec.ns, prompt, bt, max_blocks);
  std::vector<int> state_groups;
  for (size_t i = 0; i < g.groups.size(); ++i) {
    if (g.groups[i].kind == KvGroupKind::kState) state_groups.push_back(static_cast<int>(i));
  }
  std::vector<ReadSource> sources;
  {
    absl::MutexLock lock(&mu_);
    std::vector<std::pair<BlockKey, Entry*>> run;
    for (int64_t i = *first; i < max_blocks; ++i) {
      Entry* e = FindBlockLocked(keys[i], i > 0 ? keys[i - 1] : BlockKey{}, i > 0,
                                 prompt.subspan(static_cast<size_t>(i * bt), static_cast<size_t>(bt)));
      // Another grouping, model or layout has another tag (LayoutTag covers the groups).
      if (e == nullptr || !HasBytes(*e) || e->header.kind != RecordKind::kUnit ||
          e->header.layout_tag != layout_tags_[pool] ||
          e->header.raw_length != UnitRawLength(pool, e->header.parts)) {
        break;
      }
      run.emplace_back(keys[i], e);
    }
    // With a state group a hit ends at a checkpoint, and a unit past the last one could only be
    // dropped again (U2): the run ends at the deepest unit with a checkpoint of every state group.
    const auto has_states = [&](const RecordHeader& h) {
      for (int s : state_groups) {
        if (std::none_of(h.parts.begin(), h.parts.end(), [&](const UnitRecordPart& p) { return p.group == s; })) {
          return false;
        }
      }
      return true;
    };
    while (!state_groups.empty() && !run.empty() && !has_states(run.back().second->header)) run.pop_back();
    for (auto& [key, e] : run) sources.push_back(PinForReadLocked(key, *e));
  }
  if (sources.empty()) return false;
  readers_->Submit([this, pool, ns = spec.ns, prompt = std::vector<Token>(prompt.begin(), prompt.end()),
                    first = *first, sources = std::move(sources), done = std::move(done)]() {
    const PoolGeometry& geo = pools_[pool];
    std::vector<std::vector<UnitComponent>> units;
    for (const ReadSource& src : sources) {
      std::vector<UnitComponent> parts;
      for (const UnitRecordPart& p : src.header.parts) parts.push_back(UnitComponent{p.group, 0, p.tail});
      units.push_back(std::move(parts));
    }
    absl::StatusOr<TierPort::UnitInstall> install = cache_->BeginInstall(ns, prompt, first, std::move(units));
    int64_t installed = 0;
    if (install.ok()) {
      std::vector<uint8_t> buf;
      int64_t written = 0;
      for (size_t i = 0; i < sources.size(); ++i) {
        const ReadSource& src = sources[i];
        buf.resize(static_cast<size_t>(src.header.raw_length));
        absl::Status s = ReadRaw(src, buf.data());
        int64_t at = 0;
        if (s.ok()) {
          s = arena_->WriteBlock(pool, install->spine[i], buf.data());
          at += geo.GroupUnitBytes(spine_groups_[pool]) * geo.num_shards;
        }
        for (size_t j = 0; s.ok() && j < install->parts[i].size(); ++j) {
          const UnitComponent& c = install->parts[i][j];
          s = arena_->WriteBlock(pool, c.index, buf.data() + at);
          at += geo.GroupUnitBytes(c.group) * geo.num_shards;
        }
        if (!s.ok()) {
          spdlog::error("promotion of a unit: {}{}", std::string(s.message()),
                        absl::IsDataLoss(s) ? "; the unit is dropped" : "; the unit is kept");
          OnReadFailure(src, s);
          break;
        }
        ++written;
      }
      installed = cache_->FinishInstall(ns, prompt, *std::move(install), written);
    }
    {
      absl::MutexLock lock(&mu_);
      for (const ReadSource& s : sources) UnpinLocked(s.key);
      if (installed > 0) {
        // Counted per unit by the tier it came from (the first `installed` of the run).
        int64_t left = installed;
        for (size_t i = 0; i < sources.size() && left > 0; ++i, --left) {
          ++stats_.promotions[sources[i].segment_path.empty() ? 1 : 2];
        }
        stats_.promoted_tokens += installed * geo.block_tokens;
      }
    }
    if (!install.ok()) {
      spdlog::debug("units of pool '{}' not brought back: {}", geo.name, install.status().ToString());
    }
    done();
  });
  return true;
}

}  // namespace kvd
