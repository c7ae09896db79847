// Steps (kvd.proto "Step"; docs/api.md, "Steps"): the engine's scheduler writes what one step
// decided for every request it touched into a StepBatch, and Client::Step applies it in one round
// trip, or in none when every item is a growth the worker's block credit covers (kvd learns of it
// with the next step that goes out).
//
//   kvd::client::StepBatch batch;
//   batch.Start(&a, spec);                  // admission (FIFO per pool) + prefix acquire
//   batch.Grow(&b, 1);                      // decode: a credit block when b crosses a block
//   batch.End(&c, publish_blocks, more_tokens, /*completed=*/true);
//   absl::StatusOr<StepAnswer> answer = client->Step(batch);   // answer->items[i]: the i-th item
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "proto/vocab/cache_types.h"

namespace kvd::client {

struct EndResult;

// A request driven by steps. The engine owns it and keeps it at one address from its Start until
// the step that ends it (End, Preempt) has been answered; steps update it.
struct StepRequest {
  RequestId id;
  PoolId pool = 0;
  std::vector<BlockIndex> blocks;  // the block table: blocks[i] holds positions [i*bt, (i+1)*bt)
  int64_t num_tokens = 0;          // positions the table covers
  // Hybrid pools (docs/hybrid.md §2.4): one table per KV group, in the pool's group order, with
  // pool-wide indices (the group's tensors take index - first_block). A window group's blocks[i]
  // holds block position first_block_position + i; each grow drops the blocks kvd released below
  // its new first position and appends what it handed out. `blocks` is the first full group's
  // table. Empty for pools without groups.
  std::vector<GroupTable> group_tables;
  // The table of group `name`, or nullptr when the pool has no such group.
  const GroupTable* group_table(std::string_view name) const;
  bool waiting = false;            // started, not admitted yet: start it again in a later step
  // Prefixes in flight: while `waiting` for them, the blocks another request computes (unset while
  // waiting for admission); once acquired, acquired.in_flight says what the lookup stopped at and
  // in_flight_wait how the wait ended (v1::InFlightWait: 0 not waited, 1 published, 2 released,
  // 3 timed out).
  std::optional<InFlightInfo> in_flight;
  int in_flight_wait = 0;
  bool live = false;               // acquired and not ended
  AcquireResult acquired;          // what its start answered (cached_tokens, resumed state, ...)
  // A growth kvd refused after the client had placed it (credit-covered growth is told later):
  // the request may no longer be written; End or Preempt it.
  absl::Status error;
  int64_t epoch = 0;               // the client attachment it started in
  // Hybrid pools: the computed tokens kvd last heard for it (-1: unknown until a grow has gone
  // out since its start). Credit-covered growth is placed locally only once it is known.
  int64_t reported_computed = -1;
};

struct StepItemResult {
  absl::Status status;   // this item's alone
  bool waiting = false;  // a start not admitted yet (it keeps its place in the queue)
  int64_t kept = 0, already_cached = 0, duplicates = 0, no_parent = 0;  // Publish, End
  // Publish, End on a hybrid pool: one per state checkpoint offered, in order (a kept one's slot
  // was replaced in the request's state table by fresh_slots[i], -1 when none was left).
  std::vector<CheckpointOutcome> checkpoint_outcomes;
  std::vector<int64_t> fresh_slots;
};

struct StepAnswer {
  std::vector<StepItemResult> items;  // one per item of the batch, in order
  bool sent = false;                  // a round trip was made
};

class StepBatch {
 public:
  // A new request, admitted in its pool's FIFO and acquired. When the budget has no room it comes
  // back waiting and keeps its place in the queue for up to `max_wait`: start it again (same
  // request) in a later step. A start is its request's only item in a step.
  // `wait_in_flight` > 0: when another live request of the namespace is computing the prompt's next
  // blocks, the start comes back waiting with req->in_flight set, holding nothing, until that
  // request publishes them (then a hit) or ends, or the bound passes (at most 30 s): start it
  // again in later steps, as above.
  void Start(StepRequest* req, RequestSpec spec, absl::Duration max_wait = absl::Seconds(30),
             absl::Duration wait_in_flight = absl::ZeroDuration());
  // `tokens` more positions. Blocks it crosses into come from the worker's credit when it holds
  // them (appended to req->blocks at once), else from kvd in the answer.
  // Hybrid pools: always a round trip (no credit there yet); `computed_tokens` is the engine's
  // computed tokens after the step that just ran (0: unchanged since the last report). kvd then
  // releases each window group's blocks wholly below computed - (W - 1) and the answer drops them
  // from req->group_tables. INVALID_ARGUMENT, changing nothing, when it goes back below the last
  // report or past the request's tokens after the grow. Ignored on pools without groups.
  void Grow(StepRequest* req, int64_t tokens, int64_t computed_tokens = 0);
  // The first `num_blocks` table blocks, filled with KV for `tokens` (from position 0), for reuse.
  // `checkpoints`: a hybrid pool's state checkpoints (docs/hybrid.md §2.7), published after the
  // blocks; put the item before the grow that releases their window.
  void Publish(StepRequest* req, std::vector<Token> tokens, int64_t num_blocks,
               std::vector<StateCheckpoint> checkpoints = {});
  // A resumable point. `state`: on a hybrid pool, per state group the slot of req->group_tables
  // holding the state at exactly tokens.size() (docs/hybrid.md §2.9); the answer swaps each for
  // the fresh spare kvd hands out (StepItemResult::fresh_slots).
  void Checkpoint(StepRequest* req, std::vector<Token> tokens, std::string engine_state,
                  std::vector<StateCheckpoint> state = {});
  // Publishes the first `publish_blocks` blocks over the tokens kvd knows + `more_tokens`, then
  // releases the request.
  void End(StepRequest* req, int64_t publish_blocks, std::vector<Token> more_tokens, bool completed,
           std::vector<StateCheckpoint> checkpoints = {});
  // Checkpoints `tokens` (none: no checkpoint), then releases the request as interrupted; a later
  // Start with resume_from = its id continues it. `state` as Checkpoint's (no spare comes back: the
  // request ends); the resumed start answers it as the state group's checkpoint_slot.
  void Preempt(StepRequest* req, std::vector<Token> tokens, std::string engine_state,
               std::vector<StateCheckpoint> state = {});

  size_t size() const { return items_.size(); }
  void Clear() { items_.clear(); }

  enum class Kind { kStart, kGrow, kPublish, kCheckpoint, kEnd, kPreempt };
  struct Item {
    Kind kind;
    StepRequest* req;
    RequestSpec spec;           // kStart
    absl::Duration max_wait;    // kStart
    absl::Duration wait_in_flight = absl::ZeroDuration();  // kStart
    int64_t n = 0;              // kGrow: tokens; kPublish, kEnd: blocks
    int64_t computed_tokens = 0;  // kGrow
    std::vector<Token> tokens;
    std::string engine_state;
    bool completed = false;
    std::vector<StateCheckpoint> checkpoints;  // kPublish, kEnd; kCheckpoint, kPreempt: the state
  };
  const std::vector<Item>& items() const { return items_; }

 private:
  std::vector<Item> items_;
};

}  // namespace kvd::client
