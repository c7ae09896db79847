#include "server/events/router_event_encoding.h"

#include <cstring>
#include <string_view>

#include <msgpack.hpp>

namespace kvd {

std::string RouterSpecKind(const std::string& kvd_kind) {
  if (kvd_kind == "full") return "full_attention";
  if (kvd_kind == "sliding_window") return "sliding_window";
  if (kvd_kind == "chunked_local") return "chunked_local_attention";
  if (kvd_kind == "state") return "mamba";
  return "";
}

std::string EncodeRouterBatch(double ts, const std::vector<RouterEvent>& events, int64_t data_parallel_rank,
                              bool map) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  const auto key = [&](std::string_view k) {
    if (map) pk.pack(k);
  };
  const auto pack_opt_string = [&](const std::string& s) {
    if (s.empty()) {
      pk.pack_nil();
    } else {
      pk.pack(s);
    }
  };
  // A struct of `fields` fields: an array led by its tag, or a map with the tag under "type".
  const auto open = [&](uint32_t fields, std::string_view tag) {
    if (map) {
      pk.pack_map(fields);
      pk.pack(std::string_view("type"));
    } else {
      pk.pack_array(fields);
    }
    pk.pack(tag);
  };
  if (map) {
    pk.pack_map(3);
  } else {
    pk.pack_array(3);
  }
  key("ts");
  // Always a float64, as msgspec writes a float: msgpack-cxx's pack_double writes an integral
  // value as an integer, which a decoder typed for a float may refuse.
  {
    uint64_t bits = 0;
    std::memcpy(&bits, &ts, sizeof(bits));
    char raw[9];
    raw[0] = static_cast<char>(0xcb);
    for (int i = 0; i < 8; ++i) raw[1 + i] = static_cast<char>((bits >> (8 * (7 - i))) & 0xff);
    buf.write(raw, sizeof(raw));
  }
  key("events");
  pk.pack_array(static_cast<uint32_t>(events.size()));
  for (const RouterEvent& ev : events) {
    switch (ev.kind) {
      case CacheEventKind::kStored: {
        const RouterEventGroup* g = ev.group.has_value() ? &*ev.group : nullptr;
        // Arrays carry every field up to the last one written; maps leave out defaults
        // (extra_keys, and a window the group does not have).
        uint32_t fields = 8;
        if (g != nullptr) fields = map ? 10 + (g->sliding_window > 0 ? 1 : 0) : 12;
        open(fields, "BlockStored");
        key("block_hashes");
        pk.pack(ev.ids);
        key("parent_block_hash");
        if (ev.has_parent) {
          pk.pack_uint64(ev.parent_id);
        } else {
          pk.pack_nil();
        }
        key("token_ids");
        pk.pack(ev.tokens);
        key("block_size");
        pk.pack_int32(ev.block_size);
        key("lora_id");
        pk.pack_nil();  // kvd names adapters (lora_name); it has no integer ids
        key("medium");
        pk.pack(ev.medium);
        key("lora_name");
        pack_opt_string(ev.lora_name);
        if (g != nullptr) {
          if (!map) pk.pack_nil();  // extra_keys: kvd's are already hashed into the ids
          key("group_idx");
          pk.pack_int32(g->index);
          key("kv_cache_spec_kind");
          pk.pack(g->kind);
          if (g->sliding_window > 0) {
            key("kv_cache_spec_sliding_window");
            pk.pack_int32(g->sliding_window);
          } else if (!map) {
            pk.pack_nil();
          }
        }
        break;
      }
      case CacheEventKind::kRemoved:
        open(ev.group.has_value() ? 4 : 3, "BlockRemoved");
        key("block_hashes");
        pk.pack(ev.ids);
        key("medium");
        pk.pack(ev.medium);
        if (ev.group.has_value()) {
          key("group_idx");
          pk.pack_int32(ev.group->index);
        }
        break;
      case CacheEventKind::kCleared:
        open(1, "AllBlocksCleared");
        break;
    }
  }
  key("data_parallel_rank");
  pk.pack_int64(data_parallel_rank);
  return std::string(buf.data(), buf.size());
}

}  // namespace kvd
