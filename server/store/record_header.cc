#include "server/store/record_header.h"

#include <xxhash.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvd {
namespace {

constexpr uint32_t kMaxString = 1u << 20;
constexpr uint32_t kMaxTokens = 1u << 20;
constexpr uint32_t kMaxMedia = 4096;

template <typename T>
void Put(std::string* out, T v) {
  char buf[sizeof(T)];
  std::memcpy(buf, &v, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
  out->append(buf, sizeof(T));
}

void PutString(std::string* out, absl::string_view s) {
  Put<uint32_t>(out, static_cast<uint32_t>(s.size()));
  out->append(s.data(), s.size());
}

class Reader {
 public:
  explicit Reader(absl::string_view* in) : in_(in) {}
  template <typename T>
  bool Get(T* v) {
    if (in_->size() < sizeof(T)) return Fail("truncated");
    std::memcpy(v, in_->data(), sizeof(T));
    in_->remove_prefix(sizeof(T));
    return true;
  }
  bool GetString(std::string* s) {
    uint32_t n = 0;
    if (!Get(&n)) return false;
    if (n > kMaxString || n > in_->size()) return Fail("string length out of range");
    s->assign(in_->data(), n);
    in_->remove_prefix(n);
    return true;
  }
  bool Fail(const char* why) {
    if (error_.empty()) error_ = why;
    return false;
  }
  const std::string& error() const { return error_; }
  absl::string_view* in() { return in_; }

 private:
  absl::string_view* in_;
  std::string error_;
};

}  // namespace

void EncodeRecordHeader(const RecordHeader& h, std::string* out) {
  Put<uint8_t>(out, static_cast<uint8_t>(h.kind));
  PutString(out, h.ns.pool);
  PutString(out, h.ns.adapter);
  Put<uint32_t>(out, static_cast<uint32_t>(h.ns.media_keys.size()));
  for (const std::string& m : h.ns.media_keys) PutString(out, m);
  PutString(out, h.ns.method);
  PutString(out, h.ns.cache_salt);
  Put(out, h.key.hi);
  Put(out, h.key.lo);
  Put<uint8_t>(out, h.has_parent ? 1 : 0);
  Put(out, h.parent_key.hi);
  Put(out, h.parent_key.lo);
  Put<uint32_t>(out, static_cast<uint32_t>(h.tokens.size()));
  out->append(reinterpret_cast<const char*>(h.tokens.data()), h.tokens.size() * sizeof(Token));
  PutString(out, h.object_key);
  Put<uint8_t>(out, static_cast<uint8_t>(h.codec));
  Put(out, h.raw_length);
  Put(out, h.stored_length);
  Put(out, h.checksum);
  Put(out, h.offset);
  Put(out, h.layout_tag);
  if (h.kind == RecordKind::kUnit) {
    Put<uint8_t>(out, static_cast<uint8_t>(h.parts.size()));
    for (const UnitRecordPart& p : h.parts) {
      Put<uint8_t>(out, p.group);
      Put<uint8_t>(out, p.tail ? 1 : 0);
    }
  }
}

absl::StatusOr<RecordHeader> DecodeRecordHeader(absl::string_view* in) {
  Reader r(in);
  RecordHeader h;
  uint8_t kind = 0, has_parent = 0, codec = 0;
  uint32_t media = 0, ntokens = 0;
  bool ok = r.Get(&kind) && r.GetString(&h.ns.pool) && r.GetString(&h.ns.adapter) && r.Get(&media);
  if (ok && media > kMaxMedia) ok = r.Fail("too many media keys");
  for (uint32_t i = 0; ok && i < media; ++i) {
    h.ns.media_keys.emplace_back();
    ok = r.GetString(&h.ns.media_keys.back());
  }
  ok = ok && r.GetString(&h.ns.method) && r.GetString(&h.ns.cache_salt) && r.Get(&h.key.hi) &&
       r.Get(&h.key.lo) && r.Get(&has_parent) && r.Get(&h.parent_key.hi) &&
       r.Get(&h.parent_key.lo) && r.Get(&ntokens);
  if (ok && (ntokens > kMaxTokens || ntokens * sizeof(Token) > in->size())) {
    ok = r.Fail("token count out of range");
  }
  if (ok && ntokens > 0) {  // memcpy into an empty vector's null data() is undefined
    h.tokens.resize(ntokens);
    std::memcpy(h.tokens.data(), in->data(), ntokens * sizeof(Token));
    in->remove_prefix(ntokens * sizeof(Token));
  }
  ok = ok && r.GetString(&h.object_key) && r.Get(&codec) && r.Get(&h.raw_length) &&
       r.Get(&h.stored_length) && r.Get(&h.checksum) && r.Get(&h.offset) && r.Get(&h.layout_tag);
  if (ok && kind > static_cast<uint8_t>(RecordKind::kUnit)) ok = r.Fail("unknown record kind");
  if (ok && kind == static_cast<uint8_t>(RecordKind::kUnit)) {
    uint8_t nparts = 0;
    ok = r.Get(&nparts);
    if (ok && nparts > kMaxKvGroups) ok = r.Fail("too many unit parts");
    for (uint8_t i = 0; ok && i < nparts; ++i) {
      UnitRecordPart p;
      uint8_t tail = 0;
      ok = r.Get(&p.group) && r.Get(&tail);
      if (ok && (p.group >= kMaxKvGroups || tail > 1)) ok = r.Fail("bad unit part");
      p.tail = tail != 0;
      h.parts.push_back(p);
    }
  }
  if (ok && codec > static_cast<uint8_t>(Codec::kZstd)) ok = r.Fail("unknown codec");
  if (ok && (h.raw_length < 0 || h.stored_length < 0)) ok = r.Fail("negative length");
  if (!ok) return absl::DataLossError(absl::StrCat("bad record header: ", r.error()));
  h.kind = static_cast<RecordKind>(kind);
  h.has_parent = has_parent != 0;
  h.codec = static_cast<Codec>(codec);
  return h;
}

BlockKey CheckpointKey(absl::string_view request_id) {
  return ObjectKey(Namespace{}, absl::StrCat("checkpoint:", request_id));
}

uint64_t LayoutTag(const PoolGeometry& g) {
  std::string buf;
  Put<int64_t>(&buf, g.block_tokens);
  Put<int64_t>(&buf, g.num_layers);
  Put<int64_t>(&buf, g.bytes_per_token_per_layer);
  Put<int64_t>(&buf, g.num_shards);
  // Appended only when declared, so that records written before fingerprints (and by pools
  // without one) keep their tag and are still served.
  if (!g.model_fingerprint.empty()) {
    buf.append("model:");
    PutString(&buf, g.model_fingerprint);
  }
  // Hybrid pools only (others keep their tag): what fixes each group's unit bytes and which
  // checkpoints it accepts.
  if (g.hybrid()) {
    buf.append("groups:");
    for (size_t i = 0; i < g.groups.size(); ++i) {
      const KvGroup& k = g.groups[i];
      Put<int32_t>(&buf, static_cast<int32_t>(k.kind));
      Put<uint32_t>(&buf, static_cast<uint32_t>(k.layers.size()));
      for (int32_t l : k.layers) Put<int32_t>(&buf, l);
      Put<int64_t>(&buf, g.GroupLayerUnitBytes(static_cast<int>(i)));
      Put<int32_t>(&buf, k.window);
      Put<int32_t>(&buf, k.chunk);
      Put<int32_t>(&buf, k.checkpoint_every_blocks);
    }
  }
  return XXH3_64bits(buf.data(), buf.size());
}

std::string DescribeTagMismatch(const PoolGeometry& g, uint64_t record_tag) {
  PoolGeometry shape = g;
  shape.model_fingerprint.clear();
  if (g.model_fingerprint.empty()) {
    return g.hybrid() ? "its pool's layout or KV groups changed, or it was written under a model fingerprint this "
                        "pool does not declare"
                      : "its pool's layout changed, or it was written under a model fingerprint this pool does not declare";
  }
  if (record_tag == LayoutTag(shape)) {
    return absl::StrCat("it was written without a model fingerprint, and pool '", g.name, "' declares '",
                        g.model_fingerprint, "'");
  }
  return absl::StrCat("it was written under another layout or model fingerprint than pool '", g.name,
                      "' has now (model_fingerprint '", g.model_fingerprint, "')");
}

BlockKey ObjectKey(const Namespace& ns, absl::string_view object_key) {
  const BlockKey root = NamespaceRootKey(ns);
  std::string buf;
  Put(&buf, root.hi);
  Put(&buf, root.lo);
  buf.append("object:");
  buf.append(object_key.data(), object_key.size());
  const XXH128_hash_t h = XXH3_128bits(buf.data(), buf.size());
  return BlockKey{h.high64, h.low64};
}

}  // namespace kvd
