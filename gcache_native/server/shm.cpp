// The one-sided opcodes (docs/protocol.md, "Shared memory and RDMA"): a
// same-host client maps the arena (SHM_ATTACH over the Unix socket), asks
// where values are (LOOKUP, under a lease) and copies them itself; a put
// reserves arena blocks (RESERVE), the client writes them, and COMMIT
// publishes them with the client's checksums, unread (every reader checks).
// With RDMA the same answers carry the arena's remote address and rkey, and
// the client reads and writes with RDMA instead of memcpy.
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <stdexcept>

#include "server/connection.h"
#include "server/server.h"

namespace gcache {

using Reply = Server::Reply;

namespace {

// What one LOOKUP answer may carry inline (its "inline_max" is capped to it).
constexpr uint64_t kLookupInlineBytesMax = 1 << 20;

const char* kShmOffWithAuth =
    "one-sided access is off on a node with --auth-file: the arena holds every tenant's "
    "values; use transport='tcp'";

// The response in c->out, with `fd` passed alongside its first byte (SCM_RIGHTS).
void send_response_with_fd(Server::Connection* c, uint8_t opcode, uint64_t request_id, int fd) {
  std::vector<uint8_t>& buf = c->out.buffer();
  build_frame_header(buf.data(), opcode, kFlagResponse, request_id, uint32_t(c->out.body_size()), FrameStatus::Ok, 0);
  iovec iov{buf.data(), buf.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  cmsghdr* cm = CMSG_FIRSTHDR(&msg);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cm), &fd, sizeof(int));
  ssize_t sent;
  do sent = sendmsg(c->fd, &msg, MSG_NOSIGNAL);
  while (sent < 0 && errno == EINTR);
  if (sent < 0) throw ConnectionLost{false};
  if (size_t(sent) < buf.size()) {  // the rest without the descriptor
    iovec rest{buf.data() + sent, buf.size() - size_t(sent)};
    send_all(c->timer, &rest, 1, transfer_deadline_us(now_us(), c->stall_timeout_s, rest.iov_len));
  }
}

}  // namespace

int Server::listen_unix() {
  const std::string& path = config_.unix_socket_path;
  if (path.empty()) return -1;
  sockaddr_un addr{};
  if (path.size() >= sizeof addr.sun_path) {
    throw BindError("--unix-socket path '" + path + "' is longer than " + std::to_string(sizeof addr.sun_path - 1) +
                    " bytes; pick a shorter one");
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  struct stat st {};
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode))
      throw BindError("--unix-socket path '" + path + "' exists and is not a socket; remove it or pick another");
    // A socket left by an earlier run: in use only if something accepts on it.
    const int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const bool live = probe >= 0 && connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    if (probe >= 0) close(probe);
    if (live) throw BindError("--unix-socket '" + path + "' is in use by another server; pick another path");
    unlink(path.c_str());
  }
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw BindError(std::string("cannot create a Unix socket: ") + std::strerror(errno));
  // Owner only: a process that maps the arena can read and write every value
  // (docs/security.md), which the server's own user can do anyway.
  const mode_t old_mask = umask(0177);
  const bool bound = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  const int bind_errno = errno;
  umask(old_mask);
  if (!bound || listen(fd, 1024) != 0) {
    const std::string why = std::strerror(bound ? errno : bind_errno);
    close(fd);
    throw BindError("cannot listen on Unix socket '" + path + "': " + why);
  }
  return fd;
}

void Server::end_shm_session(Connection* c) {
  if (c->rdma_id != 0) {  // its queue pair goes first: no RDMA into blocks released below
    std::shared_ptr<const RdmaConnectHandler> handler;
    {
      std::lock_guard<std::mutex> lock(rdma_mu_);
      handler = rdma_handler_;
    }
    if (handler != nullptr) handler->closed(c->rdma_id);
    c->rdma_id = 0;
  }
  const uint64_t budget = c->shm.release_all(store_);
  if (budget > 0) reservations_.release(c->owner, budget);
}

Reply Server::handle_shm_attach(Connection* c, const FrameHeader& h) {
  if (auth_on()) return Reply::fail(FrameStatus::Forbidden, kShmOffWithAuth);
  if (!c->is_unix) {
    return Reply::fail(FrameStatus::Forbidden,
                       "SHM_ATTACH is answered only on the node's --unix-socket (same host); "
                       "over TCP use LOOKUP with RDMA, or GET_BATCH");
  }
  metrics_->shm_attaches++;
  MsgpackWriter& out = c->out;
  out.clear();
  out.map(5);
  write_kinds_spoken(out);       // "cks": the checksum kinds COMMIT may use
  out.str("reserve_bytes_max");  // what one connection's RESERVEs may hold at once
  out.uint(reserve_bytes_per_connection());
  out.str("arena_bytes");
  out.uint(store_->arena_bytes());
  out.str("instance");  // one mapping per server instance serves all of a client's connections
  out.str(config_.instance_id);
  out.str("lease_ms");
  out.uint(uint64_t(config_.shm_lease_s * 1000));
  send_response_with_fd(c, h.opcode, h.request_id, store_->arena_fd());
  return {};
}

namespace {

void write_rdma_fields(MsgpackWriter& out, uint64_t addr, uint32_t rkey) {
  out.str("addr");
  out.uint(addr);
  out.str("rkey");
  out.uint(rkey);
}

// Each key's status before any budget is taken: KEY_INVALID or
// VALUE_TOO_LARGE at once for one that can never be stored (it must not wait
// for room it could never use), STORED for one that may be. Returns the sum
// of the latter's lengths (saturating): the budget to take.
uint64_t check_reserve(const Store& store, Metrics* metrics, const BatchMeta& b, std::vector<uint8_t>* statuses) {
  uint64_t total = 0;
  statuses->assign(b.keys.size(), uint8_t(PutStatus::Stored));
  for (size_t i = 0; i < b.keys.size(); ++i) {
    const PutStatus s = store.check_put(b.keys[i], b.lens[i]);
    (*statuses)[i] = uint8_t(s);
    if (s == PutStatus::TooLarge) metrics->puts_too_large++;
    if (s == PutStatus::Stored) total = b.lens[i] > UINT64_MAX - total ? UINT64_MAX : total + b.lens[i];
  }
  return total;
}

}  // namespace

Reply Server::handle_lookup(Connection* c, const FrameHeader& h) {
  if (auth_on()) return Reply::fail(FrameStatus::Forbidden, kShmOffWithAuth);
  const BatchMeta& b = c->batch;
  const size_t n = b.keys.size();
  if (!c->shm.can_lease(n)) {
    return Reply::fail(FrameStatus::LimitExceeded, "this connection holds " + std::to_string(c->shm.leased_keys()) +
                                                       " leased values (at most " +
                                                       std::to_string(ShmSession::kLeasedKeysMax) + " in " +
                                                       std::to_string(ShmSession::kLeaseGroupsMax) +
                                                       " LOOKUPs): RELEASE leases before asking for more");
  }
  // Values up to inline_max come in the payload, as GET_BATCH sends them (no
  // lease outlives the answer): for small values a socket copy is cheaper than
  // a lease, a copy and a RELEASE. The rest are leased for the client to copy.
  const uint64_t inline_max = std::min<uint64_t>(b.inline_max, kLookupInlineBytesMax);
  LeaseGuard sent{store_, &c->leases};  // the inline values, released once sent
  std::vector<Lease> kept = c->shm.spare_leases();
  kept.reserve(n);
  const uint8_t* base = store_->arena_base();
  std::vector<uint64_t> offsets(n, 0), sums(n, 0);
  std::vector<uint8_t> kinds(b.has_ck ? n : 0, 0);
  std::vector<int64_t> lens(n, -1);
  std::vector<uint8_t> inlined(n, 0);
  std::vector<uint8_t> verified(b.reader_verifies ? n : 0, 0);
  uint64_t total = 0, inline_total = 0;
  for (size_t i = 0; i < n; ++i) {
    Lease lease;
    if (!store_->acquire(b.keys[i], &lease)) continue;
    const bool inline_fits = lease.length <= inline_max && inline_total + lease.length <= kLookupInlineBytesMax;
    // A value a one-sided writer committed is checked here when its bytes go
    // in this answer, or to a reader that does not check leased values itself
    // (a client from before "vfy"): a bad one is removed and answered a miss.
    if (!lease.verified && (inline_fits || !b.reader_verifies || !b.has_ck) && !store_->verify_leased(&lease)) {
      store_->release(lease);
      metrics_->misses++;
      continue;
    }
    total += lease.length;
    if (b.reader_verifies) verified[i] = lease.verified ? 1 : 0;
    lens[i] = int64_t(lease.length);
    sums[i] = sum_for_reader(lease, b);
    if (b.has_ck) kinds[i] = uint8_t(lease.checksum_kind);
    // An empty value always counts as inline (0 <= inline_max): it has no
    // bytes to copy, so it never takes a lease; "lens" 0 says it is there.
    if (inline_fits) {
      inline_total += lease.length;
      inlined[i] = 1;
      c->leases.push_back(lease);
    } else {
      offsets[i] = uint64_t(lease.data - base);
      if (!lease.verified && config_.shm_scrub && store_->queue_check(lease)) wake_scrubber();  // read: check it once
      kept.push_back(lease);
    }
  }
  // As GET_BATCH, bounds what one request pins (the client splits the batch);
  // one value is always served: it moves no bytes through a frame.
  if (total > config_.frame_payload_bytes_max && kept.size() + c->leases.size() > 1) {
    for (const Lease& l : kept) store_->release(l);
    return Reply::fail(FrameStatus::LimitExceeded, "found values exceed the frame payload limit of " +
                                                       std::to_string(config_.frame_payload_bytes_max) +
                                                       " bytes; split the batch");
  }
  metrics_->bytes_out += total;
  const uint64_t lease_id =
      kept.empty() ? 0 : c->shm.add_leases(std::move(kept), now_us() + int64_t(config_.shm_lease_s * 1e6));
  const uint32_t rkey = rdma_rkey_.load();
  MsgpackWriter& out = c->out;
  out.clear();
  out.map(4 + (b.inline_max > 0 ? 1 : 0) + (rkey ? 2 : 0) + (b.has_ck ? 1 : 0) + (b.reader_verifies ? 1 : 0));
  out.str("offs");
  out.array(uint32_t(n));
  for (uint64_t o : offsets) out.uint(o);
  out.str("lens");
  out.array(uint32_t(n));
  for (int64_t l : lens) out.integer(l);
  out.str("sums");
  out.array(uint32_t(n));
  for (uint64_t s : sums) out.uint(s);
  if (b.has_ck) write_checksum_kinds(out, kinds);
  out.str("lease");
  out.uint(lease_id);
  if (b.inline_max > 0) {
    out.str("inl");
    out.array(uint32_t(n));
    for (uint8_t x : inlined) out.boolean(x != 0);
  }
  if (b.reader_verifies) {  // "vf": the node checked it (a leased copy of it needs no hash)
    out.str("vf");
    out.array(uint32_t(n));
    for (uint8_t x : verified) out.boolean(x != 0);
  }
  if (rkey) write_rdma_fields(out, rdma_addr_.load(), rkey);
  send_response(c, h.opcode, h.request_id, FrameStatus::Ok, &c->leases, inline_total);
  return {};
}

Reply Server::handle_release(Connection* c, const FrameHeader& h) {
  const BatchMeta& b = c->batch;
  uint64_t released = 0;
  for (uint64_t id : b.leases) {
    c->shm.verify_reported(store_, id, b.bad, store_->arena_base());  // "bad": the reader's copy did not match
    released += c->shm.release_lease(store_, id) ? 1 : 0;
  }
  for (uint64_t id : b.reservations) {
    ShmSession::ReserveGroup group;
    if (!c->shm.take_reservation(id, &group)) continue;
    reservations_.release(c->owner, ShmSession::abort(store_, group));
    ++released;
  }
  if (h.flags & kFlagNoReply) return {};
  MsgpackWriter& out = c->out;
  out.clear();
  out.map(1);
  out.str("released");
  out.uint(released);
  send_response(c, h.opcode, h.request_id, FrameStatus::Ok);
  return {};
}

Reply Server::handle_reserve(Connection* c, const FrameHeader& h) {
  if (auth_on()) return Reply::fail(FrameStatus::Forbidden, kShmOffWithAuth);
  const BatchMeta& b = c->batch;
  const size_t n = b.keys.size();
  if (!b.has_lens || b.lens.size() != n)
    return Reply::fail(FrameStatus::BadFrame, "RESERVE needs \"keys\" and \"lens\" of equal length");
  if (b.has_worth) {
    if (Reply bad = check_worth(b, n); bad.status != FrameStatus::Ok) return bad;  // nothing reserved
  }
  if (!c->shm.can_reserve()) {
    return Reply::fail(FrameStatus::LimitExceeded, "this connection holds " +
                                                       std::to_string(ShmSession::kReserveGroupsMax) +
                                                       " open reservations: COMMIT or RELEASE them first");
  }
  ShmSession::ReserveGroup group = c->shm.spare_reserve_group();
  group.keys.resize(n);
  group.reservations.resize(n);
  group.has_epoch = b.has_epoch;
  group.epoch = b.epoch;
  group.chain_continued = b.chain_continues && c->shm.chain != 0;
  group.chain = group.chain_continued ? c->shm.chain : store_->new_put_batch();
  group.chain_ends = b.chain_ends;
  if (b.has_worth) {
    group.worth_kinds = b.worth_kinds;
    group.worth_costs = b.worth_costs;
  }
  c->shm.chain = group.chain;
  const uint64_t total = check_reserve(*store_, metrics_, b, &group.statuses);
  // The blocks count against the PUT reservation budget until COMMIT. Only a
  // connection holding no reservation waits for room: one waiting while it
  // holds some could wait on its own COMMIT, queued behind this frame.
  const int64_t wait_until = c->shm.holds_reservations() ? 0 : budget_wait_deadline(c);
  const bool budgeted = reservations_.acquire(c->owner, total, wait_until);
  if (!budgeted) metrics_->puts_reserve_refused++;
  const uint8_t* base = store_->arena_base();
  for (size_t i = 0; i < n; ++i) {
    group.keys[i].assign(b.keys[i]);
    if (group.statuses[i] != uint8_t(PutStatus::Stored)) continue;  // refused above
    if (!budgeted) {
      group.statuses[i] = uint8_t(PutStatus::NoSpace);
      metrics_->puts_no_space++;
      continue;
    }
    Reservation r;
    // begin_put counts an Exists or a NoSpace itself (as for PUT_BATCH): not again here.
    const PutStatus s = store_->begin_put(b.keys[i], b.lens[i], &r, owner_of(c, config_.tenants.get(), b.keys[i]));
    group.statuses[i] = uint8_t(s);
    if (s == PutStatus::Stored) {
      group.reservations[i] = r;
      group.budget_bytes += b.lens[i];
    }
  }
  if (budgeted && total > group.budget_bytes) reservations_.release(c->owner, total - group.budget_bytes);
  std::vector<uint64_t> offsets(n, 0);
  for (size_t i = 0; i < n; ++i)
    if (group.reservations[i].data != nullptr) offsets[i] = uint64_t(group.reservations[i].data - base);
  const std::vector<uint8_t> statuses = group.statuses;
  uint64_t res_id = 0;
  if (group.budget_bytes > 0 || std::any_of(group.reservations.begin(), group.reservations.end(),
                                            [](const Reservation& r) { return r.data != nullptr; })) {
    group.deadline_us = now_us() + int64_t(config_.shm_lease_s * 1e6);
    res_id = c->shm.add_reservation(std::move(group));
  }
  const uint32_t rkey = rdma_rkey_.load();
  MsgpackWriter& out = c->out;
  out.clear();
  out.map(rkey ? 5 : 3);
  out.str("st");
  out.array(uint32_t(n));
  for (uint8_t s : statuses) out.uint(s);
  out.str("offs");
  out.array(uint32_t(n));
  for (uint64_t o : offsets) out.uint(o);
  out.str("res");
  out.uint(res_id);
  if (rkey) write_rdma_fields(out, rdma_addr_.load(), rkey);
  send_response(c, h.opcode, h.request_id, FrameStatus::Ok);
  return {};
}

Reply Server::handle_commit(Connection* c, const FrameHeader& h) {
  if (auth_on()) return Reply::fail(FrameStatus::Forbidden, kShmOffWithAuth);
  const BatchMeta& b = c->batch;
  if (!b.has_res || !b.has_sums)
    return Reply::fail(FrameStatus::BadFrame, "COMMIT needs \"res\" (a RESERVE's id) and \"sums\"");
  ShmSession::ReserveGroup group;
  if (!c->shm.take_reservation(b.res, &group)) {
    return Reply::fail(FrameStatus::BadFrame,
                       "unknown reservation " + std::to_string(b.res) +
                           ": it was committed or released already, or never made on this connection");
  }
  const size_t n = group.keys.size();
  if (b.sums.size() != n) {
    reservations_.release(c->owner, ShmSession::abort(store_, group));
    return Reply::fail(FrameStatus::BadFrame, "COMMIT needs one sum per key of its RESERVE (" + std::to_string(n) +
                                                  "), got " + std::to_string(b.sums.size()) +
                                                  "; the reservation was released");
  }
  // Counted like a PUT_BATCH frame from here until its values are published,
  // at the epoch the RESERVE was admitted under (wait_puts_admitted_before).
  PutAdmission admission(this);
  if (!admission.admit(group.has_epoch, group.epoch)) {
    reservations_.release(c->owner, ShmSession::abort(store_, group));
    c->batch.epoch = group.epoch;
    send_stale_epoch(c, h);
    return {};
  }
  // The batch's last value is its tail (as PUT_BATCH's), once the batch has two or more.
  const bool tail_at_end = group.chain_ends && (n >= 2 || group.chain_continued);
  uint64_t stored_bytes = 0;
  for (size_t i = 0; i < n; ++i) {
    const Reservation& r = group.reservations[i];
    if (r.data == nullptr) continue;
    // Published without reading the block: the writer's sum is taken on trust
    // and every reader checks it (docs/security.md, "Checksums a writer declares").
    PutHint hint{group.chain, tail_at_end && i + 1 == n, r.owner};
    if (!group.worth_costs.empty()) {
      hint.worth_cost = group.worth_costs[i];
      hint.kind = ValueKind(group.worth_kinds[i]);
    }
    const PutStatus s = store_->commit_unverified(group.keys[i], r, ValueChecksum{b.sums[i], b.checksum_kind}, hint);
    group.statuses[i] = uint8_t(s);
    if (s == PutStatus::Stored) stored_bytes += r.length;
  }
  reservations_.release(c->owner, group.budget_bytes);
  admission.release();
  metrics_->bytes_in += stored_bytes;
  MsgpackWriter& out = c->out;
  out.clear();
  out.map(1);
  out.str("st");
  out.array(uint32_t(n));
  for (uint8_t s : group.statuses) out.uint(s);
  c->shm.recycle(std::move(group));
  send_response(c, h.opcode, h.request_id, FrameStatus::Ok);
  return {};
}

// Queue-pair setup goes over this connection: the handler (gcache.server.rdma)
// makes a queue pair for it from the client's endpoint and answers with its own.
Reply Server::handle_rdma_connect(Connection* c, const FrameHeader& h) {
  if (auth_on()) return Reply::fail(FrameStatus::Forbidden, kShmOffWithAuth);
  std::shared_ptr<const RdmaConnectHandler> handler;
  {
    std::lock_guard<std::mutex> lock(rdma_mu_);
    handler = rdma_handler_;
  }
  if (handler == nullptr) {
    return Reply::fail(FrameStatus::Forbidden,
                       "this gcache-server has no RDMA (start it with --rdma-device NAME); "
                       "use transport='tcp'");
  }
  if (c->rdma_id == 0) c->rdma_id = next_rdma_id_++;
  std::string answer;
  const std::string_view meta(reinterpret_cast<const char*>(c->meta.data()), c->meta.size());
  if (!handler->connect(c->rdma_id, meta, &answer)) return Reply::fail(FrameStatus::BadFrame, answer);
  MsgpackReader check(reinterpret_cast<const uint8_t*>(answer.data()), answer.size());
  uint32_t entries = 0;
  if (!check.read_map(&entries)) throw std::runtime_error("the RDMA handler's answer is not a msgpack map");
  for (uint32_t i = 0; i < 2 * entries; ++i)
    if (!check.skip()) throw std::runtime_error("the RDMA handler's answer is not a msgpack map");
  if (!check.at_end()) throw std::runtime_error("the RDMA handler's answer has bytes after its map");
  // An RDMA client holds the arena's rkey, as a Unix-socket client holds its
  // mapping: its reservations get a budget share of their own, as on the Unix
  // socket (moved only while the connection holds nothing under its address).
  if (c->meta_charged == 0 && !c->shm.holds_reservations() && c->owner.rfind("a:", 0) == 0)
    c->owner = "r:" + c->peer + "#" + std::to_string(c->fd);
  MsgpackWriter& out = c->out;
  out.clear();
  std::vector<uint8_t>& buf = out.buffer();
  buf.insert(buf.end(), answer.begin(), answer.end());
  send_response(c, h.opcode, h.request_id, FrameStatus::Ok);
  return {};
}

}  // namespace gcache
