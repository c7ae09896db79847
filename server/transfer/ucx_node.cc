#include "server/transfer/ucx_node.h"

#include <ucp/api/ucp.h>

#include <poll.h>

#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gpu/slab_layout.h"
#include "spdlog/spdlog.h"

namespace kvd {
namespace {

absl::Status UcxError(absl::string_view call, ucs_status_t status) {
  return absl::UnavailableError(absl::StrCat(call, ": ", ucs_status_string(status)));
}

// How long a forced close may take to cancel reads still in flight before Get gives up on the
// destination (INTERNAL). UCX completes cancelled requests on the next progress passes.
constexpr absl::Duration kCancelWait = absl::Seconds(10);

// Reads one pull keeps in flight.
constexpr size_t kMaxInFlight = 32;

// Set by UCX when the connection to the peer fails (the peer died, the network went).
void OnEndpointError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  static_cast<std::atomic<int>*>(arg)->store(static_cast<int>(status));
}

}  // namespace

absl::StatusOr<std::unique_ptr<UcxNode>> UcxNode::Create(const DeviceArena* arena) {
  std::unique_ptr<UcxNode> node(new UcxNode());
  ucp_config_t* config = nullptr;
  if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK) return UcxError("ucp_config_read", s);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  ucp_context_h context = nullptr;
  const ucs_status_t init = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (init != UCS_OK) return UcxError("ucp_init", init);
  node->context_ = context;

  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucs_status_t s = ucp_context_query(context, &attr); s != UCS_OK) return UcxError("ucp_context_query", s);
  const bool cuda_memory = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // mu_ serializes every call
  ucp_worker_h worker = nullptr;
  if (ucs_status_t s = ucp_worker_create(context, &wp, &worker); s != UCS_OK) return UcxError("ucp_worker_create", s);
  node->worker_ = worker;
  ucp_address_t* address = nullptr;
  size_t address_len = 0;
  if (ucs_status_t s = ucp_worker_get_address(worker, &address, &address_len); s != UCS_OK) {
    return UcxError("ucp_worker_get_address", s);
  }
  node->address_.assign(reinterpret_cast<const char*>(address), address_len);
  ucp_worker_release_address(worker, address);
  if (ucs_status_t s = ucp_worker_get_efd(worker, &node->event_fd_); s != UCS_OK) return UcxError("ucp_worker_get_efd", s);

  const bool cuda_backend = arena->backend() == "cuda";
  node->pools_.resize(arena->geometries().size());
  for (PoolId p = 0; p < arena->geometries().size(); ++p) {
    const PoolGeometry& g = arena->geometries()[p];
    MappedPool& mapped = node->pools_[p];
    if (cuda_backend && !cuda_memory) {
      mapped.refusal = absl::StrCat("pool '", g.name, "' is in CUDA memory and this UCX (", ucp_get_version_string(),
                                    ") reads no CUDA memory: give kvd a CUDA-aware UCX (docs/operations.md, "
                                    "\"Peer transfer\")");
      continue;
    }
    const int64_t slab_bytes = SlabLayout(g).slab_bytes();
    for (uint32_t shard = 0; shard < static_cast<uint32_t>(g.num_shards); ++shard) {
      uint8_t* base = arena->TransferBase(p, shard);
      if (base == nullptr) {
        mapped.refusal = absl::StrCat("pool '", g.name, "' has no slab for shard ", shard);
        break;
      }
      ucp_mem_map_params_t mp{};
      mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_PROT | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
      mp.address = base;
      mp.length = static_cast<size_t>(slab_bytes);
      // Peers read; only this kvd writes (its own gets land here as local writes).
      mp.prot = UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE | UCP_MEM_MAP_PROT_REMOTE_READ;
      mp.memory_type = cuda_backend ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
      ucp_mem_h memh = nullptr;
      if (ucs_status_t s = ucp_mem_map(context, &mp, &memh); s != UCS_OK) {
        mapped.refusal = absl::StrCat("pool '", g.name, "': ucp_mem_map of shard ", shard, ": ", ucs_status_string(s));
        break;
      }
      MappedSlab slab;
      slab.memh = memh;
      slab.base = base;
      slab.key.address = reinterpret_cast<uint64_t>(base);
      slab.key.size_bytes = slab_bytes;
      void* packed = nullptr;
      size_t packed_len = 0;
      const ucs_status_t packed_status = ucp_rkey_pack(context, memh, &packed, &packed_len);
      if (packed_status == UCS_OK) {
        slab.key.rkey.assign(static_cast<const char*>(packed), packed_len);
        ucp_rkey_buffer_release(packed);
      }
      mapped.slabs.push_back(std::move(slab));
      if (packed_status != UCS_OK) {
        mapped.refusal = absl::StrCat("pool '", g.name, "': ucp_rkey_pack: ", ucs_status_string(packed_status));
        break;
      }
    }
    if (!mapped.refusal.empty()) spdlog::warn("peer transfer: {}", mapped.refusal);
  }
  node->progress_ = std::thread([raw = node.get()] { raw->ProgressLoop(); });
  spdlog::info("peer transfer: UCX {} worker ready ({} bytes of address){}", ucp_get_version_string(),
               node->address_.size(), cuda_memory ? ", CUDA memory supported" : "");
  return node;
}

UcxNode::~UcxNode() {
  if (progress_.joinable()) {
    stop_.store(true);
    {
      absl::MutexLock lock(&mu_);
      ucp_worker_signal(static_cast<ucp_worker_h>(worker_));
    }
    progress_.join();
  }
  for (MappedPool& p : pools_) {
    for (MappedSlab& s : p.slabs) ucp_mem_unmap(static_cast<ucp_context_h>(context_), static_cast<ucp_mem_h>(s.memh));
  }
  if (worker_ != nullptr) ucp_worker_destroy(static_cast<ucp_worker_h>(worker_));
  if (context_ != nullptr) ucp_cleanup(static_cast<ucp_context_h>(context_));
}

absl::Status UcxNode::Transferable(PoolId pool) const {
  if (pool >= pools_.size()) return absl::NotFoundError(absl::StrCat("no pool ", pool));
  if (!pools_[pool].refusal.empty()) return absl::FailedPreconditionError(pools_[pool].refusal);
  return absl::OkStatus();
}

void UcxNode::ProgressLoop() {
  ucp_worker_h worker = static_cast<ucp_worker_h>(worker_);
  while (!stop_.load()) {
    // A Get in progress drives the worker itself (peers' reads of this node included): stand
    // aside rather than contend for mu_ and a core.
    if (active_gets_.load() > 0) {
      absl::SleepFor(absl::Milliseconds(2));
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      while (ucp_worker_progress(worker) != 0) {
      }
      // UCS_ERR_BUSY: events arrived meanwhile; progress again before sleeping.
      if (ucp_worker_arm(worker) == UCS_ERR_BUSY) continue;
    }
    pollfd p{event_fd_, POLLIN, 0};
    (void)poll(&p, 1, /*timeout_ms=*/100);
  }
}

bool UcxNode::ProgressOnce() {
  absl::MutexLock lock(&mu_);
  return ucp_worker_progress(static_cast<ucp_worker_h>(worker_)) != 0;
}

absl::Status UcxNode::Get(const std::string& peer_address, PoolId pool, const std::vector<std::string>& rkeys,
                          const std::vector<Read>& reads, absl::Time deadline,
                          const std::function<absl::Status(size_t)>& on_read) {
  if (absl::Status t = Transferable(pool); !t.ok()) return t;
  active_gets_.fetch_add(1);
  struct Leave {
    std::atomic<int>& n;
    ~Leave() { n.fetch_sub(1); }
  } leave{active_gets_};
  ucp_worker_h worker = static_cast<ucp_worker_h>(worker_);
  std::atomic<int> ep_error{UCS_OK};
  ucp_ep_h ep = nullptr;
  std::vector<ucp_rkey_h> unpacked(rkeys.size(), nullptr);
  std::vector<std::pair<void*, size_t>> pending;  // UCX requests not complete yet, and their read
  std::vector<size_t> done;                       // reads completed, not reported to on_read yet
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    ucp_ep_params_t ep_params{};
    ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                           UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep_params.address = reinterpret_cast<const ucp_address_t*>(peer_address.data());
    ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep_params.err_handler.cb = OnEndpointError;
    ep_params.err_handler.arg = &ep_error;
    if (ucs_status_t s = ucp_ep_create(worker, &ep_params, &ep); s != UCS_OK) {
      return UcxError("connecting to the peer's UCX worker (ucp_ep_create)", s);
    }
    for (size_t i = 0; i < rkeys.size() && status.ok(); ++i) {
      if (ucs_status_t s = ucp_ep_rkey_unpack(ep, rkeys[i].data(), &unpacked[i]); s != UCS_OK) {
        unpacked[i] = nullptr;
        status = absl::InvalidArgumentError(
            absl::StrCat("the peer's remote key for shard ", i, " does not unpack: ", ucs_status_string(s)));
      }
    }
  }
  // Reads go out kMaxInFlight at a time: enough to keep the transport busy, few enough that
  // polling them each pass costs nothing.
  size_t next = 0;
  auto issue = [&]() {  // under mu_
    ucp_request_param_t param{};
    for (; next < reads.size() && pending.size() < kMaxInFlight && status.ok(); ++next) {
      const Read& r = reads[next];
      param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
      param.memh = static_cast<ucp_mem_h>(pools_[pool].slabs[r.shard].memh);
      ucs_status_ptr_t req = ucp_get_nbx(ep, r.local, static_cast<size_t>(r.length), r.remote, unpacked[r.shard], &param);
      if (UCS_PTR_IS_ERR(req)) {
        status = UcxError("ucp_get_nbx", UCS_PTR_STATUS(req));
      } else if (req != nullptr) {
        pending.emplace_back(req, next);
      } else {
        done.push_back(next);
      }
    }
  };
  {
    absl::MutexLock lock(&mu_);
    issue();
  }
  // Progress until every read completed, one failed, the connection broke or the deadline passed.
  auto reap = [&]() {  // under mu_
    size_t kept = 0;
    for (const auto& [req, index] : pending) {
      const ucs_status_t s = ucp_request_check_status(req);
      if (s == UCS_INPROGRESS) {
        pending[kept++] = {req, index};
        continue;
      }
      if (s != UCS_OK && status.ok()) status = UcxError("reading the peer's blocks", s);
      if (s == UCS_OK) done.push_back(index);
      ucp_request_free(req);
    }
    pending.resize(kept);
  };
  // Reads done are reported without mu_ (the caller checks their bytes meanwhile).
  auto report = [&] {
    for (size_t i = 0; i < done.size() && status.ok() && on_read; ++i) status = on_read(done[i]);
    done.clear();
  };
  report();
  while (status.ok() && (!pending.empty() || next < reads.size())) {
    if (ep_error.load() != UCS_OK) {
      status = UcxError("the connection to the peer failed", static_cast<ucs_status_t>(ep_error.load()));
      break;
    }
    if (absl::Now() >= deadline) {
      status = absl::DeadlineExceededError(absl::StrCat(pending.size(), " reads from the peer still in flight at the deadline"));
      break;
    }
    const bool progressed = ProgressOnce();
    {
      absl::MutexLock lock(&mu_);
      reap();
      issue();
    }
    report();
    if (!progressed) std::this_thread::yield();
  }
  // Close: flushed when all went well, by force otherwise, which cancels reads still in flight.
  // Either way, wait until the close and every read completed: only then can nothing land in the
  // destination any more.
  void* close_req = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (status.ok()) {
      for (ucp_rkey_h k : unpacked) {
        if (k != nullptr) ucp_rkey_destroy(k);
      }
      unpacked.clear();
    }
    ucp_request_param_t close_param{};
    close_param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    close_param.flags = status.ok() ? 0 : UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &close_param);
    if (UCS_PTR_IS_PTR(r)) close_req = r;
  }
  const absl::Time give_up = absl::Now() + kCancelWait;
  bool settled = false;
  while (absl::Now() < give_up) {
    const bool progressed = ProgressOnce();
    absl::MutexLock lock(&mu_);
    reap();
    if (close_req != nullptr && ucp_request_check_status(close_req) != UCS_INPROGRESS) {
      ucp_request_free(close_req);
      close_req = nullptr;
    }
    if (close_req == nullptr && pending.empty()) {
      settled = true;
      break;
    }
    if (!progressed) std::this_thread::yield();
  }
  {
    absl::MutexLock lock(&mu_);
    for (ucp_rkey_h k : unpacked) {
      if (k != nullptr) ucp_rkey_destroy(k);
    }
  }
  if (!settled) {
    return absl::InternalError(absl::StrCat("reads from the peer did not settle within ", absl::FormatDuration(kCancelWait),
                                            " of closing the connection (", status.ToString(), ")"));
  }
  return status;
}

}  // namespace kvd
