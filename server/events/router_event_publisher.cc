#include "server/events/router_event_publisher.h"

#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "proto/vocab/status_macros.h"
#include "server/core/kv_cache.h"
#include "server/events/router_event_encoding.h"
#include "spdlog/spdlog.h"

namespace kvd {
namespace {

std::string BigEndian8(int64_t v) {
  std::string out(8, '\0');
  const uint64_t u = static_cast<uint64_t>(v);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((u >> (8 * (7 - i))) & 0xff);
  return out;
}

int64_t FromBigEndian8(const uint8_t* p) {
  uint64_t u = 0;
  for (int i = 0; i < 8; ++i) u = (u << 8) | p[i];
  return static_cast<int64_t>(u);
}

// Sends `frames` as one multipart message. False when ZMQ refused (logged by the caller).
bool SendFrames(void* socket, const std::vector<std::string_view>& frames, int flags = 0) {
  for (size_t i = 0; i < frames.size(); ++i) {
    const int more = i + 1 < frames.size() ? ZMQ_SNDMORE : 0;
    if (zmq_send(socket, frames[i].data(), frames[i].size(), more | flags) < 0) return false;
  }
  return true;
}

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

const std::string kDiskMedium = "DISK";

std::string RenderTopic(const RouterEventsOptions& o, const std::string& node, const std::string& pool) {
  return absl::StrReplaceAll(o.topic, {{"{node}", node}, {"{pool}", pool}});
}

}  // namespace

bool RouterEndpointBinds(const std::string& endpoint, const std::string& mode) {
  if (mode == "bind") return true;
  if (mode == "connect") return false;
  // vLLM's ZmqEventPublisher._socket_setup (vllm/distributed/kv_events.py at 0181ea3173e5).
  return absl::StrContains(endpoint, "*") || absl::StrContains(endpoint, "::") ||
         absl::StartsWith(endpoint, "ipc://") || absl::StartsWith(endpoint, "inproc://");
}

absl::Status CheckRouterEventsOptions(const RouterEventsOptions& o) {
  if (o.endpoint_mode != "auto" && o.endpoint_mode != "bind" && o.endpoint_mode != "connect") {
    return absl::InvalidArgumentError(
        absl::StrCat("router_events.endpoint_mode must be auto, bind or connect, not '", o.endpoint_mode, "'"));
  }
  const std::string node = o.node.empty() ? HostName() : o.node;
  for (const std::string& a : o.pools) {
    for (const std::string& b : o.pools) {
      if (a == b) continue;
      const std::string ta = RenderTopic(o, node, a);
      const std::string tb = RenderTopic(o, node, b);
      if (absl::StartsWith(tb, ta)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "router_events.topic: pool '", a, "' publishes on '", ta, "', a prefix of pool '", b, "''s topic '", tb,
            "' (a ZMQ subscription matches prefixes, so a router subscribed to one would receive both): rename a "
            "pool, or change router_events.topic"));
      }
    }
  }
  for (const auto& [pool, medium] : o.medium) {
    if (!pool.empty() && std::find(o.pools.begin(), o.pools.end(), pool) == o.pools.end()) {
      return absl::InvalidArgumentError(absl::StrCat("router_events.medium: no pool named '", pool, "'"));
    }
    if (medium.empty() || !std::all_of(medium.begin(), medium.end(), [](char c) {
          return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_';
        })) {
      return absl::InvalidArgumentError(absl::StrCat("router_events.medium", pool.empty() ? "" : " of pool '", pool,
                                                     pool.empty() ? "" : "'", " must be a word such as GPU or CPU, not '",
                                                     medium, "'"));
    }
  }
  return absl::OkStatus();
}

// The router events of one pool, in order, while a batch is being assembled.
struct RouterEventPublisher::Batch {
  double ts = 0;
  std::vector<RouterEvent> events;
  BlockKey last_key;  // of the last block stored in events.back(), to extend its chain
  int64_t size() const { return static_cast<int64_t>(events.size()); }
};

absl::StatusOr<std::unique_ptr<RouterEventPublisher>> RouterEventPublisher::Start(
    RouterEventsOptions options) {
  if (options.endpoint.empty()) return absl::InvalidArgumentError("router_events.endpoint is empty");
  if (options.buffer_batches < 1) return absl::InvalidArgumentError("router_events.buffer_batches must be >= 1");
  if (options.max_batch_events < 1) return absl::InvalidArgumentError("router_events.max_batch_events must be >= 1");
  KVD_RETURN_IF_ERROR(CheckRouterEventsOptions(options));
  if (options.node.empty()) options.node = HostName();
  std::unique_ptr<RouterEventPublisher> p(new RouterEventPublisher(std::move(options)));
  const RouterEventsOptions& o = p->options_;
  p->ctx_ = zmq_ctx_new();
  if (p->ctx_ == nullptr) return absl::InternalError(absl::StrCat("zmq_ctx_new: ", zmq_strerror(errno)));
  p->pub_ = zmq_socket(p->ctx_, ZMQ_PUB);
  const int hwm = static_cast<int>(o.send_hwm);
  const int linger = 0;
  zmq_setsockopt(p->pub_, ZMQ_SNDHWM, &hwm, sizeof(hwm));
  zmq_setsockopt(p->pub_, ZMQ_LINGER, &linger, sizeof(linger));
  const bool bind = RouterEndpointBinds(o.endpoint, o.endpoint_mode);
  if ((bind ? zmq_bind(p->pub_, o.endpoint.c_str()) : zmq_connect(p->pub_, o.endpoint.c_str())) != 0) {
    return absl::UnavailableError(absl::StrCat("router_events.endpoint ", o.endpoint, " (", bind ? "bind" : "connect",
                                               "): ", zmq_strerror(errno)));
  }
  if (!o.replay_endpoint.empty()) {
    p->replay_ = zmq_socket(p->ctx_, ZMQ_ROUTER);
    zmq_setsockopt(p->replay_, ZMQ_LINGER, &linger, sizeof(linger));
    if (zmq_bind(p->replay_, o.replay_endpoint.c_str()) != 0) {
      return absl::UnavailableError(absl::StrCat("router_events.replay_endpoint ", o.replay_endpoint, ": ",
                                                 zmq_strerror(errno)));
    }
  }
  p->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (p->wake_fd_ < 0) return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  p->thread_ = std::thread([raw = p.get()] { raw->Run(); });
  spdlog::info("router events {} {} (replay {}), topic {}", bind ? "bound to" : "connecting to", o.endpoint,
               o.replay_endpoint.empty() ? "off" : o.replay_endpoint, o.topic);
  return p;
}

RouterEventPublisher::RouterEventPublisher(RouterEventsOptions options)
    : options_(std::move(options)), hasher_(options_.hash_seed) {}

RouterEventPublisher::~RouterEventPublisher() {
  if (cache_ != nullptr) cache_->RemoveListenerAndWait(listener_);
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
  if (pub_ != nullptr) zmq_close(pub_);
  if (replay_ != nullptr) zmq_close(replay_);
  if (ctx_ != nullptr) zmq_ctx_term(ctx_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void RouterEventPublisher::Attach(KvCache* cache) {
  cache_ = cache;
  for (const PoolGeometry& g : cache->pools()) {
    pools_.push_back(g.name);
    model_fingerprints_[g.name] = g.model_fingerprint;
    if (g.hybrid()) groups_[g.name] = SpineGroupOf(g);
  }
  listener_ = cache->AddEventListener([this](const CacheEvent& e) { Enqueue(e); });
}

void RouterEventPublisher::Enqueue(const CacheEvent& event) {
  {
    absl::MutexLock lock(&mu_);
    if (static_cast<int64_t>(queue_.size()) >= options_.max_queued_events) {
      overflowed_ = true;
      absl::MutexLock s(&stats_mu_);
      ++stats_.dropped;
      return;
    }
    queue_.push_back(event);
  }
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
}

RouterEventStats RouterEventPublisher::Stats() const {
  absl::MutexLock lock(&stats_mu_);
  return stats_;
}

RouterEventGroup SpineGroupOf(const PoolGeometry& g) {
  // The engine's events of a hybrid pool are its spine's: one node per block position, keyed by
  // the first full group's block (docs/hybrid.md §2.6). A pool without a full group indexes no
  // prefix and emits none; its first group stands in.
  size_t spine = 0;
  for (size_t i = 0; i < g.groups.size(); ++i) {
    if (g.groups[i].kind == KvGroupKind::kFull) {
      spine = i;
      break;
    }
  }
  const KvGroup& k = g.groups[spine];
  RouterEventGroup out;
  out.index = static_cast<int32_t>(spine);
  out.kind = RouterSpecKind(KvGroupKindName(k.kind));
  out.sliding_window = k.kind == KvGroupKind::kSlidingWindow ? k.window : 0;
  return out;
}

std::optional<RouterEventGroup> RouterEventPublisher::GroupOf(const std::string& pool) const {
  const auto it = groups_.find(pool);
  if (it == groups_.end()) return std::nullopt;
  return it->second;
}

std::string RouterEventPublisher::TopicOf(const std::string& pool) const {
  return RenderTopic(options_, options_.node, pool);
}

const std::string& RouterEventPublisher::MediumOf(const std::string& pool) const {
  auto it = options_.medium.find(pool);
  if (it == options_.medium.end()) it = options_.medium.find("");  // one word for every pool
  return it != options_.medium.end() ? it->second : options_.device_medium;
}

void RouterEventPublisher::Run() {
  zmq_pollitem_t items[2] = {};
  items[0].fd = wake_fd_;
  items[0].events = ZMQ_POLLIN;
  items[1].socket = replay_;
  items[1].events = ZMQ_POLLIN;
  const int n = replay_ != nullptr ? 2 : 1;
  for (;;) {
    if (zmq_poll(items, n, 1000) < 0 && errno != EINTR) {
      spdlog::error("router events: zmq_poll: {}", zmq_strerror(errno));
      absl::SleepFor(absl::Milliseconds(100));
    }
    if (n == 2 && (items[1].revents & ZMQ_POLLIN) != 0) ServeReplay();
    uint64_t wakes = 0;
    (void)!read(wake_fd_, &wakes, sizeof(wakes));
    std::vector<CacheEvent> events;
    bool overflowed = false;
    bool stopping = false;
    {
      absl::MutexLock lock(&mu_);
      events.swap(queue_);
      overflowed = overflowed_;
      overflowed_ = false;
      stopping = stopping_;
    }
    if (overflowed) {
      // Events were lost: tell routers to forget this node, and start the hash chains afresh.
      CacheEvent cleared;
      cleared.kind = CacheEventKind::kCleared;
      events.insert(events.begin(), cleared);
    }
    if (!events.empty()) Publish(std::move(events));
    if (stopping) return;
  }
}

void RouterEventPublisher::Publish(std::vector<CacheEvent> events) {
  // Batches are per pool (the topic names the pool); a batch is sent when the pool changes, when
  // it is full, and at the end, so the sequence order is the cache's event order.
  std::string pool;
  Batch batch;
  auto flush = [&] {
    if (!batch.events.empty()) Send(pool, batch);
    batch = Batch{};
  };
  auto start = [&](const std::string& p, absl::Time t) {
    if (p != pool || batch.size() >= options_.max_batch_events) flush();
    pool = p;
    if (batch.events.empty()) batch.ts = absl::ToDoubleSeconds(t - absl::UnixEpoch());
  };
  uint64_t unhashable = 0;
  for (CacheEvent& e : events) {
    switch (e.kind) {
      case CacheEventKind::kCleared: {
        known_.clear();
        for (auto& [pool_name, topic] : topics_) topic.live.clear();
        for (const std::string& p : pools_) {
          start(p, e.time);
          batch.events.push_back(RouterEvent{CacheEventKind::kCleared});
        }
        break;
      }
      case CacheEventKind::kStored: {
        const RouterHash* parent = nullptr;
        int64_t depth = 0;
        if (e.has_parent) {
          auto it = known_.find(e.parent_key);
          if (it == known_.end()) {
            ++unhashable;
            break;
          }
          parent = &it->second.hash;
          depth = it->second.depth + 1;
        }
        const int64_t start_pos = depth * e.block_tokens;
        const auto fingerprint = model_fingerprints_.find(e.pool);
        const std::vector<RouterExtraKey> extra =
            RouterExtraKeys(e.adapter, e.media_keys, e.cache_salt, e.method, start_pos, start_pos + e.block_tokens,
                            fingerprint != model_fingerprints_.end() ? fingerprint->second : std::string());
        const RouterHash h = hasher_.BlockHash(parent, e.tokens, extra);
        const uint64_t parent_id = parent != nullptr ? RouterHasher::EventId(*parent) : 0;
        Known& k = known_[e.key];
        k.hash = h;
        k.depth = depth;
        ++k.stored;
        const std::string& medium = e.medium == "disk" ? kDiskMedium : MediumOf(e.pool);
        if (++topics_[e.pool].live[{RouterHasher::EventId(h), medium}] > 1) break;  // the router has it already
        start(e.pool, e.time);
        RouterEvent* last = batch.events.empty() ? nullptr : &batch.events.back();
        if (last != nullptr && last->kind == CacheEventKind::kStored && e.has_parent &&
            batch.last_key == e.parent_key && last->medium == medium && last->lora_name == e.adapter) {
          last->ids.push_back(RouterHasher::EventId(h));
          last->tokens.insert(last->tokens.end(), e.tokens.begin(), e.tokens.end());
        } else {
          RouterEvent out{CacheEventKind::kStored, medium};
          out.ids.push_back(RouterHasher::EventId(h));
          out.has_parent = parent != nullptr;
          out.parent_id = parent_id;
          out.tokens = std::move(e.tokens);
          out.block_size = e.block_tokens;
          out.lora_name = e.adapter;
          out.group = GroupOf(e.pool);
          batch.events.push_back(std::move(out));
        }
        batch.last_key = e.key;
        break;
      }
      case CacheEventKind::kRemoved: {
        auto it = known_.find(e.key);
        if (it == known_.end()) break;  // never announced
        const uint64_t id = RouterHasher::EventId(it->second.hash);
        if (--it->second.stored <= 0) known_.erase(it);
        const std::string& medium = MediumOf(e.pool);
        auto& live = topics_[e.pool].live;
        auto lit = live.find(std::make_pair(id, medium));
        if (lit != live.end() && --lit->second > 0) break;  // another cached block still has this id
        if (lit != live.end()) live.erase(lit);
        start(e.pool, e.time);
        RouterEvent* last = batch.events.empty() ? nullptr : &batch.events.back();
        if (last != nullptr && last->kind == CacheEventKind::kRemoved && last->medium == medium) {
          last->ids.push_back(id);
        } else {
          RouterEvent out{CacheEventKind::kRemoved, medium};
          out.ids.push_back(id);
          out.group = GroupOf(e.pool);
          batch.events.push_back(std::move(out));
        }
        break;
      }
    }
  }
  flush();
  if (unhashable > 0) {
    absl::MutexLock lock(&stats_mu_);
    stats_.unhashable += unhashable;
  }
}

void RouterEventPublisher::Send(const std::string& pool, const Batch& batch) {
  std::string payload =
      EncodeRouterBatch(batch.ts, batch.events, options_.data_parallel_rank, options_.format == "vllm-map");
  Topic& topic = topics_[pool];
  if (topic.name.empty()) topic.name = TopicOf(pool);
  const uint64_t seq = topic.next_sequence++;
  const std::string seq_bytes = BigEndian8(static_cast<int64_t>(seq));
  if (!SendFrames(pub_, {topic.name, seq_bytes, payload})) {
    spdlog::warn("router events: send of batch {} of {} failed: {}", seq, topic.name, zmq_strerror(errno));
  }
  topic.buffer.push_back(Buffered{seq, std::move(payload)});
  while (static_cast<int64_t>(topic.buffer.size()) > options_.buffer_batches) topic.buffer.pop_front();
  absl::MutexLock lock(&stats_mu_);
  ++stats_.batches;
  stats_.events += batch.events.size();
  stats_.last_sequence = seq;
}

void RouterEventPublisher::ServeReplay() {
  for (;;) {
    std::vector<std::string> frames;
    int more = 1;
    while (more != 0) {
      zmq_msg_t msg;
      zmq_msg_init(&msg);
      if (zmq_msg_recv(&msg, replay_, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&msg);
        return;  // nothing (more) to read
      }
      frames.emplace_back(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
      more = zmq_msg_more(&msg);
      zmq_msg_close(&msg);
    }
    {
      absl::MutexLock lock(&stats_mu_);
      ++stats_.replay_requests;
    }
    // [identity, "", start] for every topic, or [identity, "", topic, start] for one.
    if ((frames.size() != 3 && frames.size() != 4) || frames.back().size() != 8) {
      spdlog::warn("router events: ignoring a replay request of {} frames (want identity, empty, [topic,] "
                   "8-byte start sequence)", frames.size());
      continue;
    }
    const std::string& identity = frames[0];
    const int64_t start = FromBigEndian8(reinterpret_cast<const uint8_t*>(frames.back().data()));
    const std::string* only = frames.size() == 4 ? &frames[2] : nullptr;
    const bool topic_frame = options_.replay_topic_frame;
    uint64_t sent = 0;
    bool ok = true;
    for (const std::string& pool : pools_) {
      auto it = topics_.find(pool);
      if (it == topics_.end() || (only != nullptr && it->second.name != *only)) continue;
      const Topic& t = it->second;
      for (const Buffered& b : t.buffer) {
        if (static_cast<int64_t>(b.sequence) < start) continue;
        const std::string seq = BigEndian8(static_cast<int64_t>(b.sequence));
        ok = topic_frame ? SendFrames(replay_, {identity, "", t.name, seq, b.payload})
                         : SendFrames(replay_, {identity, "", seq, b.payload});
        if (!ok) break;
        ++sent;
      }
      if (!ok) break;
    }
    if (topic_frame) {
      SendFrames(replay_, {identity, "", "", BigEndian8(-1), ""});
    } else {
      SendFrames(replay_, {identity, "", BigEndian8(-1), ""});
    }
    absl::MutexLock lock(&stats_mu_);
    stats_.replayed_batches += sent;
  }
}

}  // namespace kvd
