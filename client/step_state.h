// The client's step state (client_step.cc; client/step.h): not installed, part of Client::Impl.
//
// mu guards the sequence number, the credit and the growth held back (all of the attachment
// `epoch`), and the reporter: a thread that tells kvd of held growth and refills credit while the
// engine computes. A step the engine waits for is sent with mu held and no report in flight
// (steps apply in seq order). A submitted step (Client::StepSubmit) is sent by the reporter
// thread too, after any report; nothing else goes out until the engine takes its answer
// (StepFuture::Get), which applies it on the engine's thread. Never held across a round trip
// except the one of a step the engine waits for.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/step.h"
#include "kvd/v1/kvd.pb.h"

namespace kvd::client {

// The table of group `name` in `tables`, or nullptr.
const GroupTable* FindGroupTable(const std::vector<GroupTable>& tables, std::string_view name);
// Applies a hybrid pool's grow answer to a request's per-group tables: each group drops its
// blocks below the answer's first_block_position and appends the answer's blocks. INTERNAL,
// changing nothing, when the answer does not match the tables (another group count or order, a
// first position going back).
absl::Status ApplyGroupGrow(const v1::StepResult& r, std::vector<GroupTable>* tables);

struct StepState {
  struct HeldGrowth {
    StepRequest* req;
    int64_t tokens = 0;
    std::vector<BlockIndex> credit_blocks;
    // Hybrid pools: the group of each credit block (same length), and the computed tokens the
    // grow reports. A hybrid request's grows are held one item each, never merged (each grow's
    // window follows its own computed tokens).
    std::vector<int> credit_groups;
    int64_t computed_tokens = 0;
  };
  // Credit is per (pool, KV group); a pool without groups is group 0.
  using CreditKey = std::pair<PoolId, int>;
  absl::Mutex mu;
  absl::CondVar cv;  // a report finished
  int64_t epoch ABSL_GUARDED_BY(mu) = 0;
  uint64_t seq ABSL_GUARDED_BY(mu) = 0;
  absl::flat_hash_map<CreditKey, std::vector<BlockIndex>> credit ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<CreditKey, int64_t> peak_need ABSL_GUARDED_BY(mu);  // most blocks one step took
  // Blocks kvd asked back (StepCredit.wanted) that the next step that goes out returns by name.
  absl::flat_hash_map<CreditKey, int64_t> wanted ABSL_GUARDED_BY(mu);
  std::vector<HeldGrowth> held ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<const StepRequest*, size_t> held_index ABSL_GUARDED_BY(mu);  // into `held`
  bool reporting ABSL_GUARDED_BY(mu) = false;  // a report is queued or in flight
  bool stop_reporter ABSL_GUARDED_BY(mu) = false;
  std::unique_ptr<v1::StepRequest> report ABSL_GUARDED_BY(mu);  // queued for the reporter
  std::vector<HeldGrowth> reported ABSL_GUARDED_BY(mu);         // the held growth it carries
  std::vector<std::pair<StepRequest*, absl::Status>> report_errors ABSL_GUARDED_BY(mu);  // refused growth
  // A submitted step: queued for the reporter (`submit`, owned by its StepFuture), then its answer;
  // `submitted` from StepSubmit until StepFuture::Get took the answer.
  bool submitted ABSL_GUARDED_BY(mu) = false;
  const v1::StepRequest* submit ABSL_GUARDED_BY(mu) = nullptr;
  int64_t submit_epoch ABSL_GUARDED_BY(mu) = 0;
  std::optional<absl::StatusOr<v1::StepResponse>> submit_answer ABSL_GUARDED_BY(mu);
  std::thread reporter;
};

// A step between its two halves (client_step.cc): what PrepareStep decided and built, for
// FinishStep to apply kvd's answer to.
struct PendingStep {
  StepBatch* batch = nullptr;
  int64_t epoch = 0;
  StepAnswer answer;
  v1::StepRequest req;
  std::vector<StepState::HeldGrowth> sent_held;  // its first items
  std::vector<size_t> sent_item;                 // item sent_held.size() + k -> batch item
};

}  // namespace kvd::client
