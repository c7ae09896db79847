// The fixture of the hybrid tier tests against the real daemon (hybrid_tiers_test.cc,
// hybrid_peek_test.cc, hybrid_remote_test.cc; docs/hybrid.md §2.9): the pool "hy" with a tiers
// section, every group's bytes of a unit written and read through the client's views, the 8
// tokens [1, 9) published with known bytes per group, and a start that reads them back.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "client/client.h"
#include "kvd/v1/kvd.pb.h"
#include "tests/integration/harness.h"

namespace kvd::testing {

inline constexpr int kRec = 2;  // the state group's index in HybridTierConfig's pool

// Pool "hy": full attention in layers 1 and 3 (32 blocks: two 63-token requests take all), a
// `window`-token window in 0 (24 blocks), recurrent state in 2 checkpointed every 2 blocks of 4
// tokens (6 slots); then "tiers:\n" and `tiers`, its indented lines. Another window is another
// grouping.
std::string HybridTierConfig(const std::string& tiers, int window = 6);

// `a` followed by `b`.
std::vector<Token> Concat(std::vector<Token> a, const std::vector<Token>& b);

// Every layer of `unit` of `group`, concatenated.
std::string UnitBytes(const client::PoolView& pool, const std::string& group, int64_t unit);
// Writes a pattern of `seed`, the layer and the offset into every layer of `unit` of `group`.
void Fill(const client::PoolView& pool, const std::string& group, int64_t unit, uint32_t seed);

// What a hit at 8 tokens must read, per group: full and window blocks 0 and 1, the state at 8.
struct Unit8 {
  std::string full[2], swa[2], rec;
};

// Publishes the 8 tokens [1, 9) of a request "writer" (then 9 tokens from 100) with every group's
// bytes and the state at 8, filled with seeds `seed` + position (full), `seed` + 10 + position
// (window) and `seed` + 20 (state); REQUIREs that the writer started with no hit and the checkpoint
// was kept. Returns the bytes.
Unit8 PublishEight(client::Client& c, uint32_t seed = 10);

// Starts `id` sharing the 8 tokens (then 9 tokens from 500); REQUIREs a hit of 0 or of 8 whose
// every group reads the bytes `u` holds (never a wrong byte), a hit of 0 restoring no state.
// Releases it and returns the hit.
int64_t ReadBack(client::Client& c, const std::string& id, const Unit8& u);

// The daemon's Report over gRPC.
v1::ReportResponse Report(const DaemonProcess& d);

}  // namespace kvd::testing
