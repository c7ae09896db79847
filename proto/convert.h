// Conversions between kvd.v1 protobuf messages and the core's C++ types, used by the server's
// handlers and by the client library alike (conversions live at the edge, in one place).
#pragma once

#include <string>
#include <vector>

#include "kvd/v1/kvd.pb.h"
#include "proto/vocab/cache_types.h"
#include "proto/vocab/cache_event.h"
#include "proto/vocab/pool_geometry.h"
#include "proto/vocab/tier_results.h"

namespace kvd {

Namespace FromProto(const v1::Namespace& p);
void ToProto(const Namespace& ns, v1::Namespace* p);
// For answers that leave the daemon toward anyone but the request's own worker: the cache salt
// becomes SaltFingerprint(salt), so salts never leave kvd (docs/security.md).
void ToProtoRedacted(const Namespace& ns, v1::Namespace* p);
// "fp:<16 hex digits>", keyed by a random per-process key; empty for an empty salt.
std::string SaltFingerprint(absl::string_view salt);

RequestSpec SpecFromProto(const v1::AdmitRequest& p);
void ToProto(const RequestSpec& spec, v1::AdmitRequest* p);

void ToProto(const AdmitResult& r, v1::AdmitResponse* p);
AdmitResult FromProto(const v1::AdmitResponse& p);

void ToProto(const AcquireResult& r, v1::AcquireResponse* p);
void ToProto(const InFlightInfo& f, v1::InFlight* p);  // the wire's view (no serial, no keys)
AcquireResult FromProto(const v1::AcquireResponse& p);
// A hybrid pool's per-group table; `group` is its index in the pool's groups (the wire names it).
void ToProto(const GroupTable& t, v1::GroupTable* p);
GroupTable FromProto(const v1::GroupTable& p, int group);
// A publish's state checkpoints (docs/hybrid.md §2.7), both ways.
std::vector<StateCheckpoint> FromProto(const google::protobuf::RepeatedPtrField<v1::StateCheckpoint>& p);
void ToProto(absl::Span<const StateCheckpoint> checkpoints, google::protobuf::RepeatedPtrField<v1::StateCheckpoint>* p);

void ToProto(const PublishResult& r, v1::PublishResponse* p);
PublishResult FromProto(const v1::PublishResponse& p);

void ToProto(const CacheReport& r, v1::ReportResponse* p);
CacheReport FromProto(const v1::ReportResponse& p);

void ToProto(const SessionInfo& s, v1::SessionInfo* p);
SessionInfo FromProto(const v1::SessionInfo& p);

void ToProto(const HandleInfo& h, v1::Handle* p);
HandleInfo FromProto(const v1::Handle& p);

void ToProto(const FlushResult& r, v1::FlushResponse* p);
void ToProto(const TierStats& s, v1::TierReport* p);

void ToProto(const CacheEvent& e, v1::CacheEvent* p);
CacheEvent FromProto(const v1::CacheEvent& p);

// Geometry of a pool as carried in ListPools (slabs are filled by the caller).
void ToProto(PoolId id, const PoolGeometry& g, v1::PoolInfo* p);
// One group of a hybrid pool, as ListPools lists it (GroupInfo).
void ToProto(const PoolGeometry& g, int group, v1::GroupInfo* p);
// A group as a worker declares or kvd lists it; an unknown kind reads as full, which then differs
// from the pool's by name or kind (the attach check compares both).
KvGroup GroupFromProto(const v1::GroupInfo& p);
PoolGeometry GeometryFromProto(const v1::PoolInfo& p);

std::vector<Token> TokensFromProto(const google::protobuf::RepeatedField<uint32_t>& p);

}  // namespace kvd
