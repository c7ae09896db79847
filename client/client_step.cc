// Client::Step: one scheduler step in one round trip, or none (client/step.h).
//
// Growth covered by the worker's credit is applied here at once and held back (one item per
// request). It goes out at the head of the next step the engine waits for (one with any other
// item, or growth that credit does not cover), or, when credit falls below half of what the client
// asks for, in a report the reporter thread sends while the engine computes: the engine's step
// then makes no round trip at all. Steps apply in sequence order: a step the engine waits for
// first waits for a report in flight. The credit the client holds is what kvd's latest answer
// listed, less the blocks held growth has taken since that step went out. A step that fails as a
// whole is sent again with the same sequence number (kvd answers a repeat from its record, without
// applying it twice) while the attachment lasts.
//
// Credit is never taken from under the engine: kvd asks for blocks back (StepCredit.wanted) and
// the next step that goes out names that many unplaced ones (CreditWant.returned), taken off the
// list before it is sent. A step whose outcome the client never learned (its retries failed)
// drops the whole credit list: nothing is placed from it until an answer lists the credit again.
#include "client/client.h"
#include "client/client_impl.h"

#include "absl/container/flat_hash_set.h"

namespace kvd::client {
namespace {

void CopyStatus(const v1::StepResult& r, absl::Status* out) {
  *out = r.code() == 0 ? absl::OkStatus() : absl::Status(static_cast<absl::StatusCode>(r.code()), r.message());
}

}  // namespace

void StepBatch::Start(StepRequest* req, RequestSpec spec, absl::Duration max_wait, absl::Duration wait_in_flight) {
  items_.push_back(Item{Kind::kStart, req, std::move(spec), max_wait});
  items_.back().wait_in_flight = wait_in_flight;
}
void StepBatch::Grow(StepRequest* req, int64_t tokens, int64_t computed_tokens) {
  Item item{Kind::kGrow, req};
  item.n = tokens;
  item.computed_tokens = computed_tokens;
  items_.push_back(std::move(item));
}
void StepBatch::Publish(StepRequest* req, std::vector<Token> tokens, int64_t num_blocks,
                        std::vector<StateCheckpoint> checkpoints) {
  Item item{Kind::kPublish, req};
  item.n = num_blocks;
  item.tokens = std::move(tokens);
  item.checkpoints = std::move(checkpoints);
  items_.push_back(std::move(item));
}
void StepBatch::Checkpoint(StepRequest* req, std::vector<Token> tokens, std::string engine_state,
                           std::vector<StateCheckpoint> state) {
  Item item{Kind::kCheckpoint, req};
  item.tokens = std::move(tokens);
  item.engine_state = std::move(engine_state);
  item.checkpoints = std::move(state);
  items_.push_back(std::move(item));
}
void StepBatch::End(StepRequest* req, int64_t publish_blocks, std::vector<Token> more_tokens, bool completed,
                    std::vector<StateCheckpoint> checkpoints) {
  Item item{Kind::kEnd, req};
  item.n = publish_blocks;
  item.tokens = std::move(more_tokens);
  item.completed = completed;
  item.checkpoints = std::move(checkpoints);
  items_.push_back(std::move(item));
}
void StepBatch::Preempt(StepRequest* req, std::vector<Token> tokens, std::string engine_state,
                        std::vector<StateCheckpoint> state) {
  Item item{Kind::kPreempt, req};
  item.tokens = std::move(tokens);
  item.engine_state = std::move(engine_state);
  item.checkpoints = std::move(state);
  items_.push_back(std::move(item));
}

const GroupTable* FindGroupTable(const std::vector<GroupTable>& tables, std::string_view name) {
  for (const GroupTable& t : tables) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

const GroupTable* StepRequest::group_table(std::string_view name) const { return FindGroupTable(group_tables, name); }

absl::Status ApplyGroupGrow(const v1::StepResult& r, std::vector<GroupTable>* tables) {
  if (static_cast<size_t>(r.group_tables_size()) != tables->size()) {
    return absl::InternalError(absl::StrCat("kvd answered a grow with ", r.group_tables_size(),
                                            " group tables for a request holding ", tables->size()));
  }
  for (int g = 0; g < r.group_tables_size(); ++g) {
    const v1::GroupTable& delta = r.group_tables(g);
    GroupTable& t = (*tables)[g];
    if (delta.group() != t.name || delta.first_block_position() < t.first_block_position) {
      return absl::InternalError(absl::StrCat("kvd answered group '", delta.group(), "' first position ",
                                              delta.first_block_position(), " for group '", t.name, "' at ",
                                              t.first_block_position));
    }
  }
  for (int g = 0; g < r.group_tables_size(); ++g) {
    const v1::GroupTable& delta = r.group_tables(g);
    GroupTable& t = (*tables)[g];
    // kvd released the blocks below the new first position (freed, or cached when published).
    const int64_t drop = std::min<int64_t>(delta.first_block_position() - t.first_block_position,
                                           static_cast<int64_t>(t.blocks.size()));
    t.blocks.erase(t.blocks.begin(), t.blocks.begin() + drop);
    t.first_block_position = delta.first_block_position();
    t.blocks.insert(t.blocks.end(), delta.blocks().begin(), delta.blocks().end());
  }
  return absl::OkStatus();
}

absl::Status KvRequest::ExtendGroups(int64_t n, int64_t computed_tokens) {
  StepRequest r;
  r.id = id_;
  r.pool = state_.pool;
  r.live = true;
  r.epoch = epoch_;
  r.num_tokens = state_.num_tokens;
  r.blocks = std::move(state_.blocks);
  r.group_tables = std::move(state_.group_tables);
  StepBatch batch;
  batch.Grow(&r, n, computed_tokens);
  absl::StatusOr<StepAnswer> answer = client_->Step(batch);
  state_.blocks = std::move(r.blocks);
  state_.group_tables = std::move(r.group_tables);
  state_.num_tokens = r.num_tokens;
  KVD_RETURN_IF_ERROR(client_->LostIfRestarted(answer.status(), epoch_, id_));
  return client_->LostIfRestarted(answer->items[0].status, epoch_, id_);
}

int64_t Client::StepCredit(PoolId pool) const {
  absl::MutexLock lock(&impl_->steps.mu);
  int64_t n = 0;  // every group's
  for (const auto& [key, blocks] : impl_->steps.credit) n += key.first == pool ? static_cast<int64_t>(blocks.size()) : 0;
  return n;
}

std::vector<BlockIndex> Client::StepCreditBlocks(PoolId pool) const { return StepCreditBlocks(pool, 0); }

std::vector<BlockIndex> Client::StepCreditBlocks(PoolId pool, int group) const {
  absl::MutexLock lock(&impl_->steps.mu);
  auto it = impl_->steps.credit.find(StepState::CreditKey{pool, group});
  return it == impl_->steps.credit.end() ? std::vector<BlockIndex>{} : it->second;
}

absl::Status Client::FlushSteps() {
  StepBatch empty;
  {
    absl::MutexLock lock(&impl_->steps.mu);
    if (impl_->steps.held.empty() && !impl_->steps.reporting) return absl::OkStatus();
  }
  return Step(empty).status();
}

namespace {

// Sends `req`; a failure as a whole is retried with the same seq while the attachment lasts.
absl::StatusOr<v1::StepResponse> SendStep(Client::Impl& im, const v1::StepRequest& req, int64_t epoch,
                                          absl::Duration timeout) {
  absl::StatusOr<v1::StepResponse> resp;
  for (int attempt = 0; attempt < 3; ++attempt) {
    resp = im.Call<v1::StepResponse>([&](auto* ctx, auto* out) { return im.stub()->Step(ctx, req, out); }, timeout);
    if (resp.ok() || !absl::IsUnavailable(resp.status()) || im.Epoch() != epoch) break;
    absl::SleepFor(absl::Milliseconds(50 << attempt));
  }
  if (resp.ok() && resp->results_size() != req.items_size()) {
    return absl::InternalError(
        absl::StrCat("kvd answered ", resp->results_size(), " results for ", req.items_size(), " items"));
  }
  return resp;
}

// One grow item per held growth, in order (a request the credit covered is told this way).
void AddGrowItems(const std::vector<StepState::HeldGrowth>& held, v1::StepRequest* req) {
  for (const StepState::HeldGrowth& h : held) {
    v1::StepItem* p = req->add_items();
    p->set_request_id(h.req->id.value());
    p->mutable_grow()->set_tokens(h.tokens);
    p->mutable_grow()->set_computed_tokens(h.computed_tokens);
    if (h.credit_groups.empty()) {
      p->mutable_grow()->mutable_credit_blocks()->Add(h.credit_blocks.begin(), h.credit_blocks.end());
      continue;
    }
    for (size_t k = 0; k < h.credit_blocks.size(); ++k) {  // a hybrid pool's {group, block} entries
      v1::CreditEntry* e = p->mutable_grow()->add_credit();
      e->set_group(h.credit_groups[k]);
      e->set_block(h.credit_blocks[k]);
    }
  }
}

// Moves the held growth into `req` (items first) and returns it.
std::vector<StepState::HeldGrowth> TakeHeld(Client::Impl& im, v1::StepRequest* req)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(im.steps.mu) {
  AddGrowItems(im.steps.held, req);
  im.steps.held_index.clear();
  return std::exchange(im.steps.held, {});
}

// What kvd answered for held growth (a refusal makes its request unusable), and the credit.
// Refusals go to `errors` (the engine's thread moves them into its requests: ReportErrors).
void ApplyHeld(Client::Impl& im, const std::vector<StepState::HeldGrowth>& sent, const v1::StepResponse& resp,
               std::vector<std::pair<StepRequest*, absl::Status>>* errors) ABSL_EXCLUSIVE_LOCKS_REQUIRED(im.steps.mu) {
  for (size_t k = 0; k < sent.size(); ++k) {
    absl::Status s;
    CopyStatus(resp.results(static_cast<int>(k)), &s);
    if (!s.ok()) errors->emplace_back(sent[k].req, std::move(s));
  }
  absl::flat_hash_set<BlockIndex> taken;  // by growth held since this step went out
  for (const StepState::HeldGrowth& h : im.steps.held) taken.insert(h.credit_blocks.begin(), h.credit_blocks.end());
  for (auto& [pool, blocks] : im.steps.credit) blocks.clear();
  im.steps.wanted.clear();
  for (const v1::StepCredit& c : resp.credit()) {
    const StepState::CreditKey key{c.pool_id(), c.group()};
    std::vector<BlockIndex>& mine = im.steps.credit[key];
    for (uint32_t b : c.blocks()) {
      if (!taken.contains(b)) mine.push_back(b);
    }
    if (c.wanted() > 0) im.steps.wanted[key] = c.wanted();
  }
}

// A hybrid request's grow to `n` positions, `c` computed, as kvd applies it (docs/hybrid.md §2.4;
// KvCache::HeldRange): per group the new first block position, the blocks dropped below it and
// the blocks appended. False when only kvd can apply it: a state group short of a slot (after a
// hit; kvd settles it), or tables that do not match the pool's groups.
struct GroupGrowPlan {
  std::vector<int64_t> lo, drop, add;
};
bool PlanGroupGrow(const PoolGeometry& g, const StepRequest& r, int64_t n, int64_t c, GroupGrowPlan* plan) {
  const size_t num_groups = g.groups.size();
  if (r.group_tables.size() != num_groups) return false;
  const int64_t bt = g.block_tokens;
  const auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const int64_t horizon = ceil_div(std::min<int64_t>(n, c + g.step_tokens_or_default()), bt);
  plan->lo.assign(num_groups, 0);
  plan->drop.assign(num_groups, 0);
  plan->add.assign(num_groups, 0);
  for (size_t i = 0; i < num_groups; ++i) {
    const KvGroup& k = g.groups[i];
    const GroupTable& t = r.group_tables[i];
    const int64_t first = t.first_block_position;
    const int64_t end = first + static_cast<int64_t>(t.blocks.size());
    int64_t lo = 0, hi = 0;
    switch (k.kind) {
      case KvGroupKind::kFull: hi = ceil_div(n, bt); break;
      case KvGroupKind::kSlidingWindow:
        lo = std::min<int64_t>(std::max<int64_t>(0, c - (k.window - 1)) / bt, horizon);
        hi = horizon;
        break;
      case KvGroupKind::kChunkedLocal:
        lo = std::min<int64_t>((c / k.chunk) * k.chunk / bt, horizon);
        hi = horizon;
        break;
      case KvGroupKind::kState:
        if (t.blocks.size() < 2) return false;  // a hit's checkpoint stands for its spare
        lo = first;
        hi = end;
        break;
    }
    lo = std::max(lo, first);
    plan->lo[i] = lo;
    plan->drop[i] = std::min(lo, end) - first;
    plan->add[i] = std::max<int64_t>(0, hi - std::max(end, lo));
  }
  return true;
}

// A step's outcome is unknown: the credit list may name blocks kvd no longer counts as this
// worker's (a return it applied), so none is placed until an answer lists the credit again.
void DropCredit(Client::Impl& im) ABSL_EXCLUSIVE_LOCKS_REQUIRED(im.steps.mu) {
  im.steps.credit.clear();
  im.steps.wanted.clear();
}

absl::Status SubmittedNotTaken() {
  return absl::FailedPreconditionError("a submitted step's answer has not been taken (StepFuture::Get)");
}

}  // namespace

void Client::Impl::Report() {
  absl::MutexLock lock(&steps.mu);
  for (;;) {
    steps.mu.Await(absl::Condition(
        +[](StepState* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
          return s->stop_reporter || s->report != nullptr || s->submit != nullptr;
        },
        &steps));
    if (steps.stop_reporter) return;
    if (steps.submit != nullptr) {  // a submitted step: its answer is the engine's to apply (StepFuture::Get)
      const v1::StepRequest* req = std::exchange(steps.submit, nullptr);
      const int64_t epoch = steps.submit_epoch;
      steps.mu.Unlock();
      absl::StatusOr<v1::StepResponse> resp = SendStep(*this, *req, epoch, absl::Seconds(30));
      steps.mu.Lock();
      steps.submit_answer = std::move(resp);
      continue;
    }
    std::unique_ptr<v1::StepRequest> req = std::move(steps.report);
    std::vector<StepState::HeldGrowth> items = std::exchange(steps.reported, {});
    const int64_t epoch = steps.epoch;
    steps.mu.Unlock();
    AddGrowItems(items, req.get());  // built here, not on the engine's thread
    absl::StatusOr<v1::StepResponse> resp = SendStep(*this, *req, epoch, absl::Seconds(10));
    steps.mu.Lock();
    if (epoch == steps.epoch) {
      if (resp.ok()) {
        ApplyHeld(*this, items, *resp, &steps.report_errors);
      } else {
        // Unknown whether kvd applied it: the requests it named can no longer be trusted, and the
        // credit is re-synced from the next answer.
        for (const StepState::HeldGrowth& h : items) steps.report_errors.emplace_back(h.req, resp.status());
        DropCredit(*this);
      }
    }
    steps.reporting = false;
    steps.cv.SignalAll();
  }
}

namespace {

// The first half of a step, with im.steps.mu held: credit-covered growth placed, the answer of
// every item that needs no round trip filled in, and the request to send built (held growth
// first, then the batch) with its credit asks. False when nothing needs a round trip (a report may
// have been queued for the reporter); an error when the writes a publish names failed.
absl::StatusOr<bool> PrepareStep(Client& client, Client::Impl& im, StepBatch& batch, PendingStep* p)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(im.steps.mu) {
  p->batch = &batch;
  // What the reporter learned reaches the engine's requests on the engine's thread.
  auto take_errors = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(im.steps.mu) {
    for (auto& [req, status] : im.steps.report_errors) req->error = std::move(status);
    im.steps.report_errors.clear();
  };
  auto wait_report = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(im.steps.mu) {
    while (im.steps.reporting) im.steps.cv.Wait(&im.steps.mu);
    take_errors();
  };
  take_errors();
  const int64_t epoch = p->epoch = im.Epoch();
  if (epoch != im.steps.epoch) {  // a new attachment: credit and held growth went with the old one
    wait_report();
    im.steps.epoch = epoch;
    im.steps.seq = 0;
    im.steps.credit.clear();
    im.steps.held.clear();
    im.steps.held_index.clear();
    im.steps.peak_need.clear();
    im.steps.wanted.clear();
  }
  const std::vector<PoolView>& views = client.pools();
  const auto& items = batch.items();
  StepAnswer& answer = p->answer;
  answer.items.resize(items.size());
  std::vector<bool> send(items.size(), false);
  bool must_send = false, publishes = false;
  absl::flat_hash_map<StepState::CreditKey, bool> pools_used;  // per (pool, group)
  absl::flat_hash_map<StepState::CreditKey, int64_t> need;     // blocks this step's growth takes
  // A pool's credit keys: group 0, or a hybrid pool's attention groups (state slots come from kvd).
  const auto use_pool = [&](PoolId pool) {
    const PoolGeometry& geo = views[pool].geometry;
    if (!geo.hybrid()) pools_used[{pool, 0}] = true;
    for (size_t k = 0; k < geo.groups.size(); ++k) {
      if (geo.groups[k].attention()) pools_used[{pool, static_cast<int>(k)}] = true;
    }
  };
  absl::flat_hash_set<const StepRequest*> sent_reqs;  // a request with an item kvd applies first
  for (size_t i = 0; i < items.size(); ++i) {
    const StepBatch::Item& item = items[i];
    StepRequest* r = item.req;
    if (item.kind == StepBatch::Kind::kStart) {
      absl::StatusOr<const PoolView*> pool = client.FindPool(item.spec.ns.pool);
      if (!pool.ok()) {
        answer.items[i].status = pool.status();
        continue;
      }
      use_pool((*pool)->id);
      send[i] = must_send = true;
      continue;
    }
    const bool withdraw = r->waiting && (item.kind == StepBatch::Kind::kEnd || item.kind == StepBatch::Kind::kPreempt);
    if (r->epoch != epoch || (!r->live && !withdraw)) {
      answer.items[i].status = r->live ? KvdRestartedError(r->id)
                                       : absl::FailedPreconditionError(absl::StrCat(
                                             "request '", r->id.value(), "' is not live in this client"));
      continue;
    }
    if (!r->error.ok() && !withdraw && item.kind != StepBatch::Kind::kEnd && item.kind != StepBatch::Kind::kPreempt) {
      answer.items[i].status = r->error;  // kvd refused growth placed earlier: only End or Preempt
      continue;
    }
    if (withdraw) {
      send[i] = must_send = true;
      sent_reqs.insert(r);
      continue;
    }
    const PoolGeometry& g = views[r->pool].geometry;
    use_pool(r->pool);
    if (item.kind != StepBatch::Kind::kGrow) {
      send[i] = must_send = true;
      sent_reqs.insert(r);
      publishes |= item.kind != StepBatch::Kind::kEnd || item.n != 0;
      continue;
    }
    if (item.n < 0 || item.n > g.max_model_len - r->num_tokens) {
      send[i] = must_send = true;  // kvd names what is wrong
      sent_reqs.insert(r);
      continue;
    }
    if (g.hybrid()) {
      // Placed from each group's credit when kvd's last word on the request is known and every
      // group's growth is covered (docs/hybrid.md §2.4); else kvd applies it in the answer.
      const int64_t n = r->num_tokens + item.n, c = item.computed_tokens;
      GroupGrowPlan plan;
      bool local = !sent_reqs.contains(r) && r->reported_computed >= 0 && c >= r->reported_computed && c > 0 &&
                   c <= n && PlanGroupGrow(g, *r, n, c, &plan);
      for (size_t k = 0; local && k < plan.add.size(); ++k) {
        if (plan.add[k] == 0) continue;
        const StepState::CreditKey key{r->pool, static_cast<int>(k)};
        need[key] += plan.add[k];
        if (plan.add[k] > static_cast<int64_t>(im.steps.credit[key].size()) && im.steps.reporting) wait_report();
        local = plan.add[k] <= static_cast<int64_t>(im.steps.credit[key].size());
      }
      if (!local) {
        send[i] = must_send = true;
        sent_reqs.insert(r);
        continue;
      }
      StepState::HeldGrowth h{r, item.n};  // one held item per grow: each has its own window
      h.computed_tokens = c;
      int spine = -1;  // `blocks` is the first full group's table
      for (size_t k = 0; k < g.groups.size() && spine < 0; ++k) {
        if (g.groups[k].kind == KvGroupKind::kFull) spine = static_cast<int>(k);
      }
      for (size_t k = 0; k < plan.add.size(); ++k) {
        GroupTable& t = r->group_tables[k];
        t.blocks.erase(t.blocks.begin(), t.blocks.begin() + plan.drop[k]);
        t.first_block_position = plan.lo[k];
        std::vector<BlockIndex>& credit = im.steps.credit[{r->pool, static_cast<int>(k)}];
        for (int64_t j = 0; j < plan.add[k]; ++j) {
          h.credit_blocks.push_back(credit.back());
          h.credit_groups.push_back(static_cast<int>(k));
          t.blocks.push_back(credit.back());
          if (static_cast<int>(k) == spine) r->blocks.push_back(credit.back());
          credit.pop_back();
        }
      }
      im.steps.held.push_back(std::move(h));
      r->num_tokens = n;
      r->reported_computed = c;
      continue;
    }
    const int64_t needed =
        std::max<int64_t>(0, g.BlocksFor(r->num_tokens + item.n) - static_cast<int64_t>(r->blocks.size()));
    const StepState::CreditKey key{r->pool, 0};
    need[key] += needed;
    std::vector<BlockIndex>* credit = &im.steps.credit[key];
    if (needed > static_cast<int64_t>(credit->size()) && im.steps.reporting) {
      wait_report();  // a refill is on its way
      credit = &im.steps.credit[key];
    }
    if (needed > static_cast<int64_t>(credit->size())) {
      send[i] = must_send = true;  // kvd allocates every block it needs, in the answer
      sent_reqs.insert(r);
      continue;
    }
    // Covered: placed here at once, told later. One held item per request.
    auto [slot, added] = im.steps.held_index.try_emplace(r, im.steps.held.size());
    if (added) im.steps.held.push_back(StepState::HeldGrowth{r});
    StepState::HeldGrowth& h = im.steps.held[slot->second];
    h.tokens += item.n;
    for (int64_t k = 0; k < needed; ++k) {
      h.credit_blocks.push_back(credit->back());
      r->blocks.push_back(credit->back());
      credit->pop_back();
    }
    r->num_tokens += item.n;
  }
  // Credit asked for: the configured amount, or twice the most one step's growth took (a batch
  // whose requests cross a block together takes one block each at once).
  for (const auto& [key, n] : need) im.steps.peak_need[key] = std::max(im.steps.peak_need[key], n);
  auto want = [&](const StepState::CreditKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(im.steps.mu) {
    return im.options.step_credit_blocks <= 0 ? 0 : std::max(im.options.step_credit_blocks, 2 * im.steps.peak_need[key]);
  };
  bool low = !im.steps.wanted.empty();  // kvd asked for blocks back: tell it soon
  for (const auto& [pool, used] : pools_used) {
    low |= static_cast<int64_t>(im.steps.credit[pool].size()) < want(pool) / 2;
  }
  // The credit asked for, and the blocks kvd asked back, returned by name: off the list first,
  // so that nothing places them while the step is in flight.
  auto add_credit = [&](v1::StepRequest* req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(im.steps.mu) {
    for (const auto& [pool, n] : im.steps.wanted) pools_used.try_emplace(pool, false);
    for (const auto& [pool, used] : pools_used) {
      auto owed = im.steps.wanted.find(pool);
      if (im.options.step_credit_blocks <= 0 && owed == im.steps.wanted.end()) continue;
      v1::CreditWant* c = req->add_credit();
      c->set_pool(views[pool.first].geometry.name);
      c->set_group(pool.second);  // 0 (not on the wire) on a pool without groups
      c->set_blocks(want(pool));
      if (owed == im.steps.wanted.end()) continue;
      std::vector<BlockIndex>& mine = im.steps.credit[pool];
      for (int64_t k = 0; k < owed->second && !mine.empty(); ++k) {
        c->add_returned(mine.back());
        mine.pop_back();
      }
    }
    im.steps.wanted.clear();
  };
  if (!must_send) {
    if (low && !im.steps.reporting) {  // tell kvd and refill while the engine computes
      auto req = std::make_unique<v1::StepRequest>();
      req->set_worker_id(im.Worker().value());
      req->set_seq(++im.steps.seq);
      im.steps.reported = std::exchange(im.steps.held, {});  // the reporter builds their items
      im.steps.held_index.clear();
      add_credit(req.get());
      im.steps.report = std::move(req);
      im.steps.reporting = true;
      if (!im.steps.reporter.joinable()) im.steps.reporter = std::thread([&im] { im.Report(); });
    }
    return false;
  }

  // The step the engine waits for: held growth first (in the order it happened), then the batch.
  wait_report();
  v1::StepRequest& req = p->req;
  req.set_worker_id(im.Worker().value());
  req.set_seq(++im.steps.seq);
  p->sent_held = TakeHeld(im, &req);
  std::vector<size_t>& sent_item = p->sent_item;  // proto item sent_held.size() + k -> batch item
  for (size_t i = 0; i < items.size(); ++i) {
    if (!send[i]) continue;
    const StepBatch::Item& item = items[i];
    v1::StepItem* p = req.add_items();
    p->set_request_id(item.kind == StepBatch::Kind::kStart ? item.spec.id.value() : item.req->id.value());
    switch (item.kind) {
      case StepBatch::Kind::kStart: {
        RequestSpec spec = item.spec;
        spec.owner = im.Worker();
        ToProto(spec, p->mutable_start()->mutable_admit());
        p->mutable_start()->set_max_wait_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(item.max_wait)));
        p->mutable_start()->set_wait_for_in_flight_ms(absl::ToInt64Milliseconds(item.wait_in_flight));
        break;
      }
      case StepBatch::Kind::kGrow:
        p->mutable_grow()->set_tokens(item.n);
        p->mutable_grow()->set_computed_tokens(item.computed_tokens);
        break;
      case StepBatch::Kind::kPublish:
        p->mutable_publish()->set_num_blocks(static_cast<int32_t>(std::clamp<int64_t>(item.n, -1, INT32_MAX)));
        p->mutable_publish()->mutable_tokens()->Add(item.tokens.begin(), item.tokens.end());
        ToProto(item.checkpoints, p->mutable_publish()->mutable_state_checkpoints());
        break;
      case StepBatch::Kind::kCheckpoint:
        p->mutable_checkpoint()->mutable_tokens()->Add(item.tokens.begin(), item.tokens.end());
        p->mutable_checkpoint()->set_engine_state(item.engine_state);
        ToProto(item.checkpoints, p->mutable_checkpoint()->mutable_state_checkpoints());
        break;
      case StepBatch::Kind::kEnd:
        p->mutable_end()->set_publish_blocks(static_cast<int32_t>(std::clamp<int64_t>(item.n, -1, INT32_MAX)));
        p->mutable_end()->mutable_more_tokens()->Add(item.tokens.begin(), item.tokens.end());
        p->mutable_end()->set_completed(item.completed);
        ToProto(item.checkpoints, p->mutable_end()->mutable_state_checkpoints());
        break;
      case StepBatch::Kind::kPreempt:
        p->mutable_preempt()->mutable_tokens()->Add(item.tokens.begin(), item.tokens.end());
        p->mutable_preempt()->set_engine_state(item.engine_state);
        ToProto(item.checkpoints, p->mutable_preempt()->mutable_state_checkpoints());
        break;
    }
    sent_item.push_back(i);
  }
  // Host-synchronized publish: the bytes a publish or checkpoint names are in memory first.
  if (publishes) {
    if (absl::Status s = im.AwaitWrites(); !s.ok()) {
      for (const StepState::HeldGrowth& h : p->sent_held) h.req->error = s;  // never told: unusable
      return s;
    }
  }
  add_credit(&req);
  return true;
}

// The second half, with im.steps.mu held: kvd's answer to the request PrepareStep built (or why
// there is none) applied to the credit, the held growth it carried and the batch's requests.
absl::StatusOr<StepAnswer> FinishStep(Client::Impl& im, PendingStep& p, absl::StatusOr<v1::StepResponse> resp)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(im.steps.mu) {
  const std::vector<StepState::HeldGrowth>& sent_held = p.sent_held;
  const std::vector<size_t>& sent_item = p.sent_item;
  const auto& items = p.batch->items();
  const int64_t epoch = p.epoch;
  StepAnswer& answer = p.answer;
  if (!resp.ok()) {
    // Unknown whether kvd applied it: the requests its held growth named can no longer be
    // trusted, and the credit is re-synced from the next answer.
    for (const StepState::HeldGrowth& h : sent_held) h.req->error = resp.status();
    DropCredit(im);
    return resp.status();
  }
  answer.sent = true;
  std::vector<std::pair<StepRequest*, absl::Status>> refused;
  ApplyHeld(im, sent_held, *resp, &refused);
  for (auto& [r, status] : refused) r->error = std::move(status);
  for (size_t k = 0; k < sent_item.size(); ++k) {
    const v1::StepResult& r = resp->results(static_cast<int>(sent_held.size() + k));
    const StepBatch::Item& item = items[sent_item[k]];
    StepItemResult& out = answer.items[sent_item[k]];
    CopyStatus(r, &out.status);
    out.kept = r.kept();
    out.already_cached = r.already_cached();
    out.duplicates = r.duplicates();
    out.no_parent = r.no_parent();
    for (int o : r.checkpoint_outcomes()) out.checkpoint_outcomes.push_back(static_cast<CheckpointOutcome>(o));
    out.fresh_slots.assign(r.fresh_slots().begin(), r.fresh_slots().end());
    StepRequest* state = item.req;
    // A kept checkpoint's slot is the pool's now: the fresh spare takes its place in the table.
    for (size_t c = 0; c < item.checkpoints.size() && c < out.checkpoint_outcomes.size(); ++c) {
      const StateCheckpoint& cp = item.checkpoints[c];
      if (out.checkpoint_outcomes[c] != CheckpointOutcome::kKept || cp.group < 0 ||
          cp.group >= static_cast<int>(state->group_tables.size())) {
        continue;
      }
      std::vector<BlockIndex>& slots = state->group_tables[cp.group].blocks;
      auto at = std::find(slots.begin(), slots.end(), cp.slot);
      if (at == slots.end()) continue;
      if (c < out.fresh_slots.size() && out.fresh_slots[c] >= 0) *at = static_cast<BlockIndex>(out.fresh_slots[c]);
      else slots.erase(at);
    }
    // A generation checkpoint's named slots are the record's now: each fresh spare takes one's place.
    if (item.kind == StepBatch::Kind::kCheckpoint && out.status.ok()) {
      for (size_t c = 0; c < item.checkpoints.size() && c < out.fresh_slots.size(); ++c) {
        const StateCheckpoint& cp = item.checkpoints[c];
        if (cp.group < 0 || cp.group >= static_cast<int>(state->group_tables.size()) || out.fresh_slots[c] < 0) continue;
        std::vector<BlockIndex>& slots = state->group_tables[cp.group].blocks;
        if (auto at = std::find(slots.begin(), slots.end(), cp.slot); at != slots.end()) {
          *at = static_cast<BlockIndex>(out.fresh_slots[c]);
        }
      }
    }
    switch (item.kind) {
      case StepBatch::Kind::kStart:
        state->id = item.spec.id;
        state->waiting = out.waiting = r.waiting();
        state->epoch = epoch;
        state->in_flight_wait = static_cast<int>(r.in_flight_wait());
        state->in_flight.reset();
        if (r.has_in_flight()) {
          v1::AcquireResponse seen;  // the wire's InFlight, read as AcquireResult's
          *seen.mutable_in_flight() = r.in_flight();
          state->in_flight = FromProto(seen).in_flight;
        }
        if (out.status.ok() && !r.waiting()) {
          state->acquired = FromProto(r.acquired());
          state->pool = state->acquired.pool;
          state->blocks = state->acquired.blocks;
          state->group_tables = state->acquired.group_tables;
          state->num_tokens = state->acquired.num_tokens;
          state->live = true;
          state->error = absl::OkStatus();
        }
        break;
      case StepBatch::Kind::kGrow:
        if (out.status.ok()) {
          if (absl::Status s = ApplyGroupGrow(r, &state->group_tables); !s.ok()) {
            out.status = state->error = s;  // the tables no longer match kvd's: End it
            break;
          }
          if (!state->group_tables.empty()) {  // what kvd now holds as the request's computed tokens
            state->reported_computed = item.computed_tokens > 0
                                           ? item.computed_tokens
                                           : std::max(state->reported_computed, state->acquired.cached_tokens);
          }
          state->blocks.insert(state->blocks.end(), r.blocks().begin(), r.blocks().end());
          state->num_tokens += item.n;
        }
        break;
      case StepBatch::Kind::kEnd:
      case StepBatch::Kind::kPreempt:
        if (out.status.ok()) state->live = state->waiting = false;
        break;
      default:
        break;
    }
  }
  return std::move(answer);
}

}  // namespace

absl::StatusOr<StepAnswer> Client::Step(StepBatch& batch) {
  Impl& im = *impl_;
  absl::MutexLock lock(&im.steps.mu);
  if (im.steps.submitted) return SubmittedNotTaken();
  PendingStep p;
  absl::StatusOr<bool> send = PrepareStep(*this, im, batch, &p);
  if (!send.ok()) return send.status();
  if (!*send) return std::move(p.answer);
  return FinishStep(im, p, SendStep(im, p.req, p.epoch, absl::Seconds(30)));  // sent with mu held: in seq order
}

absl::StatusOr<std::unique_ptr<StepFuture>> Client::StepSubmit(StepBatch& batch) {
  Impl& im = *impl_;
  absl::MutexLock lock(&im.steps.mu);
  if (im.steps.submitted) return SubmittedNotTaken();
  std::unique_ptr<StepFuture> f(new StepFuture(&im, std::make_unique<PendingStep>()));
  absl::StatusOr<bool> send = PrepareStep(*this, im, batch, f->pending_.get());
  if (!send.ok()) return send.status();
  if (!*send) {
    f->ready_ = true;
    return f;
  }
  // The reporter sends it (no report is in flight: PrepareStep waited for it), and nothing else
  // goes out until the engine has taken its answer.
  im.steps.submitted = true;
  im.steps.submit = &f->pending_->req;
  im.steps.submit_epoch = f->pending_->epoch;
  im.steps.submit_answer.reset();
  if (!im.steps.reporter.joinable()) im.steps.reporter = std::thread([&im] { im.Report(); });
  return f;
}

StepFuture::StepFuture(Client::Impl* im, std::unique_ptr<PendingStep> pending) : im_(im), pending_(std::move(pending)) {}

StepFuture::~StepFuture() {
  if (!taken_) (void)Get();  // the credit and the requests stay whole even when nobody looks
}

bool StepFuture::ready() const {
  if (ready_ || taken_) return true;
  absl::MutexLock lock(&im_->steps.mu);
  return im_->steps.submit_answer.has_value();
}

absl::StatusOr<StepAnswer> StepFuture::Get() {
  if (taken_) return absl::FailedPreconditionError("this step's answer was taken already");
  taken_ = true;
  if (ready_) return std::move(pending_->answer);
  Client::Impl& im = *im_;
  absl::MutexLock lock(&im.steps.mu);
  im.steps.mu.Await(absl::Condition(
      +[](StepState* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) { return s->stop_reporter || s->submit_answer.has_value(); },
      &im.steps));
  im.steps.submitted = false;
  if (!im.steps.submit_answer.has_value()) {
    im.steps.submit = nullptr;
    return absl::CancelledError("the client closed with the step in flight");
  }
  absl::StatusOr<v1::StepResponse> resp = std::move(*im.steps.submit_answer);
  im.steps.submit_answer.reset();
  return FinishStep(im, *pending_, std::move(resp));
}

}  // namespace kvd::client
