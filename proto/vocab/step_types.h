// The engine's scheduler step as KvCache applies it (KvCache::Step): the operations one step
// makes on running requests, and the worker's block credit. Plain structs; no behaviour.
//
// Block credit: a worker holds a bounded set of free blocks per pool that kvd granted it. A
// request that crosses a block boundary takes the next block from that credit in the worker's
// own process, with no round trip, and the next step tells kvd (a kGrow naming the blocks). A
// credit block is owned by the worker and charged to it like a reservation: it is never cached
// content and never handed to anyone else until it is named by a kGrow or given back by name
// (CreditWant::returned). kvd never takes credit from a live worker: when it wants blocks back
// (pressure, starts waiting for budget) it stops granting and asks (CreditHeld::wanted).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "proto/vocab/cache_types.h"
#include "proto/vocab/types.h"

namespace kvd {

enum class StepOpKind {
  kGrow,        // `tokens` more positions; `credit_blocks` are the new table blocks the worker took
  kPublish,     // the first `num_blocks` table blocks, filled with KV for `token_ids`
  kCheckpoint,  // a resumable point: `token_ids`, `engine_state`
  kEnd,         // publish the first `num_blocks` over known tokens + `token_ids`, then release
  kPreempt,     // checkpoint `token_ids` (when any) with `engine_state`, then release interrupted
};
std::string StepOpKindName(StepOpKind kind);

struct StepOp {
  StepOpKind kind = StepOpKind::kGrow;
  RequestId id;
  int64_t tokens = 0;
  std::vector<BlockIndex> credit_blocks;
  // A hybrid pool's credit entries name their KV group: credit_groups[i] is credit_blocks[i]'s
  // (the same length; empty on a pool without groups). Each group's entries are appended to that
  // group's table, in order, before what kvd allocates (docs/hybrid.md §2.4).
  std::vector<int> credit_groups;
  // kGrow on a hybrid pool: the engine's computed tokens after the step that just ran (0: no
  // change). Window groups release the blocks wholly below it minus W - 1 (docs/hybrid.md §2.4).
  int64_t computed_tokens = 0;
  int64_t num_blocks = 0;
  std::vector<Token> token_ids;
  std::string engine_state;
  bool completed = false;  // kEnd
  // kPublish, kEnd on a hybrid pool: state checkpoints to publish (docs/hybrid.md §2.7).
  std::vector<StateCheckpoint> state_checkpoints;
};

struct StepOpResult {
  absl::Status status;             // this op's alone; on error nothing of it was applied
  std::vector<BlockIndex> blocks;  // kGrow: the blocks appended (credit blocks first, then fresh)
  PublishResult publish;           // kPublish, kEnd
  // kGrow on a hybrid pool: per KV group, the blocks appended and the group's first block position
  // after the grow (blocks below it were released); `blocks` is the first full group's.
  std::vector<GroupTable> group_tables;
};

// A worker's credit in one pool: what it asks to hold after the step and the blocks it gives
// back; what it holds, and how many of them kvd asks back.
// On a hybrid pool credit is per (pool, group): `group` is the KV group's index (0 on a pool
// without groups), and a block returned or held is of that group's range.
struct CreditWant {
  PoolId pool = 0;
  int64_t blocks = 0;
  std::vector<BlockIndex> returned;  // unplaced credit blocks the worker gives back
  int group = 0;
};
struct CreditHeld {
  PoolId pool = 0;
  std::vector<BlockIndex> blocks;
  int64_t wanted = 0;  // blocks kvd asks the worker to give back (by name, in a later step)
  int group = 0;
};

}  // namespace kvd
