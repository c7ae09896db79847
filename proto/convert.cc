#include "proto/convert.h"

#include <sys/random.h>
#include <xxhash.h>

#include <optional>

#include "absl/strings/str_cat.h"
#include "proto/vocab/media_span.h"
#include "absl/time/clock.h"

namespace kvd {
namespace {

std::string KeyBytes(const BlockKey& k) {
  std::string out(16, '\0');
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<char>(k.hi >> (56 - 8 * i));
    out[8 + i] = static_cast<char>(k.lo >> (56 - 8 * i));
  }
  return out;
}

BlockKey KeyFromBytes(const std::string& b) {
  BlockKey k;
  if (b.size() != 16) return k;
  for (int i = 0; i < 8; ++i) {
    k.hi = (k.hi << 8) | static_cast<uint8_t>(b[i]);
    k.lo = (k.lo << 8) | static_cast<uint8_t>(b[8 + i]);
  }
  return k;
}

template <typename T>
void CopyTokens(const std::vector<T>& v, google::protobuf::RepeatedField<uint32_t>* p) {
  p->Reserve(static_cast<int>(v.size()));
  for (T t : v) p->AddAlreadyReserved(static_cast<uint32_t>(t));
}

}  // namespace

std::vector<Token> TokensFromProto(const google::protobuf::RepeatedField<uint32_t>& p) {
  return std::vector<Token>(p.begin(), p.end());
}

Namespace FromProto(const v1::Namespace& p) {
  Namespace ns;
  ns.pool = p.pool();
  ns.adapter = p.adapter();
  ns.media_keys.assign(p.media_keys().begin(), p.media_keys().end());
  for (const v1::MediaItem& m : p.media()) {
    ns.media_keys.push_back(PositionedMediaKey(MediaSpan{m.identifier(), m.offset(), m.length()}));
  }
  ns.method = p.method();
  ns.cache_salt = p.cache_salt();
  return ns;
}

void ToProto(const Namespace& ns, v1::Namespace* p) {
  p->set_pool(ns.pool);
  p->set_adapter(ns.adapter);
  for (const auto& m : ns.media_keys) {
    if (std::optional<MediaSpan> span = ParsePositionedMediaKey(m)) {
      v1::MediaItem* item = p->add_media();
      item->set_identifier(span->identifier);
      item->set_offset(static_cast<uint32_t>(span->offset));
      item->set_length(static_cast<uint32_t>(span->length));
    } else {
      p->add_media_keys(m);
    }
  }
  p->set_method(ns.method);
  p->set_cache_salt(ns.cache_salt);
}

std::string SaltFingerprint(absl::string_view salt) {
  if (salt.empty()) return "";
  // Keyed per process: equal salts match within one daemon's answers; nothing about a salt can be
  // tested offline against the fingerprint.
  static const uint64_t kKey = [] {
    uint64_t k = 0;
    if (getrandom(&k, sizeof(k), 0) != static_cast<ssize_t>(sizeof(k))) k = static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
    return k;
  }();
  return absl::StrCat("fp:", absl::Hex(XXH3_64bits_withSeed(salt.data(), salt.size(), kKey), absl::kZeroPad16));
}

void ToProtoRedacted(const Namespace& ns, v1::Namespace* p) {
  ToProto(ns, p);
  p->set_cache_salt(SaltFingerprint(ns.cache_salt));
}

RequestSpec SpecFromProto(const v1::AdmitRequest& p) {
  RequestSpec s;
  s.id = RequestId(p.request_id());
  s.ns = FromProto(p.namespace_());
  s.prompt = TokensFromProto(p.prompt());
  s.max_new_tokens = p.max_new_tokens();
  s.session = SessionId(p.session_id());
  s.resume_from = RequestId(p.resume_from());
  s.owner = WorkerId(p.worker_id());
  return s;
}

void ToProto(const RequestSpec& s, v1::AdmitRequest* p) {
  p->set_request_id(s.id.value());
  ToProto(s.ns, p->mutable_namespace_());
  CopyTokens(s.prompt, p->mutable_prompt());
  p->set_max_new_tokens(s.max_new_tokens);
  p->set_session_id(s.session.value());
  p->set_resume_from(s.resume_from.value());
  p->set_worker_id(s.owner.value());
}

void ToProto(const AdmitResult& r, v1::AdmitResponse* p) {
  p->set_admitted(r.decision == AdmitDecision::kAdmitted);
  p->set_projected_bytes(r.projected_bytes);
  p->set_available_bytes(r.available_bytes);
}

AdmitResult FromProto(const v1::AdmitResponse& p) {
  AdmitResult r;
  r.decision = p.admitted() ? AdmitDecision::kAdmitted : AdmitDecision::kWait;
  r.projected_bytes = p.projected_bytes();
  r.available_bytes = p.available_bytes();
  return r;
}

void ToProto(const AcquireResult& r, v1::AcquireResponse* p) {
  p->set_pool_id(r.pool);
  CopyTokens(r.blocks, p->mutable_blocks());
  p->set_num_tokens(r.num_tokens);
  p->set_cached_tokens(r.cached_tokens);
  p->set_resumed(r.resumed);
  CopyTokens(r.resumed_tokens, p->mutable_resumed_tokens());
  p->set_engine_state(r.engine_state);
  for (const std::string& e : r.publisher_events) p->add_publisher_events(e);
  for (const GroupTable& t : r.group_tables) ToProto(t, p->add_group_tables());
  p->set_full_hit_tokens(r.full_hit_tokens);
  if (r.limited_by >= 0 && r.limited_by < static_cast<int>(r.group_tables.size())) {
    p->set_limited_by(r.group_tables[r.limited_by].name);
  }
  if (r.in_flight.has_value()) ToProto(*r.in_flight, p->mutable_in_flight());
}

void ToProto(const InFlightInfo& f, v1::InFlight* p) {
  p->set_first_block(f.first_block);
  p->set_blocks(f.blocks);
  p->set_request_id(f.request_id.value());
  p->set_published_tokens(f.published_tokens);
  p->set_computed_tokens(f.computed_tokens);
}

void ToProto(const GroupTable& t, v1::GroupTable* p) {
  p->set_group(t.name);
  p->set_first_block_position(t.first_block_position);
  p->mutable_blocks()->Add(t.blocks.begin(), t.blocks.end());
  if (t.checkpoint_slot >= 0) p->set_checkpoint_slot(static_cast<uint32_t>(t.checkpoint_slot));
}

std::vector<StateCheckpoint> FromProto(const google::protobuf::RepeatedPtrField<v1::StateCheckpoint>& p) {
  std::vector<StateCheckpoint> out;
  for (const v1::StateCheckpoint& c : p) out.push_back({c.group(), c.position_tokens(), c.slot()});
  return out;
}

void ToProto(absl::Span<const StateCheckpoint> checkpoints,
             google::protobuf::RepeatedPtrField<v1::StateCheckpoint>* p) {
  for (const StateCheckpoint& c : checkpoints) {
    v1::StateCheckpoint* q = p->Add();
    q->set_group(c.group);
    q->set_position_tokens(c.position_tokens);
    q->set_slot(c.slot);
  }
}

GroupTable FromProto(const v1::GroupTable& p, int group) {
  GroupTable t;
  t.group = group;
  t.name = p.group();
  t.first_block_position = p.first_block_position();
  t.blocks.assign(p.blocks().begin(), p.blocks().end());
  t.checkpoint_slot = p.has_checkpoint_slot() ? static_cast<int64_t>(p.checkpoint_slot()) : -1;
  return t;
}

AcquireResult FromProto(const v1::AcquireResponse& p) {
  AcquireResult r;
  r.pool = p.pool_id();
  r.blocks.assign(p.blocks().begin(), p.blocks().end());
  r.num_tokens = p.num_tokens();
  r.cached_tokens = p.cached_tokens();
  r.resumed = p.resumed();
  r.resumed_tokens = TokensFromProto(p.resumed_tokens());
  r.engine_state = p.engine_state();
  r.publisher_events.assign(p.publisher_events().begin(), p.publisher_events().end());
  for (int g = 0; g < p.group_tables_size(); ++g) {
    r.group_tables.push_back(FromProto(p.group_tables(g), g));
    if (!p.limited_by().empty() && p.group_tables(g).group() == p.limited_by()) r.limited_by = g;
  }
  r.full_hit_tokens = p.full_hit_tokens();
  if (p.has_in_flight()) {
    InFlightInfo f;
    f.first_block = p.in_flight().first_block();
    f.blocks = p.in_flight().blocks();
    f.request_id = RequestId(p.in_flight().request_id());
    f.published_tokens = p.in_flight().published_tokens();
    f.computed_tokens = p.in_flight().computed_tokens();
    r.in_flight = std::move(f);
  }
  return r;
}

void ToProto(const PublishResult& r, v1::PublishResponse* p) {
  for (PublishOutcome o : r.outcomes) p->add_outcomes(static_cast<v1::PublishOutcome>(o));
  p->set_kept(r.kept);
  for (CheckpointOutcome o : r.checkpoint_outcomes) p->add_checkpoint_outcomes(static_cast<v1::CheckpointOutcome>(o));
  p->mutable_fresh_slots()->Add(r.fresh_slots.begin(), r.fresh_slots.end());
}

PublishResult FromProto(const v1::PublishResponse& p) {
  PublishResult r;
  for (int o : p.outcomes()) r.outcomes.push_back(static_cast<PublishOutcome>(o));
  r.kept = p.kept();
  for (int o : p.checkpoint_outcomes()) r.checkpoint_outcomes.push_back(static_cast<CheckpointOutcome>(o));
  r.fresh_slots.assign(p.fresh_slots().begin(), p.fresh_slots().end());
  return r;
}

void ToProto(const CacheReport& r, v1::ReportResponse* p) {
  for (const PoolReport& pool : r.pools) {
    v1::PoolReport* q = p->add_pools();
    q->set_name(pool.name);
    q->set_block_bytes(pool.block_bytes);
    q->set_capacity_blocks(pool.capacity_blocks);
    q->set_free_blocks(pool.free_blocks);
    q->set_owned_blocks(pool.owned_blocks);
    q->set_cached_blocks(pool.cached_blocks);
    q->set_evictable_blocks(pool.evictable_blocks);
    q->set_protected_blocks(pool.protected_blocks);
    q->set_reserved_blocks(pool.reserved_blocks);
    for (const PoolReport::Group& g : pool.groups) {
      v1::GroupReport* gr = q->add_groups();
      gr->set_name(g.name);
      gr->set_capacity(g.capacity);
      gr->set_unit_bytes(g.unit_bytes);
      gr->set_free(g.free);
      gr->set_owned(g.owned);
      gr->set_cached(g.cached);
      gr->set_evictable(g.evictable);
      gr->set_reserved(g.reserved);
      gr->set_limited_hits(g.limited_hits);
      gr->set_limited_tokens(g.limited_tokens);
    }
  }
  p->set_budget_bytes(r.budget_bytes);
  p->set_reserved_bytes(r.reserved_bytes);
  p->set_checkpoint_bytes(r.checkpoint_bytes);
  p->set_lookups(r.lookups);
  p->set_hit_tokens(r.hit_tokens);
  p->set_miss_tokens(r.miss_tokens);
  p->set_resumed(r.resumed);
  p->set_published_blocks(r.published_blocks);
  p->set_duplicate_blocks(r.duplicate_blocks);
  for (int i = 0; i < kNumEvictReasons; ++i) {
    (*p->mutable_evictions())[EvictReasonName(static_cast<EvictReason>(i))] = r.evictions[i];
  }
  p->set_admitted(r.admitted);
  p->set_waited(r.waited);
  p->set_rejected(r.rejected);
  p->set_live_requests(r.live_requests);
  p->set_orphaned_checkpoints(r.orphaned_checkpoints);
  p->set_sessions(r.sessions);
  p->set_indexed_blocks(r.indexed_blocks);
  p->set_pressure(PressureLevelName(r.pressure));
  p->set_available_fraction(r.available_fraction);
  p->set_last_event_sequence(r.last_event_sequence);
}

CacheReport FromProto(const v1::ReportResponse& p) {
  CacheReport r;
  for (const v1::PoolReport& q : p.pools()) {
    PoolReport pool;
    pool.name = q.name();
    pool.block_bytes = q.block_bytes();
    pool.capacity_blocks = q.capacity_blocks();
    pool.free_blocks = q.free_blocks();
    pool.owned_blocks = q.owned_blocks();
    pool.cached_blocks = q.cached_blocks();
    pool.evictable_blocks = q.evictable_blocks();
    pool.protected_blocks = q.protected_blocks();
    pool.reserved_blocks = q.reserved_blocks();
    for (const v1::GroupReport& gr : q.groups()) {
      PoolReport::Group g;
      g.name = gr.name();
      g.capacity = gr.capacity();
      g.unit_bytes = gr.unit_bytes();
      g.free = gr.free();
      g.owned = gr.owned();
      g.cached = gr.cached();
      g.evictable = gr.evictable();
      g.reserved = gr.reserved();
      g.limited_hits = gr.limited_hits();
      g.limited_tokens = gr.limited_tokens();
      pool.groups.push_back(std::move(g));
    }
    r.pools.push_back(std::move(pool));
  }
  r.budget_bytes = p.budget_bytes();
  r.reserved_bytes = p.reserved_bytes();
  r.checkpoint_bytes = p.checkpoint_bytes();
  r.lookups = p.lookups();
  r.hit_tokens = p.hit_tokens();
  r.miss_tokens = p.miss_tokens();
  r.resumed = p.resumed();
  r.published_blocks = p.published_blocks();
  r.duplicate_blocks = p.duplicate_blocks();
  for (int i = 0; i < kNumEvictReasons; ++i) {
    auto it = p.evictions().find(EvictReasonName(static_cast<EvictReason>(i)));
    if (it != p.evictions().end()) r.evictions[i] = it->second;
  }
  r.admitted = p.admitted();
  r.waited = p.waited();
  r.rejected = p.rejected();
  r.live_requests = p.live_requests();
  r.orphaned_checkpoints = p.orphaned_checkpoints();
  r.sessions = p.sessions();
  r.indexed_blocks = p.indexed_blocks();
  r.pressure = p.pressure() == "critical" ? PressureLevel::kCritical
               : p.pressure() == "high"   ? PressureLevel::kHigh
                                          : PressureLevel::kNormal;
  r.available_fraction = p.available_fraction();
  r.last_event_sequence = p.last_event_sequence();
  return r;
}

void ToProto(const SessionInfo& s, v1::SessionInfo* p) {
  p->set_session_id(s.id.value());
  p->set_worker_id(s.worker.value());
  p->set_protected_blocks(s.protected_blocks);
  p->set_expires_unix_ms(absl::ToUnixMillis(s.expires_at));
}

SessionInfo FromProto(const v1::SessionInfo& p) {
  SessionInfo s;
  s.id = SessionId(p.session_id());
  s.worker = WorkerId(p.worker_id());
  s.protected_blocks = p.protected_blocks();
  s.expires_at = absl::FromUnixMillis(p.expires_unix_ms());
  return s;
}

void ToProto(const HandleInfo& h, v1::Handle* p) {
  p->set_request_id(h.id.value());
  p->set_pool(h.pool);
  p->set_worker_id(h.owner.value());
  p->set_session_id(h.session.value());
  p->set_acquired(h.acquired);
  p->set_num_tokens(h.num_tokens);
  p->set_cached_tokens(h.cached_tokens);
  p->set_reserved_bytes(h.reserved_bytes);
  CopyTokens(h.blocks, p->mutable_blocks());
  p->set_has_checkpoint(h.has_checkpoint);
}

HandleInfo FromProto(const v1::Handle& p) {
  HandleInfo h;
  h.id = RequestId(p.request_id());
  h.pool = p.pool();
  h.owner = WorkerId(p.worker_id());
  h.session = SessionId(p.session_id());
  h.acquired = p.acquired();
  h.num_tokens = p.num_tokens();
  h.cached_tokens = p.cached_tokens();
  h.reserved_bytes = p.reserved_bytes();
  h.blocks.assign(p.blocks().begin(), p.blocks().end());
  h.has_checkpoint = p.has_checkpoint();
  return h;
}

void ToProto(const FlushResult& r, v1::FlushResponse* p) {
  p->set_durable(r.durable);
  p->set_written_records(r.written_blocks);
  p->set_written_bytes(r.written_bytes);
  p->set_already_durable(r.already_durable);
  p->set_failed_records(r.failed_blocks);
  p->set_error(r.error);
  p->set_seconds(r.seconds);
}

void ToProto(const TierStats& s, v1::TierReport* p) {
  p->set_host_capacity_bytes(s.host_capacity_bytes);
  p->set_host_used_bytes(s.host_used_bytes);
  p->set_host_records(s.host_records);
  p->set_disk_capacity_bytes(s.disk_capacity_bytes);
  p->set_disk_used_bytes(s.disk_used_bytes);
  p->set_disk_records(s.disk_records);
  p->set_disk_segments(s.disk_segments);
  p->set_objects(s.objects);
  p->set_pending_spill_records(s.pending_spill_records);
  p->set_pending_spill_bytes(s.pending_spill_bytes);
  p->set_pending_snapshot_records(s.pending_snapshot_records);
  for (int r = 0; r <= kNumEvictReasons; ++r) {
    const std::string reason =
        r == kNumEvictReasons ? "idle_or_spill" : EvictReasonName(static_cast<EvictReason>(r));
    for (int to = 1; to < kNumTiers; ++to) {
      if (s.demotions[r][to] > 0) (*p->mutable_demotions())[reason + "->" + TierName(to)] = s.demotions[r][to];
    }
  }
  for (int from = 1; from < kNumTiers; ++from) (*p->mutable_promotions())[TierName(from)] = s.promotions[from];
  p->set_promoted_tokens(s.promoted_tokens);
  p->set_dropped(s.dropped);
  p->set_checksum_failures(s.checksum_failures);
  p->set_write_failures(s.write_failures);
  p->set_compression_ratio(s.stored_bytes_written == 0
                               ? 1.0
                               : static_cast<double>(s.raw_bytes_written) / s.stored_bytes_written);
  p->set_flushes(s.flushes);
  p->set_flush_failures(s.flush_failures);
  p->set_last_flush_durable(s.last_flush_durable);
  p->set_last_flush_seconds(s.last_flush_seconds);
  p->set_reloaded_records(s.reloaded_records);
  p->set_load_seconds(s.load_seconds);
  p->set_idle_demotion(s.idle_demotion);
  p->set_prefetch_handles(s.prefetch_handles);
  p->set_incompatible(s.incompatible);
  p->set_pending_checkpoints(s.pending_checkpoints);
  p->set_restored_checkpoints(s.restored_checkpoints);
  if (s.remote_enabled) {
    const RemoteStats& r = s.remote;
    v1::RemoteTierReport* g4 = p->mutable_remote();
    g4->set_url(s.remote_url);
    g4->set_available(r.available);
    g4->set_lookups(r.lookups);
    g4->set_hit_blocks(r.hit_blocks);
    g4->set_fetched_blocks(r.fetched_blocks);
    g4->set_uploaded_blocks(r.uploaded_blocks);
    g4->set_refreshed_blocks(r.refreshed_blocks);
    g4->set_upload_dropped(r.upload_dropped);
    g4->set_errors(r.errors);
    g4->set_skipped(r.skipped);
    g4->set_corrupt(r.corrupt);
    g4->set_last_error(r.last_error);
    g4->set_failing(r.failing);
    g4->set_calls(r.calls);
    g4->set_oom_refusals(r.oom_refusals);
    g4->set_eviction_policy(r.eviction_policy);
    g4->set_maxmemory(r.maxmemory);
  }
}

void ToProto(const CacheEvent& e, v1::CacheEvent* p) {
  p->set_sequence(e.sequence);
  p->set_kind(static_cast<v1::CacheEvent::Kind>(e.kind));
  p->set_unix_ms(absl::ToUnixMillis(e.time));
  p->set_pool(e.pool);
  p->set_adapter(e.adapter);
  if (e.kind != CacheEventKind::kCleared) p->set_block_key(KeyBytes(e.key));
  if (e.has_parent) p->set_parent_key(KeyBytes(e.parent_key));
  p->set_block(e.block);
  p->set_block_tokens(e.block_tokens);
  CopyTokens(e.tokens, p->mutable_tokens());
  p->set_medium(e.medium);
}

CacheEvent FromProto(const v1::CacheEvent& p) {
  CacheEvent e;
  e.sequence = p.sequence();
  e.kind = static_cast<CacheEventKind>(p.kind());
  e.time = absl::FromUnixMillis(p.unix_ms());
  e.pool = p.pool();
  e.adapter = p.adapter();
  e.key = KeyFromBytes(p.block_key());
  e.has_parent = !p.parent_key().empty();
  e.parent_key = KeyFromBytes(p.parent_key());
  e.block = p.block();
  e.block_tokens = p.block_tokens();
  e.medium = p.medium();
  e.tokens = TokensFromProto(p.tokens());
  return e;
}

void ToProto(PoolId id, const PoolGeometry& g, v1::PoolInfo* p) {
  p->set_pool_id(id);
  p->set_name(g.name);
  p->set_block_tokens(g.block_tokens);
  p->set_num_layers(g.num_layers);
  p->set_bytes_per_token_per_layer(g.bytes_per_token_per_layer);
  p->set_capacity_blocks(g.capacity_blocks);
  p->set_max_model_len(g.max_model_len);
  p->set_layout(g.layout == PoolLayout::kLayerMajor ? v1::LAYOUT_LAYER_MAJOR : v1::LAYOUT_BLOCK_MAJOR);
  p->set_block_bytes(g.block_bytes());
  p->set_layer_block_bytes(g.layer_block_bytes());
  p->set_dtype(g.kv.dtype);
  p->set_kv_heads(g.kv.kv_heads);
  p->set_head_dim(g.kv.head_dim);
  p->set_kv_arrangement(g.kv.arrangement);
  p->set_model_fingerprint(g.model_fingerprint);
  for (size_t j = 0; j < g.groups.size(); ++j) ToProto(g, static_cast<int>(j), p->add_groups());
  if (g.hybrid()) p->set_step_tokens(g.step_tokens_or_default());
}

void ToProto(const PoolGeometry& g, int group, v1::GroupInfo* p) {
  const KvGroup& k = g.groups[group];
  p->set_name(k.name);
  p->set_kind(KvGroupKindName(k.kind));
  for (int32_t l : k.layers) p->add_layers(l);
  p->set_window(k.window);
  p->set_chunk(k.chunk);
  p->set_checkpoint_every_blocks(k.checkpoint_every_blocks);
  p->set_bytes_per_token(k.bytes_per_token);
  p->set_bytes_per_state(k.bytes_per_state);
  p->set_capacity(k.capacity);
  p->set_first_block(k.first_block);
  p->set_region_offset_bytes(k.region_offset_bytes);
  p->set_layer_unit_bytes(g.GroupLayerUnitBytes(group));
  p->set_checkpoint_at_end(!k.attention() && k.checkpoint_at_end);
}

KvGroup GroupFromProto(const v1::GroupInfo& p) {
  KvGroup k;
  k.name = p.name().substr(0, 64);
  if (!ParseKvGroupKind(p.kind(), &k.kind)) k.kind = KvGroupKind::kFull;
  k.layers.assign(p.layers().begin(), p.layers().end());
  k.window = p.window();
  k.chunk = p.chunk();
  k.checkpoint_every_blocks = p.checkpoint_every_blocks();
  k.bytes_per_token = p.bytes_per_token();
  k.bytes_per_state = p.bytes_per_state();
  k.capacity = p.capacity();
  k.first_block = p.first_block();
  k.region_offset_bytes = p.region_offset_bytes();
  k.checkpoint_at_end = p.checkpoint_at_end();
  return k;
}

PoolGeometry GeometryFromProto(const v1::PoolInfo& p) {
  PoolGeometry g;
  g.name = p.name();
  g.block_tokens = p.block_tokens();
  g.num_layers = p.num_layers();
  g.bytes_per_token_per_layer = p.bytes_per_token_per_layer();
  g.capacity_blocks = p.capacity_blocks();
  g.max_model_len = p.max_model_len();
  g.num_shards = std::max(1, p.slabs_size());
  g.layout = p.layout() == v1::LAYOUT_BLOCK_MAJOR ? PoolLayout::kBlockMajor : PoolLayout::kLayerMajor;
  g.kv.dtype = p.dtype();
  g.kv.kv_heads = p.kv_heads();
  g.kv.head_dim = p.head_dim();
  g.kv.arrangement = p.kv_arrangement();
  g.model_fingerprint = p.model_fingerprint();
  for (const v1::GroupInfo& k : p.groups()) g.groups.push_back(GroupFromProto(k));
  g.step_tokens = p.step_tokens();
  return g;
}

}  // namespace kvd
