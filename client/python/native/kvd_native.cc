// kvd._native: the C++ client's step path (Client::Step, Client::StepSubmit; client/step.h) for
// Python engines, behind a thin pybind11 binding. kvd/native.py wraps it in the interface of
// kvd.Client's steps (kvd.step.StepBatch in, kvd.step.StepResult out), so an engine such as
// kvd.engine.batch.BatchEngine runs on either.
//
// Why: a step's round trip over gRPC Python costs the worker 0.3-0.5 ms of CPU under the GIL,
// which a Python model holding the GIL cannot run beside (docs/performance.md, kvd-reuse-2 item
// 6). Here a step's protobuf, its gRPC call and its answer are C++ on the client's reporter thread,
// with the GIL released; Python pays for handing the items over (each start's AdmitRequest and each
// publish's message as serialized bytes, parsed here) and for reading the answers back.
//
// Threads: every call comes from one Python thread (the engine's), as Client::Step wants; the GIL
// is released around every call into the client that may wait (connect, a step, a future's
// answer, flush, close). A Request's C++ StepRequest is only touched on that thread (Get applies
// the answer there), so reading it between submit and Get is safe.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "kvd/v1/kvd.pb.h"
#include "proto/convert.h"

namespace py = pybind11;

namespace kvd::client {
namespace {

// The item kinds kvd/native.py hands over (kvd.step.StepBatch's names, in this order).
enum ItemKind { kStart = 0, kGrow, kPublish, kCheckpoint, kEnd, kPreempt };

[[noreturn]] void Raise(const absl::Status& s) {
  // kvd/native.py turns (code, message) into a KvdError.
  throw py::value_error(absl::StrCat(static_cast<int>(s.code()), ":", s.message()));
}

template <typename Message>
Message Parse(const py::bytes& b, const char* what) {
  Message m;
  std::string_view view = b;
  if (!m.ParseFromArray(view.data(), static_cast<int>(view.size()))) {
    throw py::value_error(absl::StrCat("kvd._native: a ", what, " that does not parse"));
  }
  return m;
}

// A request driven by steps, at one address for its C++ lifetime (a Python object holds it).
struct Request {
  StepRequest req;
};

py::object InFlightTuple(const std::optional<InFlightInfo>& f) {
  if (!f.has_value()) return py::none();
  return py::make_tuple(f->first_block, f->blocks, f->request_id.value(), f->published_tokens, f->computed_tokens);
}

// What the Python StepRequest mirrors of `r`. `blocks_from`: the table's entries from there on
// (growth appends; a start or resume replaces: 0).
py::tuple RequestState(const StepRequest& r, size_t blocks_from) {
  py::list blocks;
  for (size_t i = std::min(blocks_from, r.blocks.size()); i < r.blocks.size(); ++i) blocks.append(r.blocks[i]);
  py::list tables;
  for (const GroupTable& t : r.group_tables) {
    tables.append(py::make_tuple(t.name, t.first_block_position, t.blocks,
                                 t.checkpoint_slot >= 0 ? py::object(py::int_(t.checkpoint_slot)) : py::none()));
  }
  const AcquireResult& a = r.acquired;
  return py::make_tuple(blocks, r.num_tokens, r.live, r.waiting, r.epoch, a.cached_tokens, a.resumed,
                        a.resumed_tokens, py::bytes(a.engine_state), InFlightTuple(r.in_flight), r.in_flight_wait,
                        static_cast<int>(r.error.code()), std::string(r.error.message()), tables, r.reported_computed,
                        static_cast<int>(a.pool));
}

py::list Results(const StepAnswer& answer, const StepBatch& batch) {
  py::list out;
  for (size_t i = 0; i < answer.items.size(); ++i) {
    const StepItemResult& r = answer.items[i];
    py::list outcomes;
    for (CheckpointOutcome o : r.checkpoint_outcomes) outcomes.append(static_cast<int>(o));
    const StepRequest* req = batch.items()[i].req;
    out.append(py::make_tuple(static_cast<int>(r.status.code()), std::string(r.status.message()), r.waiting, r.kept,
                              r.already_cached, r.duplicates, r.no_parent, outcomes, r.fresh_slots,
                              batch.items()[i].kind == StepBatch::Kind::kStart ? InFlightTuple(req->in_flight)
                                                                                : py::none()));
  }
  return out;
}

class NativeClient {
 public:
  NativeClient(const std::string& target, const std::string& worker_name, int64_t step_credit_blocks) {
    ClientOptions o;
    o.target = target;
    o.worker_name = worker_name;
    o.step_credit_blocks = step_credit_blocks;
    o.no_async_writes = true;  // Python writes complete before the call that follows them returns
    absl::StatusOr<std::unique_ptr<Client>> c;
    {
      py::gil_scoped_release unlocked;
      c = Client::Connect(o);
    }
    if (!c.ok()) Raise(c.status());
    client_ = std::move(*c);
  }

  // Each pool as a serialized kvd.v1.PoolInfo (with its slabs' sizes), for kvd.client.Pool.
  py::list Pools() const {
    py::list out;
    for (const PoolView& p : client_->pools()) {
      v1::PoolInfo info;
      ToProto(p.id, p.geometry, &info);
      for (int64_t bytes : p.slab_bytes) info.add_slabs()->set_size_bytes(bytes);
      out.append(py::bytes(info.SerializeAsString()));
    }
    return out;
  }

  // A writable view of shard `shard`'s slab of pool `pool` (host backend only). It is the C++
  // client's mapping: valid until kvd restarts with new memory (then rebuild it).
  py::memoryview Slab(int pool, int shard) const {
    const std::vector<PoolView>& pools = client_->pools();
    if (pool < 0 || pool >= static_cast<int>(pools.size())) throw py::index_error("no such pool");
    const PoolView& p = pools[pool];
    if (shard < 0 || shard >= static_cast<int>(p.shard_base.size()) || p.shard_base[shard] == nullptr) {
      throw py::index_error("that shard is not mapped in this process");
    }
    if (p.shard_device[shard] >= 0) throw py::value_error("a CUDA slab: map it with kvd.cuda, not as host memory");
    return py::memoryview::from_memory(p.shard_base[shard], static_cast<py::ssize_t>(p.slab_bytes[shard]), false);
  }

  bool MayWrite(int64_t epoch) const { return epoch < 0 ? client_->MayWrite() : client_->MayWrite(epoch); }
  int64_t Epoch() const { return client_->epoch(); }

  // Sends a step (items: (kind, Request, a, b)); placed growth is in the requests when it
  // returns. False when nothing went out (result() answers at once).
  bool Submit(const py::list& items) {
    RequireNoneInFlight();
    py::list keep;  // the Requests the batch points at stay alive until its answer is taken
    std::unique_ptr<StepBatch> batch = Build(items, &keep);
    absl::StatusOr<std::unique_ptr<StepFuture>> f;
    {
      py::gil_scoped_release unlocked;
      f = client_->StepSubmit(*batch);
    }
    if (!f.ok()) Raise(f.status());
    const bool sent = !(*f)->ready();
    inflight_ = std::move(*f);
    batch_ = std::move(batch);
    keep_ = std::move(keep);
    return sent;
  }

  // The step made here and answered (Client::Step: no hand-off to the reporter thread), for an
  // engine with nothing to compute meanwhile: (whether a round trip was made, the result tuples).
  py::tuple Step(const py::list& items) {
    RequireNoneInFlight();
    py::list keep;
    std::unique_ptr<StepBatch> batch = Build(items, &keep);
    absl::StatusOr<StepAnswer> answer;
    {
      py::gil_scoped_release unlocked;
      answer = client_->Step(*batch);
    }
    if (!answer.ok()) Raise(answer.status());
    return py::make_tuple(answer->sent, Results(*answer, *batch));
  }

 private:
  void RequireNoneInFlight() const {
    if (inflight_ != nullptr) throw py::value_error("9:a submitted step's answer has not been taken");
  }

  // The C++ batch of `items`, each Request appended to `keep`. ValueError (nothing built) for an
  // item that does not parse or is of no known kind.
  std::unique_ptr<StepBatch> Build(const py::list& items, py::list* keep) {
    auto batch = std::make_unique<StepBatch>();
    for (const py::handle& h : items) {
      py::tuple t = py::reinterpret_borrow<py::tuple>(h);
      const int kind = t[0].cast<int>();
      Request& r = t[1].cast<Request&>();
      keep->append(t[1]);
      switch (kind) {
        case kStart: {
          // a: a serialized kvd.v1.StartRequest; b: the request id.
          v1::StartRequest s = Parse<v1::StartRequest>(t[2].cast<py::bytes>(), "StartRequest");
          RequestSpec spec = SpecFromProto(s.admit());
          spec.id = RequestId(t[3].cast<std::string>());
          if (!s.peer().empty()) throw py::value_error("3:a start from a peer is not on the native step path");
          batch->Start(&r.req, std::move(spec), absl::Milliseconds(s.max_wait_ms()),
                       absl::Milliseconds(s.wait_for_in_flight_ms()));
          break;
        }
        case kGrow:  // a: tokens; b: computed tokens
          batch->Grow(&r.req, t[2].cast<int64_t>(), t[3].cast<int64_t>());
          break;
        case kPublish: {
          v1::StepPublish p = Parse<v1::StepPublish>(t[2].cast<py::bytes>(), "StepPublish");
          batch->Publish(&r.req, TokensFromProto(p.tokens()), p.num_blocks(), FromProto(p.state_checkpoints()));
          break;
        }
        case kCheckpoint:
        case kPreempt: {
          v1::CheckpointRequest c = Parse<v1::CheckpointRequest>(t[2].cast<py::bytes>(), "CheckpointRequest");
          auto call = kind == kCheckpoint ? &StepBatch::Checkpoint : &StepBatch::Preempt;
          (batch.get()->*call)(&r.req, TokensFromProto(c.tokens()), c.engine_state(), FromProto(c.state_checkpoints()));
          break;
        }
        case kEnd: {
          v1::EndRequest e = Parse<v1::EndRequest>(t[2].cast<py::bytes>(), "EndRequest");
          batch->End(&r.req, e.publish_blocks(), TokensFromProto(e.more_tokens()), e.completed(),
                     FromProto(e.state_checkpoints()));
          break;
        }
        default:
          throw py::value_error(absl::StrCat("3:unknown step item kind ", kind));
      }
    }
    return batch;
  }

 public:

  bool Ready() const { return inflight_ == nullptr || inflight_->ready(); }

  // The submitted step's answer: one result tuple per item, in order.
  py::list Result() {
    if (inflight_ == nullptr) throw py::value_error("9:no step was submitted");
    absl::StatusOr<StepAnswer> answer;
    {
      py::gil_scoped_release unlocked;
      answer = inflight_->Get();
    }
    std::unique_ptr<StepBatch> batch = std::move(batch_);
    inflight_.reset();
    keep_ = py::list();
    if (!answer.ok()) Raise(answer.status());
    return Results(*answer, *batch);
  }

  void Flush() {
    absl::Status s;
    {
      py::gil_scoped_release unlocked;
      s = client_->FlushSteps();
    }
    if (!s.ok()) Raise(s);
  }

  int64_t Credit(int pool, int group) const { return static_cast<int64_t>(client_->StepCreditBlocks(pool, group).size()); }

  void Close() {
    py::gil_scoped_release unlocked;
    inflight_.reset();  // takes the answer first: the future never outlives the client
    batch_.reset();
    client_.reset();
  }

  ~NativeClient() {
    inflight_.reset();
    batch_.reset();
  }

 private:
  std::unique_ptr<Client> client_;
  std::unique_ptr<StepFuture> inflight_;
  std::unique_ptr<StepBatch> batch_;
  py::list keep_;
};

}  // namespace
}  // namespace kvd::client

PYBIND11_MODULE(_native, m) {
  using kvd::client::NativeClient;
  using kvd::client::Request;
  m.doc() = "kvd's C++ step path (see kvd/native.py)";
  py::class_<Request>(m, "Request")
      .def(py::init([](const std::string& id) {
        auto r = std::make_unique<Request>();
        r->req.id = kvd::RequestId(id);  // what a refusal names, before any start
        return r;
      }))
      .def("state", [](const Request& r, size_t blocks_from) { return kvd::client::RequestState(r.req, blocks_from); });
  py::class_<NativeClient>(m, "Client")
      .def(py::init<const std::string&, const std::string&, int64_t>())
      .def("pools", &NativeClient::Pools)
      .def("slab", &NativeClient::Slab)
      .def("may_write", &NativeClient::MayWrite)
      .def("epoch", &NativeClient::Epoch)
      .def("submit", &NativeClient::Submit)
      .def("step", &NativeClient::Step)
      .def("ready", &NativeClient::Ready)
      .def("result", &NativeClient::Result)
      .def("flush", &NativeClient::Flush)
      .def("credit", &NativeClient::Credit)
      .def("close", &NativeClient::Close);
}
