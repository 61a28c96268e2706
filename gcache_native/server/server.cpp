#include "server/server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string_view>
#include <vector>

#include "common/frame.h"
#include "common/msgpack_lite.h"
#include "server/connection.h"
#include "server/io.h"

namespace gcache {
namespace {

constexpr size_t kScratchBytes = 256 << 10;  // discard buffer per connection
constexpr size_t kMetaKeepBytes = 1 << 20;   // larger meta buffers are freed after use
constexpr size_t kMetaFreeBytes = 64 << 10;  // meta buffer bytes not charged to the global budget
// Server::spin_for_frame: only after a request of at most this payload and these keys (a
// client that sends larger ones spends longer on each answer than a spin lasts), and after a
// spin that caught nothing, not for this many frames.
constexpr uint64_t kSpinFrameBytesMax = 64 << 10;
constexpr size_t kSpinFrameKeysMax = 8;
constexpr uint8_t kSpinSkipFrames = 8;
constexpr int kLingerMs = 1000;               // drain time after a fatal error response
constexpr size_t kLingerBytesMax = 16 << 20;  // ... and the most bytes drained
// A cluster map is a few hundred bytes per node; this bound keeps every
// STALE_EPOCH and PING answer far below the clients' 16 MiB metadata limit.
constexpr size_t kClusterMapBytesMax = 4 << 20;
// PING and AUTH requests are a few dozen bytes; before AUTH nothing larger is read.
constexpr uint32_t kUnauthenticatedMetaBytesMax = 4096;

Histogram* histogram_for(Metrics* m, uint8_t opcode) {
  switch (Opcode(opcode)) {
    case Opcode::Ping: return &m->latency_ping;
    case Opcode::Stats: return &m->latency_stats;
    case Opcode::PutBatch: return &m->latency_put_batch;
    case Opcode::GetBatch: return &m->latency_get_batch;
    case Opcode::ExistsBatch: return &m->latency_exists_batch;
    case Opcode::RemoveBatch: return &m->latency_remove_batch;
    case Opcode::Lookup: return &m->latency_lookup;
    case Opcode::Reserve: return &m->latency_reserve;
    case Opcode::Commit: return &m->latency_commit;
    case Opcode::Auth:  // answered before the histograms
    case Opcode::ShmAttach:
    case Opcode::Release:
    case Opcode::RdmaConnect: return nullptr;
  }
  return nullptr;
}

void count_error(Metrics* m, FrameStatus s) {
  switch (s) {
    case FrameStatus::BadFrame: m->errors_bad_frame++; break;
    case FrameStatus::UnknownOpcode: m->errors_unknown_opcode++; break;
    case FrameStatus::LimitExceeded: m->errors_limit_exceeded++; break;
    case FrameStatus::BadVersion: m->errors_bad_version++; break;
    case FrameStatus::Busy: m->errors_busy++; break;
    case FrameStatus::Internal: m->errors_internal++; break;
    default: break;
  }
}

}  // namespace

void discard(Server::Connection* c, uint64_t n) {
  if (c->scratch.empty()) c->scratch.resize(kScratchBytes);
  while (n > 0) {
    const size_t chunk = n < c->scratch.size() ? size_t(n) : c->scratch.size();
    c->in.read(c->timer, c->scratch.data(), chunk, c->deadline_us);
    n -= chunk;
  }
}

void send_response(Server::Connection* c, uint8_t opcode, uint64_t request_id, FrameStatus status,
                   const std::vector<Lease>* payload, uint64_t payload_len) {
  std::vector<uint8_t>& buf = c->out.buffer();
  build_frame_header(buf.data(), opcode, kFlagResponse, request_id, uint32_t(c->out.body_size()), status, payload_len);
  c->iov.clear();
  c->iov.push_back(iovec{buf.data(), buf.size()});
  if (payload != nullptr) {
    for (const Lease& l : *payload)
      if (l.length > 0) c->iov.push_back(iovec{const_cast<uint8_t*>(l.data), size_t(l.length)});
  }
  // The response gets its own budget: the peer has to read all of it.
  uint64_t bytes = 0;
  for (const iovec& v : c->iov) bytes += v.iov_len;
  send_all(c->timer, c->iov.data(), c->iov.size(), transfer_deadline_us(now_us(), c->stall_timeout_s, bytes));
}

void send_error(Server::Connection* c, Metrics* m, uint8_t opcode, uint64_t request_id, FrameStatus status,
                const std::string& message) {
  count_error(m, status);
  c->out.clear();
  c->out.map(2);
  c->out.str("error");
  c->out.str(message);
  c->out.str("kind");
  c->out.str(frame_status_name(status));
  send_response(c, opcode, request_id, status);
}

void linger_close(Server::Connection* c) {
  shutdown(c->fd, SHUT_WR);
  if (c->scratch.empty()) c->scratch.resize(kScratchBytes);
  const int64_t deadline = now_us() + int64_t(kLingerMs) * 1000;
  size_t drained = 0;
  while (drained < kLingerBytesMax) {
    const int64_t left_us = deadline - now_us();
    if (left_us <= 0) break;
    pollfd p{c->fd, POLLIN, 0};
    if (poll(&p, 1, int(left_us / 1000) + 1) <= 0) break;
    const ssize_t r = recv(c->fd, c->scratch.data(), c->scratch.size(), MSG_DONTWAIT);
    if (r <= 0) break;
    drained += size_t(r);
  }
}

namespace {

// The opcodes that name keys ("keys" required, tenant prefixes applied).
bool is_batch_op(Opcode op) {
  return op == Opcode::PutBatch || op == Opcode::GetBatch || op == Opcode::ExistsBatch || op == Opcode::RemoveBatch ||
         op == Opcode::Lookup || op == Opcode::Reserve;
}

// Moves a connection's activity to `want` unless it was closed to make room (false).
bool set_activity(Server::Connection* c, Activity want) {
  Activity current = c->activity.load();
  while (current != Activity::Evicted) {
    if (current == want || c->activity.compare_exchange_weak(current, want)) return true;
  }
  return false;
}

// Answers BUSY on a connection the accept loop will not serve, then closes it.
void refuse_busy(int fd, Metrics* m, const std::string& message) {
  Server::Connection busy;
  busy.fd = fd;
  busy.stall_timeout_s = 0.1;
  busy.timer = SocketTimer::for_socket(fd, 0.1);  // never let one peer stall the accept loop
  try {
    send_error(&busy, m, 0, 0, FrameStatus::Busy, message);
  } catch (const ConnectionLost&) {
  }
  shutdown(fd, SHUT_WR);
  close(fd);
}

// A Unix-socket peer as "unix:<pid>" (SO_PEERCRED).
std::string unix_peer(int fd) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return "unix:?";
  return "unix:" + std::to_string(cred.pid);
}

// The peer's IP address as text (IPv4-mapped IPv6 as IPv4), without the port.
std::string peer_address(const sockaddr_storage& addr) {
  char text[INET6_ADDRSTRLEN] = "?";
  if (addr.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&addr)->sin_addr, text, sizeof text);
  } else if (addr.ss_family == AF_INET6) {
    const auto* a6 = reinterpret_cast<const sockaddr_in6*>(&addr);
    if (IN6_IS_ADDR_V4MAPPED(&a6->sin6_addr)) inet_ntop(AF_INET, &a6->sin6_addr.s6_addr[12], text, sizeof text);
    else inet_ntop(AF_INET6, &a6->sin6_addr, text, sizeof text);
  }
  return text;
}

}  // namespace

// PUT_BATCH "worth": {"v": 1, "kind": [uint per key], "cost": [uint per key]}
// (docs/protocol.md, "Value worth"). Its checks against the batch (lengths, kinds)
// are handle_put's, before any value is stored.
static Reply parse_worth(MsgpackReader& r, uint32_t batch_keys_max, BatchMeta* b) {
  auto bad = [&r](const std::string& what) {
    return Reply::fail(FrameStatus::BadFrame, "malformed \"worth\": " + what + " (" + r.error() +
                                                  "); send {\"v\": 1, \"kind\": [...], \"cost\": [...]} "
                                                  "as docs/protocol.md describes");
  };
  uint32_t fields;
  if (!r.read_map(&fields)) return bad("not a map");
  b->has_worth = true;
  for (uint32_t f = 0; f < fields; ++f) {
    std::string_view field;
    if (!r.read_bytes(&field)) return bad("a field name is not a string");
    if (field == "v") {
      if (!r.read_uint(&b->worth_version)) return bad("\"v\" must be an unsigned integer");
      continue;
    }
    if (field != "kind" && field != "cost") {
      if (!r.skip()) return bad("unreadable value");
      continue;
    }
    std::vector<uint64_t>& v = field == "kind" ? b->worth_kinds : b->worth_costs;
    uint32_t n;
    if (!r.read_array(&n)) return bad("\"kind\" and \"cost\" must be arrays");
    if (n > batch_keys_max)
      return Reply::fail(FrameStatus::LimitExceeded, "\"worth\" lists more values than batch_keys_max");
    v.resize(n);
    for (uint32_t k = 0; k < n; ++k)
      if (!r.read_uint(&v[k])) return bad("\"kind\" and \"cost\" hold unsigned integers");
  }
  return {};
}

Reply parse_batch_meta(const std::vector<uint8_t>& meta, uint32_t batch_keys_max, BatchMeta* b) {
  b->clear();
  if (meta.empty()) return {};
  MsgpackReader r(meta.data(), meta.size());
  uint32_t entries;
  auto bad = [&r](const char* what) {
    return Reply::fail(FrameStatus::BadFrame, std::string("malformed metadata: ") + what + " (" + r.error() +
                                                  "); send a msgpack map as docs/protocol.md describes");
  };
  if (!r.read_map(&entries)) return bad("not a map");
  for (uint32_t i = 0; i < entries; ++i) {
    std::string_view name;
    if (!r.read_bytes(&name)) return bad("map key is not a string");
    const bool is_keys = name == "keys", is_lens = name == "lens", is_sums = name == "sums";
    if (name == "epoch") {
      if (!r.read_int(&b->epoch)) return bad("\"epoch\" must be an integer");
      b->has_epoch = true;
      continue;
    }
    if (name == "cont" || name == "last") {
      if (!r.read_bool(name == "cont" ? &b->chain_continues : &b->chain_ends))
        return bad("\"cont\" and \"last\" must be booleans");
      continue;
    }
    if (name == "ck") {
      uint64_t kind;
      if (!r.read_uint(&kind)) return bad("\"ck\" must be an unsigned integer");
      if (!checksum_kind_valid(kind)) {
        return Reply::fail(FrameStatus::BadFrame, "unknown checksum kind \"ck\": " + std::to_string(kind) +
                                                      "; this node speaks 0 (xxh64) and 1 (xxh3)");
      }
      b->checksum_kind = ChecksumKind(kind);
      b->has_ck = true;
      continue;
    }
    if (name == "worth") {
      if (Reply bad_worth = parse_worth(r, batch_keys_max, b); bad_worth.status != FrameStatus::Ok) return bad_worth;
      continue;
    }
    if (name == "trail") {
      if (!r.read_bool(&b->sums_trail)) return bad("\"trail\" must be a boolean");
      continue;
    }
    if (name == "inline_max") {
      if (!r.read_uint(&b->inline_max)) return bad("\"inline_max\" must be an unsigned integer");
      continue;
    }
    if (name == "res") {
      if (!r.read_uint(&b->res)) return bad("\"res\" must be an unsigned integer");
      b->has_res = true;
      continue;
    }
    if (name == "vfy") {
      if (!r.read_bool(&b->reader_verifies)) return bad("\"vfy\" must be a boolean");
      continue;
    }
    if (name == "leases" || name == "reservations" || name == "bad") {
      std::vector<uint64_t>& ids = name == "leases" ? b->leases : name == "bad" ? b->bad : b->reservations;
      uint32_t n;
      if (!r.read_array(&n)) return bad("\"leases\"/\"reservations\"/\"bad\" must be arrays");
      if (n > batch_keys_max) return Reply::fail(FrameStatus::LimitExceeded, "too many ids in one RELEASE");
      ids.resize(n);
      for (uint32_t k = 0; k < n; ++k)
        if (!r.read_uint(&ids[k])) return bad("lease and reservation ids must be unsigned integers");
      continue;
    }
    if (!is_keys && !is_lens && !is_sums) {
      if (!r.skip()) return bad("unreadable value");
      continue;
    }
    uint32_t n;
    if (!r.read_array(&n)) return bad("\"keys\"/\"lens\"/\"sums\" must be arrays");
    if (n > batch_keys_max) {
      return Reply::fail(FrameStatus::LimitExceeded, "batch of " + std::to_string(n) + " keys exceeds batch_keys_max=" +
                                                         std::to_string(batch_keys_max) + "; split the batch");
    }
    if (is_keys) {
      b->has_keys = true;
      b->keys.resize(n);
      for (uint32_t k = 0; k < n; ++k)
        if (!r.read_bytes(&b->keys[k])) return bad("every key must be bin or str");
    } else {
      std::vector<uint64_t>& v = is_lens ? b->lens : b->sums;
      (is_lens ? b->has_lens : b->has_sums) = true;
      v.resize(n);
      for (uint32_t k = 0; k < n; ++k)
        if (!r.read_uint(&v[k])) return bad("lens/sums must be unsigned integers");
    }
  }
  if (!r.at_end()) return bad("bytes after the metadata map");
  return {};
}

OwnerId owner_of(const Server::Connection* c, const TenantTable* tenants, std::string_view stored_key) {
  const Tenant* t = c->tenant;
  if (t == nullptr || tenants == nullptr) return 0;
  if (!t->key_prefix.empty()) return t->index;
  const size_t nul = stored_key.find('\0');
  if (nul == std::string_view::npos) return 0;
  const Tenant* named = tenants->by_name(stored_key.substr(0, nul));
  return named ? named->index : 0;
}

void namespace_keys(Server::Connection* c) {
  std::vector<std::string_view>& keys = c->batch.keys;
  const Tenant* t = c->tenant;
  const std::string_view prefix = t ? std::string_view(t->key_prefix) : std::string_view();
  const size_t key_max = t && prefix.empty() ? kKeyBytesMax : kUserKeyBytesMax;
  if (prefix.empty()) {
    for (std::string_view& k : keys)
      if (k.size() > key_max) k = std::string_view();
    return;
  }
  size_t total = 0;
  for (std::string_view k : keys) total += prefix.size() + k.size();
  c->keys_buf.clear();
  c->keys_buf.reserve(total);  // no reallocation below: the views stay valid
  for (std::string_view& k : keys) {
    if (k.empty() || k.size() > key_max) {
      k = std::string_view();
      continue;
    }
    const size_t at = c->keys_buf.size();
    c->keys_buf.append(prefix);
    c->keys_buf.append(k);
    k = std::string_view(c->keys_buf.data() + at, prefix.size() + k.size());
  }
}

Server::Server(const ServerConfig& config, Store* store, Metrics* metrics)
    : config_(config),
      store_(store),
      metrics_(metrics),
      epoch_(config.epoch),
      map_bytes_(std::make_shared<const std::string>()),
      peers_(config.connections_per_address_max),
      preauth_peers_(config.preauth_connections_per_address_max),
      reservations_(config.put_reserve_bytes_max, config.put_reserve_bytes_max / 4),
      meta_buffers_(config.meta_buffer_bytes_max, config.meta_buffer_bytes_max / 4) {
  spinners_max_ = std::max(1u, std::thread::hardware_concurrency() / 2);  // leave the clients their cores
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port_text = std::to_string(config.port);
  const int gai = getaddrinfo(config.host.empty() ? nullptr : config.host.c_str(), port_text.c_str(), &hints, &found);
  if (gai != 0) {
    throw BindError("cannot resolve host '" + config.host + "': " + gai_strerror(gai) +
                    "; pass an IP address or a resolvable name to --host");
  }
  std::string last_error = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    set_socket_buffers(fd, config.socket_buffer_bytes);  // inherited by accepted sockets
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 1024) == 0) {
      listen_fd_ = fd;
      break;
    }
    last_error = std::strerror(errno);
    close(fd);
  }
  freeaddrinfo(found);
  if (listen_fd_ < 0) {
    throw BindError("cannot listen on " + config.host + ":" + port_text + ": " + last_error +
                    "; pick a free port with --port or stop the process using it");
  }
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  if (pipe2(wake_fds_, O_CLOEXEC) != 0) {
    close(listen_fd_);
    throw std::runtime_error(std::string("pipe2 failed: ") + std::strerror(errno));
  }
  if (config_.instance_id.empty()) {  // PING's "instance": random per start
    uint8_t raw[8];
    random_bytes(raw, sizeof raw);
    static const char* kHex = "0123456789abcdef";
    for (uint8_t b : raw) config_.instance_id += {kHex[b >> 4], kHex[b & 15]};
  }
  try {
    unix_listen_fd_ = listen_unix();
  } catch (...) {
    close(listen_fd_);
    close(wake_fds_[0]);
    close(wake_fds_[1]);
    throw;
  }
}

Server::~Server() {
  stop(0);
  close(wake_fds_[0]);
  close(wake_fds_[1]);
}

void Server::set_cluster_map(int64_t epoch, std::string map_bytes) {
  if (map_bytes.size() > kClusterMapBytesMax) {
    throw std::invalid_argument("cluster map of " + std::to_string(map_bytes.size()) + " bytes exceeds " +
                                std::to_string(kClusterMapBytesMax) + "; a map holds a few hundred bytes per node");
  }
  auto blob = std::make_shared<const std::string>(std::move(map_bytes));
  std::lock_guard<std::mutex> lock(map_mu_);
  const int64_t current = epoch_.load(std::memory_order_relaxed);
  if (epoch < current) {
    throw std::invalid_argument("cluster map epoch " + std::to_string(epoch) + " is older than the node's " +
                                std::to_string(current) + "; epochs never go backwards: pass the newer map");
  }
  // The map is in place before the epoch rises, so a request refused for the
  // new epoch is always answered with a map at least that new.
  map_bytes_ = std::move(blob);
  // Under admit_mu_: a PUT is admitted (and counted) wholly before or wholly
  // after the rise, so wait_puts_admitted_before(epoch) sees every older one.
  std::lock_guard<std::mutex> admit_lock(admit_mu_);
  epoch_.store(epoch, std::memory_order_release);
  for (auto it = puts_in_flight_.begin(); it != puts_in_flight_.end() && it->first < epoch;)
    it = it->second == 0 ? puts_in_flight_.erase(it) : std::next(it);
}

bool Server::wait_puts_admitted_before(int64_t epoch, double timeout_s) {
  const double wait_s = std::min(std::max(timeout_s, 0.0), 1e9);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(int64_t(wait_s * 1e6));
  std::unique_lock<std::mutex> lock(admit_mu_);
  return admit_cv_.wait_until(lock, deadline, [this, epoch] {
    for (auto it = puts_in_flight_.begin(); it != puts_in_flight_.end() && it->first < epoch; ++it)
      if (it->second > 0) return false;
    return true;
  });
}

std::pair<int64_t, std::shared_ptr<const std::string>> Server::cluster_map() const {
  std::lock_guard<std::mutex> lock(map_mu_);
  return {epoch_.load(std::memory_order_relaxed), map_bytes_};
}

void Server::start() {
  if (stopping_ || started_.exchange(true)) return;
  accept_thread_ = std::thread([this] { accept_loop(); });
  if (config_.shm_scrub) scrub_thread_ = std::thread([this] { scrub_loop(); });
}

// A COMMIT publishes a value with its writer's sum, unread (one memory pass
// per put). Once a shared-memory reader has copied it (hashing it itself),
// this thread checks it, off every request's path, so its later readers copy
// it without hashing (docs/security.md, "Checksums a writer declares").
void Server::scrub_loop() {
  constexpr size_t kScrubBatch = 16;  // values per store call: the lock is held per value, not per batch
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(scrub_mu_);
      scrub_cv_.wait(lock, [this] { return scrub_wanted_ || stopping_; });
      if (stopping_) return;
      scrub_wanted_ = false;
    }
    try {
      while (!stopping_ && store_->scrub(kScrubBatch) > 0) {
      }
    } catch (const std::exception&) {
      metrics_->errors_internal++;
    }
  }
}

void Server::wake_scrubber() {
  {
    std::lock_guard<std::mutex> lock(scrub_mu_);
    scrub_wanted_ = true;
  }
  scrub_cv_.notify_one();
}

void Server::stop(double grace_s) {
  std::lock_guard<std::mutex> stop_lock(stop_mu_);
  if (!stopping_.exchange(true)) {
    stop_deadline_us_ = now_us() + int64_t(grace_s > 0 ? grace_s * 1e6 : 0);
    const char byte = 1;
    (void)!write(wake_fds_[1], &byte, 1);
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  {
    std::lock_guard<std::mutex> lock(scrub_mu_);  // stopping_ is set: the scrubber sees it once woken
  }
  scrub_cv_.notify_all();
  if (scrub_thread_.joinable()) scrub_thread_.join();
  if (listen_fd_ >= 0) {
    close(listen_fd_);
    listen_fd_ = -1;
  }
  if (unix_listen_fd_ >= 0) {
    close(unix_listen_fd_);
    unix_listen_fd_ = -1;
    unlink(config_.unix_socket_path.c_str());
  }
  std::unique_lock<std::mutex> lock(conns_mu_);
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::microseconds(std::max<int64_t>(0, stop_deadline_us_ - now_us()));
  conns_cv_.wait_until(lock, deadline, [this] {
    for (auto& c : conns_)
      if (!c->finished) return false;
    return true;
  });
  // Past the grace period: cut off whatever is still mid-request.
  for (auto& c : conns_)
    if (!c->finished && c->fd >= 0) shutdown(c->fd, SHUT_RDWR);
  std::list<std::unique_ptr<Connection>> all;
  all.swap(conns_);
  lock.unlock();
  for (auto& c : all)
    if (c->thread.joinable()) c->thread.join();
}

void Server::reap_finished() {
  std::list<std::unique_ptr<Connection>> done;
  {
    std::lock_guard<std::mutex> lock(conns_mu_);
    for (auto it = conns_.begin(); it != conns_.end();) {
      if ((*it)->finished) {
        done.push_back(std::move(*it));
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& c : done) c->thread.join();
}

void Server::accept_loop() {
  // poll() skips the Unix entry while its fd is -1 (no --unix-socket).
  pollfd fds[3] = {{listen_fd_, POLLIN, 0}, {wake_fds_[0], POLLIN, 0}, {unix_listen_fd_, POLLIN, 0}};
  while (!stopping_) {
    if (poll(fds, 3, 1000) < 0 && errno != EINTR) break;
    if (stopping_ || (fds[1].revents & POLLIN)) break;
    reap_finished();
    const bool is_unix = !(fds[0].revents & POLLIN) && (fds[2].revents & POLLIN);
    if (!(fds[0].revents & POLLIN) && !is_unix) continue;
    sockaddr_storage peer_addr{};
    socklen_t peer_len = sizeof peer_addr;
    const int fd = accept4(is_unix ? unix_listen_fd_ : listen_fd_, reinterpret_cast<sockaddr*>(&peer_addr), &peer_len,
                           SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));  // don't spin on fd exhaustion
      continue;
    }
    metrics_->connections_accepted++;
    // A local peer counts per process: its limits are per client, as an address's are.
    const std::string peer = is_unix ? unix_peer(fd) : peer_address(peer_addr);
    auto conn = std::make_unique<Connection>();
    conn->fd = fd;
    conn->is_unix = is_unix;
    conn->accepted_us = now_us();
    conn->last_work_us = conn->accepted_us;
    conn->peer = peer;
    // Budget shares: per address over TCP; per connection on the Unix socket, where a
    // RESERVE holds its share until COMMIT and a same-user process is trusted with the
    // arena anyway (the total still bounds them all).
    conn->owner = is_unix ? "u:" + peer + "#" + std::to_string(fd) : "a:" + peer;
    conn->stall_timeout_s = config_.stall_timeout_s;
    // Auth off, it waits for its first frame holding nothing: it may make room
    // as any idle one does (one whose peer already left counts no longer).
    if (!auth_on()) conn->activity.store(Activity::Idle);
    Connection* raw = conn.get();
    std::unique_lock<std::mutex> lock(conns_mu_);
    std::string refusal;
    if (!admit_locked(raw, &refusal)) {  // every slot busy (auth off) or authenticated
      lock.unlock();
      refuse_busy(fd, metrics_, refusal);
      continue;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    set_socket_buffers(fd, config_.socket_buffer_bytes);
    conn->timer = SocketTimer::for_socket(fd, config_.stall_timeout_s);
    metrics_->connections_open++;
    try {
      raw->thread = std::thread([this, raw] { serve(raw); });
      conns_.push_back(std::move(conn));
    } catch (const std::system_error&) {
      metrics_->errors_internal++;
      metrics_->connections_open--;
      release_slots_locked(raw);
      close(fd);
    }
  }
}

// One connection's life: wait for a frame, read its header, check it, hand it
// on; then tear down. Each step answers Flow: go on with this frame, go back
// to waiting (Retry), or close the connection (Close).
void Server::serve(Connection* c) {
  try {
    for (;;) {
      const Flow waited = await_frame(c);
      if (waited == Flow::Close) break;
      if (waited == Flow::Retry) continue;
      FrameHeader h;
      int64_t start_us = 0;
      const Flow read = read_frame_header(c, &h, &start_us);
      if (read == Flow::Close) break;
      if (read == Flow::Retry) continue;
      if (!check_frame(c, h) || !dispatch(c, h, start_us)) {
        linger_close(c);
        break;
      }
      c->small_frame = h.payload_len <= kSpinFrameBytesMax && c->batch.keys.size() <= kSpinFrameKeysMax;
    }
  } catch (const ConnectionLost& lost) {
    if (lost.timeout) metrics_->errors_timeout++;
  } catch (const std::exception&) {
    metrics_->errors_internal++;  // cannot answer: framing state unknown
  }
  end_connection(c);
}

// Waits for the next frame's first byte under three deadlines: the idle
// timeout (from the last data request: PINGs alone cannot keep a slot), the
// auth deadline of an unauthenticated connection, and the next shm lease or
// reservation expiry (to expire it). Also the stop signal, when idle.
Server::Flow Server::await_frame(Connection* c) {
  if (c->shm.next_deadline_us() != 0 && expire_shm(c)) return Flow::Close;
  // The next frame is here already (a client that pipelines), or came while this thread
  // spun for it: no poll.
  if (c->in.buffered() > 0 || spin_for_frame(c)) return set_activity(c, Activity::Busy) ? Flow::Proceed : Flow::Close;
  // Auth off, a connection waiting with nothing held may be closed to make room (admission.cpp).
  const bool holds_nothing = !auth_on() && c->shm.next_deadline_us() == 0 && c->rdma_id == 0;
  if (!set_activity(c, holds_nothing ? Activity::Idle : Activity::Busy)) return Flow::Close;
  double wait_s = config_.idle_timeout_s - double(now_us() - c->last_work_us) / 1e6;
  if (wait_s <= 0) {
    metrics_->idle_closes++;
    return Flow::Close;
  }
  if (unauthenticated(c)) {  // only until the auth deadline
    wait_s = std::min(wait_s, config_.auth_timeout_s - double(now_us() - c->accepted_us) / 1e6);
    if (wait_s <= 0) {
      metrics_->errors_timeout++;
      return Flow::Close;
    }
  }
  const int64_t shm_deadline = c->shm.next_deadline_us();  // wake to expire leases
  if (shm_deadline != 0) wait_s = std::min(wait_s, std::max(0.001, double(shm_deadline - now_us()) / 1e6));
  pollfd fds[2] = {{c->fd, POLLIN, 0}, {wake_fds_[0], POLLIN, 0}};
  const int ready = poll(fds, 2, stopping_ ? 0 : clamp_ms(wait_s));
  if (ready < 0) return errno == EINTR ? Flow::Retry : Flow::Close;
  if (ready == 0 && !stopping_) return Flow::Retry;           // the next wait decides: idle, or auth deadline
  if (ready == 0 || fds[0].revents == 0) return Flow::Close;  // stopping and idle
  if (stopping_ && now_us() > stop_deadline_us_) return Flow::Close;
  if (!set_activity(c, Activity::Busy)) return Flow::Close;  // closed to make room just now
  return Flow::Proceed;
}

// After a small request a client's next one often follows within microseconds (a loop of
// single GETs): poll the socket without blocking for up to --spin-us rather than sleep in
// poll() and pay the kernel's wake-up. Bounded three ways: the time, the number of threads
// spinning at once (spinners_max_, a share of the cores), and per connection: a spin that
// caught nothing makes the next kSpinSkipFrames frames wait in poll() at once.
bool Server::spin_for_frame(Connection* c) {
  if (config_.spin_us == 0 || !c->small_frame || stopping_ || unauthenticated(c)) return false;
  if (c->spin_skip > 0) {
    --c->spin_skip;
    return false;
  }
  if (spinners_.fetch_add(1, std::memory_order_relaxed) >= spinners_max_) {
    spinners_.fetch_sub(1, std::memory_order_relaxed);
    return false;
  }
  const bool caught = c->in.spin_fill(c->fd, now_us() + config_.spin_us);
  spinners_.fetch_sub(1, std::memory_order_relaxed);
  if (!caught) c->spin_skip = kSpinSkipFrames;
  return caught;
}

// The frame's deadline: one budget for all its bytes from its first byte; an
// unauthenticated connection's frame never outlives the auth deadline.
int64_t Server::frame_deadline_us(const Connection* c, int64_t first_byte_us, uint64_t frame_bytes) const {
  int64_t deadline = transfer_deadline_us(first_byte_us, config_.stall_timeout_s, frame_bytes);
  if (unauthenticated(c)) deadline = std::min(deadline, c->accepted_us + int64_t(config_.auth_timeout_s * 1e6));
  return deadline;
}

// Reads one frame header once poll() said bytes are there (or they are
// buffered), and sets the
// frame's deadline (c->deadline_us) from it. *start_us: when the request
// started, for its latency histogram.
Server::Flow Server::read_frame_header(Connection* c, FrameHeader* h, int64_t* start_us) {
  uint8_t header_bytes[kFrameHeaderBytes];
  if (c->in.buffered() == 0) {
    // One recv for the header, the metadata after it, and whatever else has
    // arrived. A clean EOF here is an ordinary close.
    const ssize_t got = c->in.fill(c->fd);
    if (got == 0) return Flow::Close;
    if (got < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? Flow::Retry : Flow::Close;
  }
  const int64_t first_byte_us = now_us();
  c->deadline_us = frame_deadline_us(c, first_byte_us, kFrameHeaderBytes);
  c->in.read(c->timer, header_bytes, kFrameHeaderBytes, c->deadline_us);
  *start_us = now_us();
  *h = parse_frame_header(header_bytes);
  if (unauthenticated(c)) c->spoke.store(true, std::memory_order_relaxed);
  c->deadline_us = frame_deadline_us(
      c, first_byte_us, uint64_t(kFrameHeaderBytes) + h->meta_len + std::min<uint64_t>(h->payload_len, UINT64_MAX / 2));
  metrics_->requests++;
  return Flow::Proceed;
}

// The checks on a header before any of its body is read: magic, version,
// sizes, and the auth gate. False: answered with an error, close.
bool Server::check_frame(Connection* c, const FrameHeader& h) {
  if (!frame_magic_ok(h)) {
    send_error(c, metrics_, h.opcode, h.request_id, FrameStatus::BadFrame,
               "bad magic: every frame starts with the bytes 'GCH1' (docs/protocol.md); "
               "the connection is closed, reconnect and resend");
    return false;
  }
  if (h.version != kProtocolVersion) {
    send_error(c, metrics_, h.opcode, h.request_id, FrameStatus::BadVersion,
               "protocol version " + std::to_string(h.version) +
                   " is not supported; this server "
                   "speaks version 1: upgrade or downgrade the client");
    return false;
  }
  if (h.meta_len > config_.meta_bytes_max || h.payload_len > config_.frame_payload_bytes_max) {
    send_error(c, metrics_, h.opcode, h.request_id, FrameStatus::LimitExceeded,
               "frame too large (meta_len=" + std::to_string(h.meta_len) + " max " +
                   std::to_string(config_.meta_bytes_max) + ", payload_len=" + std::to_string(h.payload_len) + " max " +
                   std::to_string(config_.frame_payload_bytes_max) + "); split the batch; the connection is closed");
    return false;
  }
  if (Opcode(h.opcode) == Opcode::Auth && h.meta_len > kUnauthenticatedMetaBytesMax) {
    // An AUTH's metadata is two short fields: a claim of more is refused
    // before a byte of it is buffered, on any connection (issue 31, finding 1).
    send_error(c, metrics_, h.opcode, h.request_id, FrameStatus::LimitExceeded,
               "AUTH metadata is at most " + std::to_string(kUnauthenticatedMetaBytesMax) +
                   " bytes (meta_len=" + std::to_string(h.meta_len) + "); the connection is closed");
    return false;
  }
  if (unauthenticated(c)) {
    // Before AUTH: only PING and AUTH, with small metadata and no payload;
    // anything else is answered once and the connection closed.
    const bool allowed = Opcode(h.opcode) == Opcode::Ping || Opcode(h.opcode) == Opcode::Auth;
    if (!allowed || h.meta_len > kUnauthenticatedMetaBytesMax || h.payload_len > 0) {
      metrics_->errors_unauthenticated++;
      send_error(c, metrics_, h.opcode, h.request_id, FrameStatus::Unauthenticated,
                 "this node requires authentication: connect with a token of its --auth-file "
                 "(gcache.Client(..., token=...) or GCACHE_TOKEN); before AUTH only PING is "
                 "answered; the connection is closed");
      return false;
    }
  }
  return true;
}

// Hands a checked frame to its handler: AUTH (server/auth.cpp), an unknown
// opcode (skipped), or handle_frame; records the latency and trims the
// metadata buffer. False: close the connection.
bool Server::dispatch(Connection* c, const FrameHeader& h, int64_t start_us) {
  if (Opcode(h.opcode) == Opcode::Auth) return handle_auth(c, h);
  Histogram* latency = histogram_for(metrics_, h.opcode);  // null for some known opcodes
  if (h.opcode == 0 || h.opcode > kOpcodeMax) {
    discard(c, uint64_t(h.meta_len) + h.payload_len);
    send_error(c, metrics_, h.opcode, h.request_id, FrameStatus::UnknownOpcode,
               "unknown opcode " + std::to_string(h.opcode) + "; this server knows opcodes 1-" +
                   std::to_string(kOpcodeMax) + " (docs/protocol.md); frame skipped");
    return true;
  }
  handle_frame(c, h);
  if (latency != nullptr) latency->record_us(uint64_t(now_us() - start_us));
  // Keep a large buffer for the next frame only while the global budget has room.
  if (c->meta.capacity() > kMetaKeepBytes || (c->meta_charged > 0 && meta_buffers_.used() > meta_buffers_.total() / 2))
    release_meta(c);
  return true;
}

// The connection is done: give back what it holds and mark it for the reaper.
void Server::end_connection(Connection* c) {
  c->activity.store(Activity::Busy);  // never chosen to make room from here on
  end_shm_session(c);
  release_meta(c);
  if (c->tenant != nullptr) c->tenant->connections--;
  std::lock_guard<std::mutex> lock(conns_mu_);
  // Out of time before AUTH: a loss for its address, as a drop is; one that
  // closed itself sooner (a health check's probe) is not (admission.cpp).
  const int64_t now = now_us();
  if (c->preauth && now - c->accepted_us >= int64_t(config_.auth_timeout_s * 1e6)) preauth_losses_.note(c->peer, now);
  release_slots_locked(c);
  close(c->fd);
  c->fd = -1;
  metrics_->connections_open--;
  c->finished = true;
  conns_cv_.notify_all();
}

// Reads a frame's metadata into c->meta, growing with the bytes that actually
// arrive: a header that merely claims 16 MiB of metadata must not make the
// server allocate it up front. Past the metadata budget: answered, closed.
void Server::read_meta(Connection* c, const FrameHeader& h) {
  c->meta.clear();
  size_t got = 0;
  while (got < h.meta_len) {
    const size_t chunk = std::min<size_t>(h.meta_len - got, std::max<size_t>(64 << 10, got));
    if (!grow_meta(c, got + chunk)) {
      metrics_->meta_budget_refused++;
      send_error(c, metrics_, h.opcode, h.request_id, FrameStatus::LimitExceeded,
                 "the node's metadata buffers are full (--meta-buffer-bytes-max=" +
                     std::to_string(config_.meta_buffer_bytes_max) +
                     "): send smaller batches, or retry; the connection is closed");
      linger_close(c);
      throw ConnectionLost{false};
    }
    c->meta.resize(got + chunk);
    c->in.read(c->timer, c->meta.data() + got, chunk, c->deadline_us);
    got += chunk;
  }
}

void Server::handle_frame(Connection* c, const FrameHeader& h) {
  const Opcode op = Opcode(h.opcode);
  read_meta(c, h);
  if (op == Opcode::Release && (h.flags & kFlagNoReply)) {  // never answered, not even an error
    if (h.payload_len > 0) discard(c, h.payload_len);
    if (h.payload_len == 0 && parse_batch_meta(c->meta, config_.batch_keys_max, &c->batch).status == FrameStatus::Ok)
      handle_release(c, h);
    else metrics_->errors_bad_frame++;
    return;
  }
  if (!check_request(c, h)) return;
  // A client routing by an older map may be talking to the wrong node: refuse
  // before touching the store. PING and STATS are always answered. A PUT is
  // checked and counted in one step (see wait_puts_admitted_before).
  PutAdmission admission(this);
  const BatchMeta& b = c->batch;
  const bool stale = op == Opcode::PutBatch
                         ? !admission.admit(b.has_epoch, b.epoch)
                         : is_batch_op(op) && b.has_epoch && b.epoch < epoch_.load(std::memory_order_acquire);
  if (stale) {
    if (op == Opcode::PutBatch) discard(c, h.payload_len);  // no reservation was taken
    send_stale_epoch(c, h);
    return;
  }
  run_handler(c, h, &admission);
}

// The request's own checks, once its metadata is in: payload only on PUT,
// readable metadata, keys where the opcode needs them, the tenant's role.
// Then its keys get their store names and a data request counts as work.
// False: answered with an error (a PUT's payload read and dropped).
bool Server::check_request(Connection* c, const FrameHeader& h) {
  const Opcode op = Opcode(h.opcode);
  if (op != Opcode::PutBatch && h.payload_len > 0) {
    discard(c, h.payload_len);
    send_error(
        c, metrics_, h.opcode, h.request_id, FrameStatus::BadFrame,
        "this opcode carries no payload but payload_len=" + std::to_string(h.payload_len) + "; send payload_len=0");
    return false;
  }
  Reply parsed = parse_batch_meta(c->meta, config_.batch_keys_max, &c->batch);
  if (parsed.status != FrameStatus::Ok) {
    if (op == Opcode::PutBatch) discard(c, h.payload_len);
    send_error(c, metrics_, h.opcode, h.request_id, parsed.status, parsed.error);
    return false;
  }
  const bool batch_op = is_batch_op(op);
  if (batch_op && !c->batch.has_keys) {
    if (op == Opcode::PutBatch) discard(c, h.payload_len);
    send_error(c, metrics_, h.opcode, h.request_id, FrameStatus::BadFrame,
               "metadata needs \"keys\": a list of bin keys (docs/protocol.md)");
    return false;
  }
  if (auth_on()) {
    const uint8_t needed = (op == Opcode::PutBatch || op == Opcode::RemoveBatch)   ? kRoleWrite
                           : (op == Opcode::GetBatch || op == Opcode::ExistsBatch) ? kRoleRead
                                                                                   : 0;
    if (needed != 0 && !(c->tenant->roles & (needed | kRoleCluster))) {
      if (op == Opcode::PutBatch) discard(c, h.payload_len);
      metrics_->errors_forbidden++;
      send_error(c, metrics_, h.opcode, h.request_id, FrameStatus::Forbidden,
                 "tenant '" + c->tenant->name + "' lacks the '" + (needed == kRoleWrite ? "write" : "read") +
                     "' role for this request; add it to the tenant's roles in the --auth-file");
      return false;
    }
  }
  if (batch_op) namespace_keys(c);
  if (batch_op || op == Opcode::Commit || op == Opcode::Release) c->last_work_us = now_us();
  return true;
}

// Runs the opcode's handler and answers its failure; an exception other than
// a lost connection is answered INTERNAL (the handler kept the framing).
void Server::run_handler(Connection* c, const FrameHeader& h, PutAdmission* admission) {
  Reply reply;
  try {
    switch (Opcode(h.opcode)) {
      case Opcode::PutBatch: reply = handle_put(c, h, admission); break;
      case Opcode::GetBatch: reply = handle_get(c, h); break;
      case Opcode::ExistsBatch: reply = handle_exists(c, h); break;
      case Opcode::RemoveBatch: reply = handle_remove(c, h); break;
      case Opcode::Stats: reply = handle_stats(c, h); break;
      case Opcode::Ping: reply = handle_ping(c, h); break;
      case Opcode::ShmAttach: reply = handle_shm_attach(c, h); break;
      case Opcode::Lookup: reply = handle_lookup(c, h); break;
      case Opcode::Release: reply = handle_release(c, h); break;
      case Opcode::Reserve: reply = handle_reserve(c, h); break;
      case Opcode::Commit: reply = handle_commit(c, h); break;
      case Opcode::RdmaConnect: reply = handle_rdma_connect(c, h); break;
      case Opcode::Auth: break;  // answered in serve()
    }
  } catch (const ConnectionLost&) {
    throw;
  } catch (const std::exception& e) {
    reply = Reply::fail(FrameStatus::Internal,
                        std::string("internal error: ") + e.what() + "; retry, and report it if it repeats");
  }
  if (reply.status != FrameStatus::Ok) send_error(c, metrics_, h.opcode, h.request_id, reply.status, reply.error);
}

Reply check_worth(const BatchMeta& b, size_t n) {
  if (b.worth_version != kWorthVersion)
    return Reply::fail(FrameStatus::BadFrame,
                       "\"worth\" version " + std::to_string(b.worth_version) +
                           " is not spoken here; this node speaks \"v\": " + std::to_string(kWorthVersion));
  if (b.worth_kinds.size() != n || b.worth_costs.size() != n)
    return Reply::fail(FrameStatus::BadFrame, "\"worth\" needs one \"kind\" and one \"cost\" per key (" +
                                                  std::to_string(n) + " keys, " + std::to_string(b.worth_kinds.size()) +
                                                  " kinds, " + std::to_string(b.worth_costs.size()) + " costs)");
  for (uint64_t kind : b.worth_kinds)
    if (kind > kValueKindMax)
      return Reply::fail(FrameStatus::BadFrame, "unknown value kind " + std::to_string(kind) +
                                                    " in \"worth\"; this node knows 0 (other), 1 (attention "
                                                    "page), 2 (state checkpoint)");
  return {};
}

Reply Server::handle_put(Connection* c, const FrameHeader& h, PutAdmission* admission) {
  const BatchMeta& b = c->batch;
  const size_t n = b.keys.size();
  const bool sums_in_meta = !b.sums_trail;
  if (!b.has_lens || b.lens.size() != n || (sums_in_meta && (!b.has_sums || b.sums.size() != n))) {
    discard(c, h.payload_len);
    return Reply::fail(FrameStatus::BadFrame,
                       "PUT_BATCH needs \"keys\", \"lens\" and \"sums\" of equal length (or \"trail\": true "
                       "with a sum after each value)");
  }
  if (b.has_worth) {
    if (Reply bad = check_worth(b, n); bad.status != FrameStatus::Ok) {
      discard(c, h.payload_len);  // nothing stored: the field is the client's bug
      return bad;
    }
  }
  // With "trail" each value is followed by its 8-byte sum in the payload.
  uint64_t total = b.sums_trail ? uint64_t(n) * 8 : 0;
  for (uint64_t len : b.lens) {
    if (len > h.payload_len - total) {  // also catches overflow
      total = UINT64_MAX;
      break;
    }
    total += len;
  }
  if (total != h.payload_len) {
    discard(c, h.payload_len);
    return Reply::fail(
        FrameStatus::BadFrame,
        "sum of \"lens\" (and 8 per key with \"trail\") does not equal payload_len=" + std::to_string(h.payload_len) +
            "; send every value's length, values concatenated in key order");
  }
  std::vector<uint8_t> statuses(n);
  uint64_t consumed = 0;                           // payload bytes read so far
  const uint64_t chain = store_->new_put_batch();  // a put batch is one prefix chain, in order
  try {
    for (size_t i = 0; i < n; ++i) {
      PutHint hint{chain, n >= 2 && i + 1 == n, 0};
      if (b.has_worth) {
        hint.worth_cost = b.worth_costs[i];
        hint.kind = ValueKind(b.worth_kinds[i]);
      }
      statuses[i] = uint8_t(put_one(c, i, hint, &consumed));
    }
  } catch (const ConnectionLost&) {
    throw;
  } catch (const std::exception&) {
    discard(c, h.payload_len - consumed);  // keep the framing for the next request
    throw;
  }
  admission->release();  // every value is stored: the response may take its time
  metrics_->bytes_in += h.payload_len;
  c->out.clear();
  c->out.map(b.has_ck ? 2 : 1);
  c->out.str("st");
  c->out.array(uint32_t(n));
  for (uint8_t s : statuses) c->out.uint(s);
  if (b.has_ck) {  // the kind the sums were checked as: a node from before XXH3 never says it
    c->out.str("ck");
    c->out.uint(uint8_t(b.checksum_kind));
  }
  send_response(c, h.opcode, h.request_id, FrameStatus::Ok);
  return {};
}

// Value i of a PUT_BATCH: its bytes go socket -> arena with no copy, or are
// read and dropped when it is refused (*consumed counts them once read). The
// guards give back the budget and the reservation on every path out (a
// receive that fails, an exception).
PutStatus Server::put_one(Connection* c, size_t i, PutHint hint, uint64_t* consumed) {
  const BatchMeta& b = c->batch;
  const uint64_t len = b.lens[i];
  const uint64_t trail = b.sums_trail ? 8 : 0;  // the value's sum, after its bytes
  // One that can never be stored is refused before it takes budget: it must
  // not wait for room it could never use.
  const PutStatus storable = store_->check_put(b.keys[i], len);
  if (storable != PutStatus::Stored) {
    if (storable == PutStatus::TooLarge) metrics_->puts_too_large++;
    discard(c, len + trail);
    *consumed += len + trail;
    return storable;
  }
  // Arena is reserved only against a budget of bytes not yet received:
  // declaring a large value without sending it cannot evict hot data.
  if (!reservations_.acquire(c->owner, len, budget_wait_deadline(c))) {
    metrics_->puts_reserve_refused++;
    metrics_->puts_no_space++;
    discard(c, len + trail);
    *consumed += len + trail;
    return PutStatus::NoSpace;
  }
  BudgetHold budget(&reservations_, c->owner, len);
  PutGuard put(store_);
  const PutStatus begun = put.begin(b.keys[i], len, owner_of(c, config_.tenants.get(), b.keys[i]));
  // Hashed as the bytes land (one pass, while each piece is in cache): COMMIT
  // then only compares.
  ChecksumStream landed(b.checksum_kind);
  uint8_t sum_bytes[8];  // with "trail": the value's sum, read with the value's last piece
  if (begun == PutStatus::Stored)
    c->in.read(c->timer, put.reservation().data, size_t(len), c->deadline_us, &landed, sum_bytes, size_t(trail));
  budget.release();  // the bytes have arrived
  if (begun != PutStatus::Stored) {
    discard(c, len + trail);
    *consumed += len + trail;
    return begun;
  }
  *consumed += len;
  ValueChecksum declared{0, b.checksum_kind};
  if (b.sums_trail) {
    *consumed += 8;
    std::memcpy(&declared.sum, sum_bytes, 8);  // little-endian, as every integer of the protocol
  } else {
    declared.sum = b.sums[i];
  }
  hint.owner = put.reservation().owner;
  const uint64_t sum = landed.digest();
  return put.commit(b.keys[i], declared, hint, &sum);
}

Reply Server::handle_get(Connection* c, const FrameHeader& h) {
  const BatchMeta& b = c->batch;
  const size_t n = b.keys.size();
  LeaseGuard guard{store_, &c->leases};
  c->leases.reserve(n);
  MsgpackWriter& out = c->out;
  out.clear();
  out.map(b.has_ck ? 3 : 2);
  out.str("lens");
  out.array(uint32_t(n));
  std::vector<uint64_t> sums(n, 0);
  std::vector<uint8_t> kinds(b.has_ck ? n : 0, 0);
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    Lease lease;
    if (!store_->acquire(b.keys[i], &lease)) {
      out.integer(-1);
      continue;
    }
    // A value a one-sided writer committed is checked once, before its bytes
    // leave: a bad one is removed and answered as a miss (docs/security.md).
    if (!store_->verify_leased(&lease)) {
      store_->release(lease);
      metrics_->misses++;
      out.integer(-1);
      continue;
    }
    c->leases.push_back(lease);
    total += lease.length;
    if (total > config_.frame_payload_bytes_max) {
      return Reply::fail(FrameStatus::LimitExceeded, "found values exceed the frame payload limit of " +
                                                         std::to_string(config_.frame_payload_bytes_max) +
                                                         " bytes; split the batch");
    }
    out.uint(lease.length);
    sums[i] = sum_for_reader(lease, b);
    if (b.has_ck) kinds[i] = uint8_t(lease.checksum_kind);
  }
  out.str("sums");
  out.array(uint32_t(n));
  for (uint64_t s : sums) out.uint(s);
  if (b.has_ck) write_checksum_kinds(out, kinds);
  send_response(c, h.opcode, h.request_id, FrameStatus::Ok, &c->leases, total);  // arena -> socket
  metrics_->bytes_out += total;
  return {};
}

Reply Server::handle_exists(Connection* c, const FrameHeader& h) {
  const BatchMeta& b = c->batch;
  MsgpackWriter& out = c->out;
  out.clear();
  out.map(2);
  out.str("ex");
  out.array(uint32_t(b.keys.size()));
  std::vector<uint8_t> present;
  const uint64_t prefix = store_->exists(b.keys, &present);  // one lock hold; the policy sees the chain
  for (uint8_t p : present) out.boolean(p != 0);
  out.str("prefix");
  out.uint(prefix);
  send_response(c, h.opcode, h.request_id, FrameStatus::Ok);
  return {};
}

Reply Server::handle_remove(Connection* c, const FrameHeader& h) {
  const BatchMeta& b = c->batch;
  MsgpackWriter& out = c->out;
  out.clear();
  out.map(1);
  out.str("st");
  out.array(uint32_t(b.keys.size()));
  for (std::string_view key : b.keys) out.uint(store_->remove(key) ? 0 : 1);
  send_response(c, h.opcode, h.request_id, FrameStatus::Ok);
  return {};
}

Reply Server::handle_stats(Connection* c, const FrameHeader& h) {
  MsgpackWriter& out = c->out;
  out.clear();
  out.map(4);
  const auto counters = metrics_->counters();
  out.str("counters");
  out.map(uint32_t(counters.size()));
  for (const auto& [name, value] : counters) {
    out.str(name);
    out.uint(value);
  }
  std::vector<std::pair<std::string, int64_t>> gauges;
  store_->fill_gauges(&gauges);
  fill_gauges(&gauges);
  out.str("gauges");
  out.map(uint32_t(gauges.size()));
  for (const auto& [name, value] : gauges) {
    out.str(name);
    out.integer(value);
  }
  const auto histograms = metrics_->histograms();
  out.str("histograms");
  out.map(uint32_t(histograms.size()));
  for (const auto& [name, buckets] : histograms) {
    out.str(name);
    out.array(uint32_t(buckets.size()));
    for (uint64_t v : buckets) out.uint(v);
  }
  const auto sums = metrics_->histogram_sums_us();
  out.str("histogram_sums_us");
  out.map(uint32_t(sums.size()));
  for (const auto& [name, sum] : sums) {
    out.str(name);
    out.uint(sum);
  }
  send_response(c, h.opcode, h.request_id, FrameStatus::Ok);
  return {};
}

Reply Server::handle_ping(Connection* c, const FrameHeader& h) {
  auto [epoch, map_bytes] = cluster_map();
  if (unauthenticated(c)) map_bytes = std::make_shared<const std::string>();  // authenticated peers only
  MsgpackWriter& out = c->out;
  out.clear();
  // How a same-host client reaches this node one-sided: "instance" names it, so
  // a client can check that the Unix socket leads to the node it pinged.
  const bool shm = !config_.unix_socket_path.empty() && !auth_on();
  out.map(shm ? 7 : 6);
  write_kinds_spoken(out);  // "cks": the checksum kinds a PUT may use
  out.str("worth");         // the PUT "worth" version spoken (docs/protocol.md, "Value worth")
  out.uint(kWorthVersion);
  out.str("version");
  out.str(config_.version);
  out.str("epoch");
  out.integer(epoch);
  out.str("map");
  out.bin(*map_bytes);
  out.str("instance");
  out.str(config_.instance_id);
  if (shm) {
    out.str("unix");
    out.str(config_.unix_socket_path);
  }
  send_response(c, h.opcode, h.request_id, FrameStatus::Ok);
  return {};
}

bool Server::grow_meta(Connection* c, size_t bytes) {
  const uint64_t need = bytes > kMetaFreeBytes ? bytes - kMetaFreeBytes : 0;
  if (need > c->meta_charged) {
    // Only a connection holding nothing waits: two half-grown buffers waiting
    // for each other's bytes would otherwise hold the budget until they time out.
    const int64_t deadline = c->meta_charged > 0 ? 0 : budget_wait_deadline(c);
    if (!meta_buffers_.acquire(c->owner, need - c->meta_charged, deadline)) return false;
    c->meta_charged = need;
  }
  c->meta.reserve(bytes);
  return true;
}

bool Server::expire_shm(Connection* c) {
  const size_t leased = c->shm.leased_keys();
  const bool reservation_expired = c->shm.expire(store_, now_us());
  metrics_->shm_lease_expiries += leased - c->shm.leased_keys();
  if (reservation_expired) metrics_->shm_reservation_expiries++;
  return reservation_expired;
}

void Server::release_meta(Connection* c) {
  std::vector<uint8_t>().swap(c->meta);
  meta_buffers_.release(c->owner, c->meta_charged);
  c->meta_charged = 0;
}

// A request waits for a budget at most the stall timeout, and never past its frame's deadline.
int64_t Server::budget_wait_deadline(const Connection* c) const {
  if (stopping_) return 0;
  const int64_t wait_end = now_us() + int64_t(config_.stall_timeout_s * 1e6);
  return c->deadline_us > 0 ? std::min(c->deadline_us, wait_end) : wait_end;
}

bool Server::unauthenticated(const Connection* c) const { return auth_on() && c->tenant == nullptr; }

void Server::fill_gauges(std::vector<std::pair<std::string, int64_t>>* out) const {
  out->emplace_back("connections_open", metrics_->connections_open.load());
  {
    std::lock_guard<std::mutex> lock(conns_mu_);
    out->emplace_back("connections_unauthenticated", int64_t(preauth_used_));
  }
  out->emplace_back("put_reserved_bytes", int64_t(reservations_.used()));
  out->emplace_back("meta_buffer_bytes", int64_t(meta_buffers_.used()));
}

void Server::send_stale_epoch(Connection* c, const FrameHeader& h) {
  metrics_->requests_stale_epoch++;
  const auto [epoch, map_bytes] = cluster_map();
  MsgpackWriter& out = c->out;
  out.clear();
  out.map(4);
  out.str("error");
  out.str("request epoch " + std::to_string(c->batch.epoch) + " is older than this node's cluster map (epoch " +
          std::to_string(epoch) + "); nothing was done: adopt the map in \"map\" and resend to its owners");
  out.str("kind");
  out.str("stale_epoch");
  out.str("epoch");
  out.integer(epoch);
  out.str("map");
  out.bin(*map_bytes);
  send_response(c, h.opcode, h.request_id, FrameStatus::StaleEpoch);
}

}  // namespace gcache
