// Client::Step: one scheduler step in one round trip, or none (client/step.h).
//
// Growth covered by the worker's credit is applied here at once and held back; it goes out at the
// head of the next step that must (any other item, growth credit does not cover, or credit below
// half of what the client asks for), in the order it happened. A step that fails as a whole is
// sent again with the same sequence number (kvd answers a repeat from its record without applying
// it twice) while the attachment lasts.
#include "client/client.h"
#include "client/client_impl.h"

namespace kvd::client {
namespace {

void CopyStatus(const v1::StepResult& r, absl::Status* out) {
  *out = r.code() == 0 ? absl::OkStatus() : absl::Status(static_cast<absl::StatusCode>(r.code()), r.message());
}

}  // namespace

void StepBatch::Start(StepRequest* req, RequestSpec spec, absl::Duration max_wait) {
  items_.push_back(Item{Kind::kStart, req, std::move(spec), max_wait});
}
void StepBatch::Grow(StepRequest* req, int64_t tokens) {
  Item item{Kind::kGrow, req};
  item.n = tokens;
  items_.push_back(std::move(item));
}
void StepBatch::Publish(StepRequest* req, std::vector<Token> tokens, int64_t num_blocks) {
  Item item{Kind::kPublish, req};
  item.n = num_blocks;
  item.tokens = std::move(tokens);
  items_.push_back(std::move(item));
}
void StepBatch::Checkpoint(StepRequest* req, std::vector<Token> tokens, std::string engine_state) {
  Item item{Kind::kCheckpoint, req};
  item.tokens = std::move(tokens);
  item.engine_state = std::move(engine_state);
  items_.push_back(std::move(item));
}
void StepBatch::End(StepRequest* req, int64_t publish_blocks, std::vector<Token> more_tokens, bool completed) {
  Item item{Kind::kEnd, req};
  item.n = publish_blocks;
  item.tokens = std::move(more_tokens);
  item.completed = completed;
  items_.push_back(std::move(item));
}
void StepBatch::Preempt(StepRequest* req, std::vector<Token> tokens, std::string engine_state) {
  Item item{Kind::kPreempt, req};
  item.tokens = std::move(tokens);
  item.engine_state = std::move(engine_state);
  items_.push_back(std::move(item));
}

int64_t Client::StepCredit(PoolId pool) const {
  absl::MutexLock lock(&impl_->step_mu);
  auto it = impl_->credit.find(pool);
  return it == impl_->credit.end() ? 0 : static_cast<int64_t>(it->second.size());
}

absl::Status Client::FlushSteps() {
  StepBatch empty;
  {
    absl::MutexLock lock(&impl_->step_mu);
    if (impl_->held.empty()) return absl::OkStatus();
  }
  return Step(empty).status();
}

absl::StatusOr<StepAnswer> Client::Step(StepBatch& batch) {
  Impl& im = *impl_;
  absl::MutexLock lock(&im.step_mu);
  const int64_t epoch = im.Epoch();
  if (epoch != im.step_epoch) {  // a new attachment: credit and held growth went with the old one
    im.step_epoch = epoch;
    im.step_seq = 0;
    im.credit.clear();
    im.held.clear();
  }
  const std::vector<PoolView>& views = pools();
  const auto& items = batch.items();
  StepAnswer answer;
  answer.items.resize(items.size());
  std::vector<bool> send(items.size(), false);
  bool must_send = false, publishes = false;
  absl::flat_hash_map<PoolId, bool> pools_used;
  for (size_t i = 0; i < items.size(); ++i) {
    const StepBatch::Item& item = items[i];
    StepRequest* r = item.req;
    if (item.kind == StepBatch::Kind::kStart) {
      absl::StatusOr<const PoolView*> pool = FindPool(item.spec.ns.pool);
      if (!pool.ok()) {
        answer.items[i].status = pool.status();
        continue;
      }
      pools_used[(*pool)->id] = true;
      send[i] = must_send = true;
      continue;
    }
    if (r->epoch != epoch || !r->live) {
      answer.items[i].status = r->live ? KvdRestartedError(r->id)
                                       : absl::FailedPreconditionError(absl::StrCat(
                                             "request '", r->id.value(), "' is not live in this client"));
      continue;
    }
    pools_used[r->pool] = true;
    if (item.kind != StepBatch::Kind::kGrow) {
      send[i] = must_send = true;
      publishes |= item.kind != StepBatch::Kind::kEnd || item.n != 0;
      continue;
    }
    const PoolGeometry& g = views[r->pool].geometry;
    if (item.n < 0 || item.n > g.max_model_len - r->num_tokens) {
      send[i] = must_send = true;  // kvd names what is wrong
      continue;
    }
    const int64_t needed =
        std::max<int64_t>(0, g.BlocksFor(r->num_tokens + item.n) - static_cast<int64_t>(r->blocks.size()));
    std::vector<BlockIndex>& credit = im.credit[r->pool];
    if (needed > static_cast<int64_t>(credit.size())) {
      send[i] = must_send = true;  // kvd allocates every block it needs, in the answer
      continue;
    }
    // Covered: placed here at once and told with the next step that goes out.
    Impl::HeldGrowth growth{r, item.n, {}};
    for (int64_t k = 0; k < needed; ++k) {
      growth.credit_blocks.push_back(credit.back());
      r->blocks.push_back(credit.back());
      credit.pop_back();
    }
    r->num_tokens += item.n;
    im.held.push_back(std::move(growth));
  }
  for (const auto& [pool, used] : pools_used) {
    if (im.options.step_credit_blocks > 0 &&
        static_cast<int64_t>(im.credit[pool].size()) < im.options.step_credit_blocks / 2) {
      must_send = true;  // refill
    }
  }
  if (!must_send) return answer;

  // The step as it goes out: held growth first (in the order it happened), then the batch.
  v1::StepRequest req;
  req.set_worker_id(im.Worker().value());
  req.set_seq(++im.step_seq);
  const size_t n_held = im.held.size();
  for (const Impl::HeldGrowth& h : im.held) {
    v1::StepItem* p = req.add_items();
    p->set_request_id(h.req->id.value());
    p->mutable_grow()->set_tokens(h.tokens);
    p->mutable_grow()->mutable_credit_blocks()->Add(h.credit_blocks.begin(), h.credit_blocks.end());
  }
  std::vector<size_t> sent_item;  // proto item n_held + k -> batch item
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
        break;
      }
      case StepBatch::Kind::kGrow:
        p->mutable_grow()->set_tokens(item.n);
        break;
      case StepBatch::Kind::kPublish:
        p->mutable_publish()->set_num_blocks(static_cast<int32_t>(std::clamp<int64_t>(item.n, -1, INT32_MAX)));
        p->mutable_publish()->mutable_tokens()->Add(item.tokens.begin(), item.tokens.end());
        break;
      case StepBatch::Kind::kCheckpoint:
        p->mutable_checkpoint()->mutable_tokens()->Add(item.tokens.begin(), item.tokens.end());
        p->mutable_checkpoint()->set_engine_state(item.engine_state);
        break;
      case StepBatch::Kind::kEnd:
        p->mutable_end()->set_publish_blocks(static_cast<int32_t>(std::clamp<int64_t>(item.n, -1, INT32_MAX)));
        p->mutable_end()->mutable_more_tokens()->Add(item.tokens.begin(), item.tokens.end());
        p->mutable_end()->set_completed(item.completed);
        break;
      case StepBatch::Kind::kPreempt:
        p->mutable_preempt()->mutable_tokens()->Add(item.tokens.begin(), item.tokens.end());
        p->mutable_preempt()->set_engine_state(item.engine_state);
        break;
    }
    sent_item.push_back(i);
  }
  if (im.options.step_credit_blocks > 0) {
    for (const auto& [pool, used] : pools_used) {
      v1::CreditWant* c = req.add_credit();
      c->set_pool(views[pool].geometry.name);
      c->set_blocks(im.options.step_credit_blocks);
    }
  }
  // Host-synchronized publish: the bytes a publish or checkpoint names are in memory first.
  if (publishes) KVD_RETURN_IF_ERROR(im.AwaitWrites());

  absl::StatusOr<v1::StepResponse> resp;
  for (int attempt = 0; attempt < 3; ++attempt) {
    resp = im.Call<v1::StepResponse>([&](auto* ctx, auto* out) { return im.stub()->Step(ctx, req, out); });
    if (resp.ok() || !absl::IsUnavailable(resp.status()) || im.Epoch() != epoch) break;
    absl::SleepFor(absl::Milliseconds(50 << attempt));  // the same seq again: applied at most once
  }
  // Failed as a whole: the held growth stays held (sent again, under a new seq, only if kvd never
  // applied this one: a lost answer means an unknown state, which the attachment's end settles).
  if (!resp.ok()) return resp.status();
  if (resp->results_size() != req.items_size()) {
    return absl::InternalError(
        absl::StrCat("kvd answered ", resp->results_size(), " results for ", req.items_size(), " items"));
  }
  answer.sent = true;

  for (size_t k = 0; k < n_held; ++k) {  // a refusal makes its request unusable
    absl::Status s;
    CopyStatus(resp->results(static_cast<int>(k)), &s);
    if (!s.ok()) im.held[k].req->error = s;
  }
  im.held.clear();
  for (size_t k = 0; k < sent_item.size(); ++k) {
    const v1::StepResult& r = resp->results(static_cast<int>(n_held + k));
    const StepBatch::Item& item = items[sent_item[k]];
    StepItemResult& out = answer.items[sent_item[k]];
    CopyStatus(r, &out.status);
    out.kept = r.kept();
    out.already_cached = r.already_cached();
    out.duplicates = r.duplicates();
    out.no_parent = r.no_parent();
    StepRequest* state = item.req;
    switch (item.kind) {
      case StepBatch::Kind::kStart:
        state->id = item.spec.id;
        state->waiting = out.waiting = r.waiting();
        if (out.status.ok() && !r.waiting()) {
          state->acquired = FromProto(r.acquired());
          state->pool = state->acquired.pool;
          state->blocks = state->acquired.blocks;
          state->num_tokens = state->acquired.num_tokens;
          state->live = true;
          state->epoch = epoch;
          state->error = absl::OkStatus();
        }
        break;
      case StepBatch::Kind::kGrow:
        if (out.status.ok()) {
          state->blocks.insert(state->blocks.end(), r.blocks().begin(), r.blocks().end());
          state->num_tokens += item.n;
        }
        break;
      case StepBatch::Kind::kEnd:
      case StepBatch::Kind::kPreempt:
        if (out.status.ok()) state->live = false;
        break;
      default:
        break;
    }
  }
  // The credit kvd says the worker holds now replaces what the client had.
  for (auto& [pool, blocks] : im.credit) blocks.clear();
  for (const v1::StepCredit& c : resp->credit()) im.credit[c.pool_id()].assign(c.blocks().begin(), c.blocks().end());
  return answer;
}

}  // namespace kvd::client
