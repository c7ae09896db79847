// kvd::client::KvRequest: one acquired request of a Client (client.h), and what its calls answer.
// Include client/client.h; this header is split from it by concept.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/vocab/cache_types.h"

namespace kvd::client {

class Client;

// What End's publish did, counted.
struct EndResult {
  int64_t kept = 0;            // blocks now cached
  int64_t already_cached = 0;  // positions cached already (a prefix hit)
  int64_t duplicates = 0;      // identical blocks cached first by someone else
  int64_t no_parent = 0;       // blocks after a position this request did not cache
  std::vector<CheckpointOutcome> checkpoint_outcomes;  // one per state checkpoint offered
};

// kvd restarted while a request was live: the request is gone with the daemon's memory of it
// (ABORTED, with this payload). Start it again; a checkpoint kvd kept resumes it.
inline constexpr char kKvdRestartedPayload[] = "kvd.dev/KvdRestarted";
absl::Status KvdRestartedError(const RequestId& id);
bool IsKvdRestarted(const absl::Status& status);

// One acquired request. Destroying it unreleased releases it as interrupted (checkpoints kept).
// Every call fails with KvdRestarted once kvd has restarted since the request started.
// Not thread-safe: one engine thread drives a request.
class KvRequest {
 public:
  ~KvRequest();
  KvRequest(const KvRequest&) = delete;
  KvRequest& operator=(const KvRequest&) = delete;

  const RequestId& id() const { return id_; }
  PoolId pool() const { return state_.pool; }
  const std::vector<BlockIndex>& blocks() const { return state_.blocks; }
  // Hybrid pools (docs/hybrid.md §2.4): one table per KV group, in the pool's group order, with
  // pool-wide indices (GroupKvView::Local gives the group's tensor index). Full: blocks[i] holds
  // positions [i*bt, (i+1)*bt), the same as blocks(); sliding_window / chunked_local: blocks[i]
  // holds block position first_block_position + i (kvd released those below); state: the
  // running slot, then the spare. Empty for pools without groups.
  const std::vector<GroupTable>& group_tables() const { return state_.group_tables; }
  // The table of group `name`; nullptr when the pool has no such group (or no groups).
  const GroupTable* group_table(std::string_view name) const;
  int64_t num_tokens() const { return state_.num_tokens; }
  int64_t cached_tokens() const { return state_.cached_tokens; }
  bool resumed() const { return state_.resumed; }
  const std::vector<Token>& resumed_tokens() const { return state_.resumed_tokens; }
  const std::string& engine_state() const { return state_.engine_state; }
  // Interprocess event handles of the workers that published the reused blocks.
  const std::vector<std::string>& publisher_events() const { return state_.publisher_events; }
  // Prefixes in flight: what the lookup stopped at (blocks another request of the namespace
  // computes now; this one computes them too), none when unset. With Start's wait_in_flight: what
  // the start found before waiting, and how the wait ended (v1::InFlightWait: 0 not waited,
  // 1 published, 2 released, 3 timed out).
  const std::optional<InFlightInfo>& in_flight() const { return state_.in_flight; }
  const std::optional<InFlightInfo>& in_flight_seen() const { return in_flight_seen_; }
  int in_flight_wait() const { return in_flight_wait_; }

  // Whether this request's blocks may be written now: its attachment is the client's current one
  // and the lease is held (Client::MayWrite). A writer thread checks it before each write.
  bool MayWrite() const;
  // Client::WriteLayer into the request's block at `position` in blocks(), refused (ABORTED)
  // unless MayWrite(): never for a request of an earlier attachment.
  absl::Status WriteLayer(size_t position, int32_t layer, int64_t offset, const void* src, int64_t n,
                          uint32_t shard = 0) const;
  // Adds positions for `n` more tokens; new blocks are appended to blocks().
  // Hybrid pools: a grow step (StepBatch::Grow), which also reports `computed_tokens`, the
  // engine's computed tokens after the step that just ran (0: unchanged). kvd releases each
  // window group's blocks wholly below computed - (W - 1) and hands out window blocks up to
  // computed + step_tokens; group_tables() drop the released blocks (first_block_position moves
  // up) and gain the new ones. INVALID_ARGUMENT, changing nothing, when `computed_tokens` goes
  // back below the last report or past num_tokens() + n. Ignored on pools without groups.
  absl::Status Extend(int64_t n, int64_t computed_tokens = 0);
  // Publishes every full block covered by `tokens` (the request's tokens from position 0), and on a
  // hybrid pool `checkpoints` (slots of its state group tables, docs/hybrid.md §2.7): a kept one's
  // slot leaves the request's table for the fresh spare kvd handed out in its place. On a hit,
  // group_table(state)->checkpoint_slot is the state at cached_tokens to copy from (read-only).
  absl::StatusOr<PublishResult> Publish(absl::Span<const Token> tokens,
                                        absl::Span<const StateCheckpoint> checkpoints = {});
  // A resumable point (Start with resume_from = id() continues it). On a hybrid pool `state` names
  // per state group the slot of group_tables() holding the state at exactly tokens.size(): it
  // leaves the table for the fresh spare kvd hands out. A resume answers it as the state group's
  // checkpoint_slot, to copy into the running slot before computing (as after a hit).
  absl::Status Checkpoint(absl::Span<const Token> tokens, const std::string& engine_state,
                          absl::Span<const StateCheckpoint> state = {});
  absl::Status Release(bool completed);
  // Publishes the first `publish_blocks` blocks and releases, in one round trip: the daemon has
  // the prompt already; `more_tokens` are generated tokens past it that those blocks cover.
  absl::StatusOr<EndResult> End(int64_t publish_blocks, absl::Span<const Token> more_tokens,
                                bool completed, absl::Span<const StateCheckpoint> checkpoints = {});

 private:
  friend class Client;
  KvRequest(Client* client, RequestId id, AcquireResult state, int32_t block_tokens, int64_t epoch)
      : client_(client), id_(std::move(id)), state_(std::move(state)), block_tokens_(block_tokens),
        epoch_(epoch) {}
  absl::Status Check() const;  // released, or lost with a kvd restart
  absl::Status ExtendGroups(int64_t n, int64_t computed_tokens);  // Extend on a hybrid pool: a step

  Client* client_;
  RequestId id_;
  AcquireResult state_;
  std::optional<InFlightInfo> in_flight_seen_;
  int in_flight_wait_ = 0;
  int32_t block_tokens_;
  int64_t epoch_;  // the client's attachment this request belongs to
  bool released_ = false;
};

}  // namespace kvd::client
