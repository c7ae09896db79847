#include "server/store/remote_tier.h"

#include <cstdlib>
#include <fstream>

#include <hiredis/hiredis.h>
#include <sys/time.h>
#include <xxhash.h>

#include <algorithm>
#include <optional>
#include <string_view>

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "proto/vocab/status_macros.h"
#include "spdlog/spdlog.h"

namespace kvd {

void RemoteTier::ReplyDeleter::operator()(redisReply* r) const { freeReplyObject(r); }

class RemoteTier::Connection {
 public:
  explicit Connection(redisContext* c) : c_(c) {}
  ~Connection() { redisFree(c_); }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  void Append(std::initializer_list<std::string_view> args) {
    const char* argv[8];
    size_t len[8];
    int n = 0;
    for (std::string_view a : args) {
      argv[n] = a.data();
      len[n] = a.size();
      ++n;
    }
    redisAppendCommandArgv(c_, n, argv, len);
  }
  // The next reply; UNAVAILABLE (the connection is then unusable) on I/O or protocol failure.
  absl::StatusOr<Reply> Read() {
    void* r = nullptr;
    if (redisGetReply(c_, &r) != REDIS_OK || r == nullptr) {
      return absl::UnavailableError(c_->errstr[0] != '\0' ? c_->errstr : "connection lost");
    }
    return Reply(static_cast<redisReply*>(r));
  }
  // Runs one command and checks its reply is not an error.
  absl::StatusOr<Reply> Command(std::initializer_list<std::string_view> args) {
    Append(args);
    absl::StatusOr<Reply> r = Read();
    if (r.ok() && (*r)->type == REDIS_REPLY_ERROR) {
      return absl::UnavailableError(std::string((*r)->str, (*r)->len));
    }
    return r;
  }

 private:
  redisContext* c_;
};

std::string RedactUrl(absl::string_view url) {
  const absl::string_view scheme = absl::StartsWith(url, "redis://")           ? "redis://"
                                   : absl::StartsWith(url, "redis-cluster://") ? "redis-cluster://"
                                                                               : "";
  if (scheme.empty()) return std::string(url);
  const absl::string_view rest = url.substr(scheme.size());
  const size_t at = rest.rfind('@');
  if (at == absl::string_view::npos) return std::string(url);
  const absl::string_view auth = rest.substr(0, at);
  const size_t colon = auth.find(':');
  const absl::string_view user = colon == absl::string_view::npos ? "" : auth.substr(0, colon);
  return absl::StrCat(scheme, user, ":***@", rest.substr(at + 1));
}

absl::StatusOr<std::unique_ptr<RemoteTier>> RemoteTier::Open(RemoteTierOptions options) {
  if (options.clock == nullptr) options.clock = SystemClock::Get();
  std::unique_ptr<RemoteTier> t(new RemoteTier(options));
  const std::string url = RedactUrl(t->options_.url);  // for messages; parsing reads options_.url
  const std::string& raw = t->options_.url;
  if (absl::StartsWith(raw, "unix://")) {
    t->unix_path_ = raw.substr(7);
    if (t->unix_path_.empty() || t->unix_path_[0] != '/') {
      return absl::InvalidArgumentError(absl::StrCat("tiers.redis_url: want unix:///absolute/path, not '", url, "'"));
    }
  } else if (absl::StartsWith(raw, "redis://") || absl::StartsWith(raw, "redis-cluster://")) {
    t->cluster_ = absl::StartsWith(raw, "redis-cluster://");
    std::string rest = raw.substr(t->cluster_ ? 16 : 8);
    if (size_t at = rest.rfind('@'); at != std::string::npos) {
      std::string auth = rest.substr(0, at);
      rest = rest.substr(at + 1);
      // [user]:password (Redis 6 ACL user) or a bare password.
      if (size_t colon = auth.find(':'); colon != std::string::npos) {
        t->username_ = auth.substr(0, colon);
        t->password_ = auth.substr(colon + 1);
      } else {
        t->password_ = auth;
      }
    }
    if (t->cluster_) {
      // Seed nodes; a cluster has database 0 only.
      if (rest.find('/') != std::string::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat("tiers.redis_url: a Redis Cluster has no database number: '", url, "'"));
      }
      for (absl::string_view node : absl::StrSplit(rest, ',', absl::SkipEmpty())) {
        absl::StatusOr<RedisEndpoint> ep = ParseRedisEndpoint(node);
        if (!ep.ok()) {
          return absl::InvalidArgumentError(
              absl::StrCat("tiers.redis_url: cluster node ", ep.status().message(), " in '", url, "'"));
        }
        t->seeds_.push_back(*std::move(ep));
      }
      if (t->seeds_.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("tiers.redis_url: no cluster node in '", url, "'"));
      }
      rest.clear();
    } else if (size_t slash = rest.find('/'); slash != std::string::npos) {
      if (!absl::SimpleAtoi(rest.substr(slash + 1), &t->db_) || t->db_ < 0) {
        return absl::InvalidArgumentError(absl::StrCat("tiers.redis_url: bad database number in '", url, "'"));
      }
      rest = rest.substr(0, slash);
    }
    if (size_t colon = rest.rfind(':'); colon != std::string::npos) {
      if (!absl::SimpleAtoi(rest.substr(colon + 1), &t->port_) || t->port_ <= 0 || t->port_ > 65535) {
        return absl::InvalidArgumentError(absl::StrCat("tiers.redis_url: bad port in '", url, "'"));
      }
      rest = rest.substr(0, colon);
    }
    t->host_ = rest;
    if (t->host_.empty() && !t->cluster_) {
      return absl::InvalidArgumentError(absl::StrCat("tiers.redis_url: no host in '", url, "'"));
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "tiers.redis_url: want redis://host:port[/db], unix:///path or redis-cluster://host:port,..., not '", url, "'"));
  }
  if (!t->options_.password_file.empty()) {
    std::ifstream in(t->options_.password_file);
    std::string line;
    if (!in || !std::getline(in, line)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tiers.redis_password_file: cannot read ", t->options_.password_file));
    }
    t->password_ = line;
  } else if (const char* env = std::getenv("KVD_REDIS_PASSWORD"); env != nullptr && *env != '\0') {
    t->password_ = env;
  }
  if (!t->options_.secret_file.empty()) {
    std::ifstream in(t->options_.secret_file);
    std::string line;
    if (!in || !std::getline(in, line) || line.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tiers.redis_secret_file: cannot read a secret from ", t->options_.secret_file));
    }
    t->secret_ = line;
  }
  if (!t->options_.encryption_key_file.empty()) {
    absl::StatusOr<std::unique_ptr<ValueCipher>> cipher = ValueCipher::Load(t->options_.encryption_key_file);
    if (!cipher.ok()) return cipher.status();
    t->cipher_ = *std::move(cipher);
  }
  if (t->options_.key_prefix.empty()) return absl::InvalidArgumentError("tiers.redis_key_prefix is empty");
  if (t->options_.ttl < absl::Seconds(1)) return absl::InvalidArgumentError("tiers.redis_ttl_s must be >= 1");
  {
    absl::MutexLock lock(&t->mu_);
    t->stats_.available = true;
    t->stats_.cluster = t->cluster_;
  }
  return t;
}

RemoteTier::RemoteTier(RemoteTierOptions options) : options_(std::move(options)) {}
RemoteTier::~RemoteTier() = default;

std::string RemoteTier::display_url() const { return RedactUrl(options_.url); }

std::string RemoteTier::ValueDigest(const BlockKey& root_key, const BlockKey& key, const BlockKey* parent,
                                    absl::Span<const Token> tokens) const {
  std::string msg;
  msg.reserve(48 + tokens.size() * 4);
  const auto put_key = [&msg](const BlockKey& k) {
    for (uint64_t part : {k.hi, k.lo}) {
      for (int b = 0; b < 8; ++b) msg.push_back(static_cast<char>((part >> (8 * b)) & 0xff));
    }
  };
  put_key(root_key);
  put_key(key);
  put_key(parent != nullptr ? *parent : BlockKey{});
  for (Token t : tokens) {
    for (int b = 0; b < 4; ++b) msg.push_back(static_cast<char>((t >> (8 * b)) & 0xff));
  }
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret_.data(), static_cast<int>(secret_.size()),
       reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), mac, &len);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(mac), len));
}

std::string RemoteTier::KeyName(const Namespace& ns, absl::string_view model_fingerprint, const BlockKey& key,
                                uint64_t unit_layout) const {
  const std::string salt =
      ns.cache_salt.empty() ? "-" : absl::StrFormat("%016x", XXH3_64bits(ns.cache_salt.data(), ns.cache_salt.size()));
  const std::string model =
      model_fingerprint.empty()
          ? ""
          : absl::StrFormat("@%016x", XXH3_64bits(model_fingerprint.data(), model_fingerprint.size()));
  const std::string unit = unit_layout == 0 ? "" : absl::StrFormat("@u%016x", unit_layout);
  return absl::StrCat(options_.key_prefix, ":", ns.pool, model, unit, ":", salt, ":", key.ToHex());
}

bool RemoteTier::available() const { return absl::ToUnixNanos(options_.clock->Now()) >= down_until_ns_.load(std::memory_order_relaxed); }

absl::Status RemoteTier::Fail(const std::string& what) {
  down_until_ns_.store(absl::ToUnixNanos(options_.clock->Now()) + absl::ToInt64Nanoseconds(options_.retry_after), std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  ++stats_.errors;
  stats_.failing = true;
  if (stats_.last_error != what) {
    spdlog::warn("redis tier {}: {}; skipped for {}", display_url(), what, absl::FormatDuration(options_.retry_after));
  }
  stats_.last_error = what;
  idle_.clear();        // a failure usually means a server went away: reconnect afresh
  slots_stale_ = true;  // and, in a cluster, its slots may have moved (a replica promoted)
  return absl::UnavailableError(absl::StrCat("redis tier: ", what));
}

absl::Status RemoteTier::Begin() {
  absl::MutexLock lock(&mu_);
  ++stats_.calls;
  if (!available()) {
    ++stats_.skipped;
    return absl::UnavailableError("redis tier: skipped after a recent failure");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<RemoteTier::Connection>> RemoteTier::Connect(const RedisEndpoint* node) {
  const timeval connect_tv = absl::ToTimeval(options_.connect_timeout);
  redisContext* raw = node != nullptr      ? redisConnectWithTimeout(node->host.c_str(), node->port, connect_tv)
                      : unix_path_.empty() ? redisConnectWithTimeout(host_.c_str(), port_, connect_tv)
                                           : redisConnectUnixWithTimeout(unix_path_.c_str(), connect_tv);
  const std::string where = node != nullptr ? absl::StrCat(" ", node->name()) : "";
  if (raw == nullptr) return absl::UnavailableError("cannot allocate a connection");
  auto c = std::make_unique<Connection>(raw);
  if (raw->err != 0) return absl::UnavailableError(absl::StrCat("connect", where, ": ", raw->errstr));
  redisSetTimeout(raw, absl::ToTimeval(options_.io_timeout));
  // TCP keep-alive only: on an AF_UNIX socket hiredis fails the call and marks the context failed.
  if (raw->connection_type == REDIS_CONN_TCP) redisEnableKeepAlive(raw);
  if (!password_.empty()) {
    absl::StatusOr<Reply> r = username_.empty() ? c->Command({"AUTH", password_})
                                                : c->Command({"AUTH", username_, password_});
    if (!r.ok()) return absl::UnavailableError(absl::StrCat("AUTH", where, ": ", r.status().message()));
  }
  if (db_ != 0) {
    const std::string db = std::to_string(db_);
    if (absl::StatusOr<Reply> r = c->Command({"SELECT", db}); !r.ok()) {
      return absl::UnavailableError(absl::StrCat("SELECT: ", r.status().message()));
    }
  }
  CheckMemoryPolicy(*c);
  return c;
}

absl::StatusOr<std::unique_ptr<RemoteTier::Connection>> RemoteTier::Take(const RedisEndpoint* node) {
  {
    absl::MutexLock lock(&mu_);
    auto it = idle_.find(node != nullptr ? node->name() : std::string());
    if (it != idle_.end() && !it->second.empty()) {
      std::unique_ptr<Connection> c = std::move(it->second.back());
      it->second.pop_back();
      return c;
    }
  }
  absl::StatusOr<std::unique_ptr<Connection>> c = Connect(node);
  if (!c.ok()) return Fail(std::string(c.status().message()));
  return c;
}

void RemoteTier::CheckMemoryPolicy(Connection& c) {
  // CONFIG GET answers [name, value] (RESP2); a managed Redis may refuse CONFIG (NOPERM, renamed).
  auto get = [&c](std::string_view name) -> std::optional<std::string> {
    absl::StatusOr<Reply> r = c.Command({"CONFIG", "GET", name});
    if (!r.ok() || (*r)->type != REDIS_REPLY_ARRAY || (*r)->elements != 2 ||
        (*r)->element[1]->type != REDIS_REPLY_STRING) {
      spdlog::debug("redis tier: CONFIG GET {} not answered; its memory policy is not checked", name);
      return std::nullopt;
    }
    return std::string((*r)->element[1]->str, (*r)->element[1]->len);
  };
  const std::optional<std::string> policy = get("maxmemory-policy");
  const std::optional<std::string> maxmemory = get("maxmemory");
  int64_t bytes = -1;
  if (maxmemory.has_value() && !absl::SimpleAtoi(*maxmemory, &bytes)) bytes = -1;
  absl::MutexLock lock(&mu_);
  if (policy.has_value()) stats_.eviction_policy = *policy;
  stats_.maxmemory = bytes;
  if (warned_policy_ || !policy.has_value()) return;
  if (*policy == "noeviction" || bytes == 0) {
    warned_policy_ = true;
    spdlog::warn("redis tier {}: maxmemory {} with maxmemory-policy {}: {}", display_url(),
                 bytes == 0 ? "unbounded" : std::to_string(bytes), *policy,
                 *policy == "noeviction"
                     ? "when Redis fills it refuses new prefixes (OOM, counted and skipped) instead of evicting "
                       "old ones; set allkeys-lru or volatile-lru"
                     : "Redis grows until the host runs out of memory; set maxmemory");
  }
}

void RemoteTier::Return(const RedisEndpoint* node, std::unique_ptr<Connection> c) {
  absl::MutexLock lock(&mu_);
  std::vector<std::unique_ptr<Connection>>& pool = idle_[node != nullptr ? node->name() : std::string()];
  if (pool.size() < 8) pool.push_back(std::move(c));
}

absl::StatusOr<std::shared_ptr<const RedisSlotMap>> RemoteTier::Slots() {
  std::vector<RedisEndpoint> ask;
  {
    absl::MutexLock lock(&mu_);
    if (slots_ != nullptr && !slots_stale_) return slots_;
    if (slots_ != nullptr) ask = slots_->masters();
  }
  ask.insert(ask.end(), seeds_.begin(), seeds_.end());
  std::string last_error = "no node to ask";
  for (const RedisEndpoint& node : ask) {
    absl::StatusOr<std::unique_ptr<Connection>> c = Connect(&node);
    if (!c.ok()) {
      last_error = std::string(c.status().message());
      continue;
    }
    absl::StatusOr<Reply> r = (*c)->Command({"CLUSTER", "SLOTS"});
    if (!r.ok()) {
      last_error = absl::StrCat("CLUSTER SLOTS on ", node.name(), ": ", r.status().message());
      continue;
    }
    absl::StatusOr<RedisSlotMap> map = RedisSlotMap::FromClusterSlots(**r, node.host);
    if (!map.ok()) {
      last_error = std::string(map.status().message());
      continue;
    }
    auto shared = std::make_shared<const RedisSlotMap>(*std::move(map));
    absl::MutexLock lock(&mu_);
    slots_ = shared;
    slots_stale_ = false;
    ++stats_.slot_refreshes;
    stats_.cluster_masters = static_cast<int64_t>(shared->masters().size());
    return shared;
  }
  return Fail(absl::StrCat("no cluster node gave its slot map (", last_error, ")"));
}

absl::Status RemoteTier::FollowRedirect(size_t key, int per_key, const AppendFn& append,
                                        std::vector<Reply>& replies) {
  for (int hop = 0; hop < 4; ++hop) {
    if (replies[0] == nullptr || replies[0]->type != REDIS_REPLY_ERROR) return absl::OkStatus();
    const std::optional<RedisRedirect> to =
        ParseRedisRedirect(absl::string_view(replies[0]->str, replies[0]->len));
    if (!to.has_value()) return absl::OkStatus();  // another error: the caller's to judge
    {
      absl::MutexLock lock(&mu_);
      if (to->ask) {
        ++stats_.asked;
      } else {
        ++stats_.moved;
        slots_stale_ = true;  // the slot has a new owner: read the map again before the next call
      }
    }
    absl::StatusOr<std::unique_ptr<Connection>> c = Take(&to->to);
    if (!c.ok()) return c.status();
    for (int j = 0; j < per_key; ++j) {
      if (to->ask) (*c)->Append({"ASKING"});  // good for the next command only
      append(**c, key, j);
    }
    for (int j = 0; j < per_key; ++j) {
      if (to->ask) {
        absl::StatusOr<Reply> ok = (*c)->Read();
        if (!ok.ok()) return Fail(absl::StrCat("ASKING on ", to->to.name(), ": ", ok.status().message()));
      }
      absl::StatusOr<Reply> r = (*c)->Read();
      if (!r.ok()) return Fail(absl::StrCat(to->to.name(), ": ", r.status().message()));
      replies[static_cast<size_t>(j)] = *std::move(r);
    }
    Return(&to->to, *std::move(c));
  }
  return Fail("a key was redirected more than 4 times");
}

absl::Status RemoteTier::Exchange(const std::vector<std::string>& keys, int per_key, const AppendFn& append,
                                  const DoneFn& done) {
  KVD_RETURN_IF_ERROR(Begin());
  // Which node each key goes to: its slot's master in a cluster, else the one server.
  std::vector<const RedisEndpoint*> nodes = {nullptr};
  std::vector<size_t> node_of(keys.size(), 0);
  std::shared_ptr<const RedisSlotMap> map;
  if (cluster_) {
    absl::StatusOr<std::shared_ptr<const RedisSlotMap>> m = Slots();
    if (!m.ok()) return m.status();
    map = *std::move(m);
    nodes.clear();
    for (size_t i = 0; i < keys.size(); ++i) {
      const RedisEndpoint* node = map->MasterOf(RedisKeySlot(keys[i]));
      if (node == nullptr) return Fail(absl::StrCat("no master serves slot ", RedisKeySlot(keys[i])));
      auto it = std::find(nodes.begin(), nodes.end(), node);
      node_of[i] = static_cast<size_t>(it - nodes.begin());
      if (it == nodes.end()) nodes.push_back(node);
    }
  }
  std::vector<std::unique_ptr<Connection>> conns(nodes.size());
  for (size_t n = 0; n < nodes.size(); ++n) {
    absl::StatusOr<std::unique_ptr<Connection>> c = Take(nodes[n]);
    if (!c.ok()) return c.status();
    conns[n] = *std::move(c);
  }
  // Every node's pipeline goes out before any reply is read: the round trips overlap.
  for (size_t i = 0; i < keys.size(); ++i) {
    for (int j = 0; j < per_key; ++j) append(*conns[node_of[i]], i, j);
  }
  std::vector<Reply> replies(static_cast<size_t>(per_key));
  for (size_t i = 0; i < keys.size(); ++i) {
    Connection& c = *conns[node_of[i]];
    for (int j = 0; j < per_key; ++j) {
      absl::StatusOr<Reply> r = c.Read();
      if (!r.ok()) {
        return Fail(absl::StrCat(nodes[node_of[i]] != nullptr ? nodes[node_of[i]]->name() + ": " : "",
                                 r.status().message()));
      }
      replies[static_cast<size_t>(j)] = *std::move(r);
    }
    if (cluster_) {
      KVD_RETURN_IF_ERROR(FollowRedirect(i, per_key, append, replies));
    } else if (replies[0]->type == REDIS_REPLY_ERROR &&
               ParseRedisRedirect(absl::string_view(replies[0]->str, replies[0]->len)).has_value()) {
      // An operator's slip: a redis:// URL naming one node of a cluster.
      return Fail(absl::StrCat("the server answered '", absl::string_view(replies[0]->str, replies[0]->len),
                               "': it is a Redis Cluster node; name the cluster with redis-cluster://host:port,..."));
    }
    if (absl::Status s = done(i, replies); !s.ok()) return Fail(std::string(s.message()));
  }
  for (size_t n = 0; n < nodes.size(); ++n) Return(nodes[n], std::move(conns[n]));
  absl::MutexLock lock(&mu_);
  stats_.failing = false;
  return absl::OkStatus();
}

absl::StatusOr<int64_t> RemoteTier::RunLength(const std::vector<std::string>& keys) {
  if (keys.empty()) return 0;
  int64_t run = 0;
  bool contiguous = true;
  KVD_RETURN_IF_ERROR(Exchange(
      keys, 1, [&](Connection& c, size_t i, int) { c.Append({"EXISTS", keys[i]}); },
      [&](size_t, std::vector<Reply>& r) {
        if (r[0]->type != REDIS_REPLY_INTEGER) return absl::InternalError("EXISTS: unexpected reply");
        contiguous &= r[0]->integer == 1;
        if (contiguous) ++run;
        return absl::OkStatus();
      }));
  absl::MutexLock lock(&mu_);
  ++stats_.lookups;
  stats_.hit_blocks += static_cast<uint64_t>(run);
  return run;
}

absl::Status RemoteTier::Fetch(const std::vector<std::string>& keys,
                              const std::function<bool(size_t, const absl::string_view*)>& consume) {
  if (keys.empty()) return absl::OkStatus();
  const std::string ttl_ms = std::to_string(absl::ToInt64Milliseconds(options_.ttl));
  uint64_t bytes = 0, blocks = 0;
  bool wanted = true;
  KVD_RETURN_IF_ERROR(Exchange(
      keys, 2,
      [&](Connection& c, size_t i, int j) {
        if (j == 0) {
          c.Append({"GET", keys[i]});
        } else {
          c.Append({"PEXPIRE", keys[i], ttl_ms});
        }
      },
      [&](size_t i, std::vector<Reply>& r) {
        if (r[0]->type != REDIS_REPLY_STRING && r[0]->type != REDIS_REPLY_NIL) {
          return absl::InternalError(absl::StrCat(
              "GET: unexpected reply", r[0]->type == REDIS_REPLY_ERROR ? ": " : "",
              r[0]->type == REDIS_REPLY_ERROR ? std::string(r[0]->str, r[0]->len) : ""));
        }
        if (!wanted) return absl::OkStatus();  // drain the rest of the pipeline so the connection stays usable
        if (r[0]->type == REDIS_REPLY_STRING) {
          const absl::string_view value(r[0]->str, r[0]->len);
          bytes += value.size();
          ++blocks;
          wanted = consume(i, &value);
        } else {
          wanted = consume(i, nullptr);
        }
        r[0].reset();  // one value's memory at a time
        return absl::OkStatus();
      }));
  absl::MutexLock lock(&mu_);
  stats_.fetched_blocks += blocks;
  stats_.fetched_bytes += bytes;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> RemoteTier::Heads(const std::vector<std::string>& keys, int64_t head_bytes,
                                                           bool lookup) {
  std::vector<std::string> heads(keys.size());
  if (keys.empty()) return heads;
  const std::string ttl_ms = std::to_string(absl::ToInt64Milliseconds(options_.ttl));
  const std::string last = std::to_string(std::max<int64_t>(head_bytes, 1) - 1);
  uint64_t run = 0;
  bool contiguous = true;
  KVD_RETURN_IF_ERROR(Exchange(
      keys, 2,
      [&](Connection& c, size_t i, int j) {
        if (j == 0) {
          c.Append({"GETRANGE", keys[i], "0", last});
        } else {
          c.Append({"PEXPIRE", keys[i], ttl_ms});
        }
      },
      [&](size_t i, std::vector<Reply>& r) {
        if (r[0]->type != REDIS_REPLY_STRING && r[0]->type != REDIS_REPLY_NIL) {
          return absl::InternalError(absl::StrCat(
              "GETRANGE: unexpected reply", r[0]->type == REDIS_REPLY_ERROR ? ": " : "",
              r[0]->type == REDIS_REPLY_ERROR ? std::string(r[0]->str, r[0]->len) : ""));
        }
        if (r[0]->type == REDIS_REPLY_STRING) heads[i].assign(r[0]->str, r[0]->len);
        contiguous &= !heads[i].empty();
        run += contiguous ? 1 : 0;
        return absl::OkStatus();
      }));
  absl::MutexLock lock(&mu_);
  if (lookup) {
    ++stats_.lookups;
    stats_.hit_blocks += run;
  }
  return heads;
}

absl::StatusOr<std::vector<bool>> RemoteTier::Refresh(const std::vector<std::string>& keys) {
  std::vector<bool> present(keys.size(), false);
  if (keys.empty()) return present;
  const std::string ttl_ms = std::to_string(absl::ToInt64Milliseconds(options_.ttl));
  uint64_t refreshed = 0;
  KVD_RETURN_IF_ERROR(Exchange(
      keys, 1, [&](Connection& c, size_t i, int) { c.Append({"PEXPIRE", keys[i], ttl_ms}); },
      [&](size_t i, std::vector<Reply>& r) {
        if (r[0]->type != REDIS_REPLY_INTEGER) return absl::InternalError("PEXPIRE: unexpected reply");
        present[i] = r[0]->integer == 1;
        refreshed += present[i] ? 1 : 0;
        return absl::OkStatus();
      }));
  absl::MutexLock lock(&mu_);
  stats_.refreshed_blocks += refreshed;
  return present;
}

absl::Status RemoteTier::Store(const std::vector<std::pair<std::string, std::string>>& items) {
  if (items.empty()) return absl::OkStatus();
  const std::string ttl_ms = std::to_string(absl::ToInt64Milliseconds(options_.ttl));
  std::vector<std::string> keys;
  keys.reserve(items.size());
  for (const auto& item : items) keys.push_back(item.first);
  uint64_t bytes = 0;
  uint64_t stored = 0;
  uint64_t oom = 0;
  std::string oom_reply;
  KVD_RETURN_IF_ERROR(Exchange(
      keys, 1,
      [&](Connection& c, size_t i, int) { c.Append({"SET", items[i].first, items[i].second, "PX", ttl_ms}); },
      [&](size_t i, std::vector<Reply>& r) {
        if (r[0]->type == REDIS_REPLY_ERROR) {
          const absl::string_view error(r[0]->str, r[0]->len);
          if (!absl::StartsWith(error, "OOM")) return absl::InternalError(absl::StrCat("SET: ", error));
          ++oom;  // full under noeviction: this value is skipped; the connection and the tier are fine
          oom_reply = std::string(error);
          return absl::OkStatus();
        }
        bytes += items[i].second.size();
        ++stored;
        return absl::OkStatus();
      }));
  absl::MutexLock lock(&mu_);
  stats_.uploaded_blocks += stored;
  stats_.uploaded_bytes += bytes;
  if (oom == 0) return absl::OkStatus();
  stats_.oom_refusals += oom;
  if (!warned_oom_) {
    warned_oom_ = true;
    spdlog::warn("redis tier {}: Redis is full and refuses new values ({}); uploads are skipped while it is, "
                 "lookups and fetches go on (kvd_remote_oom_refusals_total). Give it maxmemory-policy "
                 "allkeys-lru or volatile-lru to evict old prefixes instead",
                 display_url(), oom_reply);
  }
  return absl::ResourceExhaustedError(absl::StrCat("redis tier: ", oom, " of ", items.size(), " values refused: ", oom_reply));
}

void RemoteTier::CountCorrupt() {
  absl::MutexLock lock(&mu_);
  ++stats_.corrupt;
}

void RemoteTier::CountUploadDropped(uint64_t n) {
  absl::MutexLock lock(&mu_);
  stats_.upload_dropped += n;
}

void RemoteTier::CountRefreshed(uint64_t n) {
  absl::MutexLock lock(&mu_);
  stats_.refreshed_blocks += n;
}

RemoteStats RemoteTier::Stats() const {
  absl::MutexLock lock(&mu_);
  RemoteStats s = stats_;
  s.available = available();
  return s;
}

}  // namespace kvd
