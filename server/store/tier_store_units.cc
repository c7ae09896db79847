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
namespace {

// With a state group a hit ends at a checkpoint, and a unit past the last one could only be
// dropped again (U2): a run of units to install ends at the deepest one for which this holds.
bool HasEveryState(const PoolGeometry& g, const RecordHeader& h) {
  for (size_t s = 0; s < g.groups.size(); ++s) {
    if (g.groups[s].kind != KvGroupKind::kState) continue;
    if (std::none_of(h.parts.begin(), h.parts.end(), [&](const UnitRecordPart& p) { return p.group == s; })) {
      return false;
    }
  }
  return true;
}

}  // namespace

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

bool TierStore::EndsAtEveryState(PoolId pool, const RecordHeader& h) const { return HasEveryState(pools_[pool], h); }

std::vector<std::pair<BlockKey, TierStore::Entry*>> TierStore::UnitRunLocked(PoolId pool,
                                                                             absl::Span<const Token> prompt,
                                                                             absl::Span<const BlockKey> keys,
                                                                             int64_t first, int64_t max_blocks) {
  const PoolGeometry& g = pools_[pool];
  const int32_t bt = g.block_tokens;
  std::vector<std::pair<BlockKey, Entry*>> run;
  for (int64_t i = first; i < max_blocks; ++i) {
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
  return run;
}

absl::Status TierStore::WriteUnitToDevice(PoolId pool, BlockIndex spine, absl::Span<const UnitComponent> parts,
                                          const uint8_t* raw) const {
  const PoolGeometry& g = pools_[pool];
  KVD_RETURN_IF_ERROR(arena_->WriteBlock(pool, spine, raw));
  int64_t at = g.GroupUnitBytes(spine_groups_[pool]) * g.num_shards;
  for (const UnitComponent& c : parts) {
    KVD_RETURN_IF_ERROR(arena_->WriteBlock(pool, c.index, raw + at));
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
  std::vector<BlockKey> keys = ChainKeys(spec.ns, prompt, bt, max_blocks);
  std::vector<ReadSource> sources;
  int64_t local_end = *first;
  bool ask_remote = false;
  {
    absl::MutexLock lock(&mu_);
    std::vector<std::pair<BlockKey, Entry*>> run = UnitRunLocked(pool, prompt, keys, *first, max_blocks);
    // G4 is asked for the units that follow the local run (skipped at once while it is failing);
    // the run is then cut to its last checkpoint once G4's part is known, on the reader thread.
    local_end = *first + static_cast<int64_t>(run.size());
    ask_remote = remote_ != nullptr && remote_->available() && local_end < max_blocks;
    if (!ask_remote) {
      while (!run.empty() && !HasEveryState(g, run.back().second->header)) run.pop_back();
    }
    for (auto& [key, e] : run) sources.push_back(PinForReadLocked(key, *e));
  }
  if (sources.empty() && !ask_remote) return false;
  readers_->Submit([this, pool, ns = spec.ns, prompt = std::vector<Token>(prompt.begin(), prompt.end()),
                    first = *first, local_end, max_blocks, ask_remote, keys = std::move(keys),
                    sources = std::move(sources), done = std::move(done)]() mutable {
    const PoolGeometry& geo = pools_[pool];
    std::vector<RecordHeader> remote;  // G4's run after the local one
    if (ask_remote) remote = PeekRemoteUnits(pool, ns, keys, local_end, max_blocks);
    const auto header = [&](size_t i) -> const RecordHeader& {
      return i < sources.size() ? sources[i].header : remote[i - sources.size()];
    };
    size_t run = sources.size() + remote.size();
    while (run > 0 && !HasEveryState(geo, header(run - 1))) --run;
    const size_t local = std::min(run, sources.size());
    remote.resize(run - local);
    std::vector<std::vector<UnitComponent>> units;
    for (size_t i = 0; i < run; ++i) {
      std::vector<UnitComponent> parts;
      for (const UnitRecordPart& p : header(i).parts) parts.push_back(UnitComponent{p.group, 0, p.tail});
      units.push_back(std::move(parts));
    }
    absl::StatusOr<TierPort::UnitInstall> install =
        run == 0 ? absl::NotFoundError("no unit with every state group's checkpoint")
                 : cache_->BeginInstall(ns, prompt, first, std::move(units));
    int64_t installed = 0;
    if (install.ok()) {
      std::vector<uint8_t> buf;
      int64_t written = 0;
      for (size_t i = 0; i < local; ++i) {
        const ReadSource& src = sources[i];
        buf.resize(static_cast<size_t>(src.header.raw_length));
        absl::Status s = ReadRaw(src, buf.data());
        if (s.ok()) s = WriteUnitToDevice(pool, install->spine[i], install->parts[i], buf.data());
        if (!s.ok()) {
          spdlog::error("promotion of a unit: {}{}", std::string(s.message()),
                        absl::IsDataLoss(s) ? "; the unit is dropped" : "; the unit is kept");
          OnReadFailure(src, s);
          break;
        }
        ++written;
      }
      if (written == static_cast<int64_t>(local) && !remote.empty()) {
        written += FetchRemoteUnits(pool, ns, prompt, keys, local_end, remote, *install, local);
      }
      installed = cache_->FinishInstall(ns, prompt, *std::move(install), written);
    }
    {
      absl::MutexLock lock(&mu_);
      for (const ReadSource& s : sources) UnpinLocked(s.key);
      if (installed > 0) {
        // Counted per unit by the tier it came from (the first `installed` of the run).
        for (int64_t i = 0; i < installed; ++i) {
          if (static_cast<size_t>(i) >= local) {
            ++stats_.remote_promotions;
          } else {
            ++stats_.promotions[sources[static_cast<size_t>(i)].segment_path.empty() ? 1 : 2];
          }
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
