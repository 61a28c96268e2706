// What the data server's handlers share: one connection's state, a batch
// request's parsed metadata, and the response helpers. Private to the server
// (server/server.cpp, server/shm.cpp).
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/assert.h"
#include "common/checksum.h"
#include "common/frame.h"
#include "common/metrics.h"
#include "common/msgpack_lite.h"
#include "server/auth.h"
#include "server/io.h"
#include "server/limits.h"
#include "server/server.h"
#include "server/shm_session.h"
#include "store/store.h"

namespace gcache {

// Keys and per-key numbers of one batch request; views point into the
// connection's meta buffer.
struct BatchMeta {
  std::vector<std::string_view> keys;
  std::vector<uint64_t> lens;
  std::vector<uint64_t> sums;
  std::vector<uint64_t> leases;        // RELEASE: lease ids
  std::vector<uint64_t> reservations;  // RELEASE: reservation ids
  std::vector<uint64_t> bad;           // RELEASE: arena offsets of leased values whose bytes did not match
  int64_t epoch = 0;                   // the client's cluster-map epoch, if has_epoch
  uint64_t res = 0;                    // COMMIT: the reservation id, if has_res
  uint64_t inline_max = 0;             // LOOKUP: values up to this size come in the payload, unleased
  bool chain_continues = false;        // RESERVE "cont": same put batch (chain) as the previous RESERVE
  bool chain_ends = true;              // RESERVE "last": holds the batch's last value
  bool reader_verifies = false;        // LOOKUP "vfy": the client checks every leased value's sum itself
  // "ck": the kind of "sums" (PUT_BATCH, COMMIT), or on a read (GET_BATCH,
  // LOOKUP) that the client reads "cks"; absent: xxh64, a peer from before XXH3.
  ChecksumKind checksum_kind = ChecksumKind::Xxh64;
  bool has_ck = false;
  bool sums_trail = false;  // PUT_BATCH "trail": each value is followed by its 8-byte sum in the payload
  // PUT_BATCH "worth" (docs/protocol.md, "Value worth"): per key its ValueKind
  // and recompute cost; checked against the batch in Server::handle_put.
  bool has_worth = false;
  uint64_t worth_version = 0;
  std::vector<uint64_t> worth_kinds, worth_costs;
  bool has_keys = false, has_lens = false, has_sums = false, has_epoch = false, has_res = false;
  void clear() {
    keys.clear();
    lens.clear();
    sums.clear();
    leases.clear();
    reservations.clear();
    bad.clear();
    reader_verifies = false;
    inline_max = 0;
    chain_continues = false;
    chain_ends = true;
    checksum_kind = ChecksumKind::Xxh64;
    has_ck = sums_trail = false;
    has_worth = false;
    worth_version = 0;
    worth_kinds.clear();
    worth_costs.clear();
    has_keys = has_lens = has_sums = has_epoch = has_res = false;
  }
};

// Outcome of handling one frame.
struct Server::Reply {
  FrameStatus status = FrameStatus::Ok;
  std::string error;
  static Reply fail(FrameStatus s, std::string message) { return Reply{s, std::move(message)}; }
};
using Reply = Server::Reply;

// What a connection's thread is doing, for the accept loop's choice of a
// connection to close to make room (server/admission.cpp): auth off, only an
// Idle one (waiting for a frame; no leases, reservations or RDMA) may become
// Evicted; an unauthenticated one (auth on) is dropped whatever it does.
enum class Activity : uint8_t { Busy, Idle, Evicted };

struct Server::Connection {
  int fd = -1;
  SocketTimer timer;  // fd and its kernel timeouts (see arm)
  int64_t accepted_us = 0;
  const Tenant* tenant = nullptr;  // set by a successful AUTH (auth on only)
  bool nonce_issued = false;       // a challenge is outstanding (single use)
  uint8_t nonce[kAuthNonceBytes] = {};
  std::string keys_buf;                  // the request's keys with the tenant prefix
  std::string peer;                      // the peer's address (no port): --connections-per-address-max
  std::string owner;                     // whose budget shares it uses: "a:" + peer, or "t:" + tenant
  std::atomic<int64_t> last_work_us{0};  // last data request or AUTH: the idle timeout counts from here
  std::atomic<Activity> activity{Activity::Busy};
  // Slots (server/admission.cpp), guarded by the server's conns_mu_.
  bool holds_slot = false;  // counted in connections_max and the address's cap
  bool preauth = false;     // counted in the pre-auth budget (auth on, before AUTH)
  bool evicted = false;     // closed to make room: its thread ends at its next step
  // Its address when it was accepted (auth on): lost an unauthenticated
  // connection lately (a reconnect), authenticated lately (server/admission.cpp).
  bool reconnect = false;
  bool vouched = false;
  // A frame arrived before AUTH: the pre-auth budget drops silent connections first.
  std::atomic<bool> spoke{false};
  uint64_t meta_charged = 0;  // meta buffer bytes charged to the global budget
  std::thread thread;
  std::atomic<bool> finished{false};
  std::vector<uint8_t> meta;
  std::vector<uint8_t> scratch;
  ReadAhead in;  // every read of a frame goes through it (server/io.h)
  // Server::spin_for_frame: the last frame was small (its next one may be microseconds
  // behind), and frames left to wait before spinning again after a spin that caught none.
  bool small_frame = false;
  uint8_t spin_skip = 0;
  MsgpackWriter out{kFrameHeaderBytes};
  BatchMeta batch;
  std::vector<Lease> leases;
  std::vector<iovec> iov;
  int64_t deadline_us = 0;  // of the frame being read (0 = none); see transfer_deadline_us
  double stall_timeout_s = 0;
  bool is_unix = false;  // accepted on --unix-socket: SHM_ATTACH is answered
  ShmSession shm;        // leases and reservations of the one-sided opcodes
  uint64_t rdma_id = 0;  // set by its first RDMA_CONNECT: the RDMA handler's closed() is due
};

// One PUT_BATCH frame's place in puts_in_flight_: counted by admit(), released
// by release() once its values are stored, or by the destructor on whatever
// path the frame ends (error reply, dropped connection, exception).
class Server::PutAdmission {
 public:
  explicit PutAdmission(Server* server) : server_(server) {}
  PutAdmission(const PutAdmission&) = delete;
  PutAdmission& operator=(const PutAdmission&) = delete;
  ~PutAdmission() { release(); }

  // One lock: refuses a request epoch below the server's (false, not
  // counted), else counts the frame at the server's current epoch.
  bool admit(bool has_epoch, int64_t request_epoch) {
    std::lock_guard<std::mutex> lock(server_->admit_mu_);
    const int64_t current = server_->epoch_.load(std::memory_order_relaxed);
    if (has_epoch && request_epoch < current) return false;
    ++server_->puts_in_flight_[current];  // allocates once per epoch: the entry outlives its frames
    epoch_ = current;
    counted_ = true;
    return true;
  }

  void release() {
    if (!counted_) return;
    counted_ = false;
    bool drained;
    {
      std::lock_guard<std::mutex> lock(server_->admit_mu_);
      auto it = server_->puts_in_flight_.find(epoch_);
      GCACHE_ASSERT(it != server_->puts_in_flight_.end() && it->second > 0);
      drained = --it->second == 0;
      // An older epoch's entry can never count again (set_cluster_map drops the idle ones).
      if (drained && epoch_ < server_->epoch_.load(std::memory_order_relaxed)) server_->puts_in_flight_.erase(it);
    }
    if (drained) server_->admit_cv_.notify_all();
  }

 private:
  Server* server_;
  int64_t epoch_ = 0;
  bool counted_ = false;
};

// Releases every lease of a GET response, also when sending fails.
struct LeaseGuard {
  Store* store;
  std::vector<Lease>* leases;
  ~LeaseGuard() {
    for (const Lease& l : *leases) {
      GCACHE_ASSERT(l.entry != nullptr && l.data != nullptr);
      store->release(l);
    }
    leases->clear();
  }
};

// Bytes held in a ByteBudget: given back by release() or when the guard ends.
class BudgetHold {
 public:
  BudgetHold(ByteBudget* budget, const std::string& owner, uint64_t bytes)
      : budget_(budget), owner_(&owner), bytes_(bytes) {}
  BudgetHold(const BudgetHold&) = delete;
  BudgetHold& operator=(const BudgetHold&) = delete;
  ~BudgetHold() { release(); }
  void release() {
    if (budget_ == nullptr) return;
    budget_->release(*owner_, bytes_);
    budget_ = nullptr;
  }

 private:
  ByteBudget* budget_;
  const std::string* owner_;
  uint64_t bytes_;
};

// One begin_put reservation: commit() publishes it; on any other path out
// (an error reply, a dropped connection, an exception) the guard aborts it.
class PutGuard {
 public:
  explicit PutGuard(Store* store) : store_(store) {}
  PutGuard(const PutGuard&) = delete;
  PutGuard& operator=(const PutGuard&) = delete;
  ~PutGuard() {
    if (held_) store_->abort_put(r_);
  }
  PutStatus begin(std::string_view key, uint64_t length, OwnerId owner) {
    const PutStatus s = store_->begin_put(key, length, &r_, owner);
    held_ = s == PutStatus::Stored;
    return s;
  }
  PutStatus commit(std::string_view key, const ValueChecksum& declared, const PutHint& hint, const uint64_t* landed) {
    held_ = false;  // commit_put owns the reservation from here, also when it throws
    return store_->commit_put(key, r_, declared, hint, landed);
  }
  const Reservation& reservation() const { return r_; }

 private:
  Store* store_;
  Reservation r_;
  bool held_ = false;
};

// Reads and drops n bytes through the connection's bounded scratch buffer.
void discard(Server::Connection* c, uint64_t n);
// Sends c->out (header filled in here) and the leased values as the payload.
void send_response(Server::Connection* c, uint8_t opcode, uint64_t request_id, FrameStatus status,
                   const std::vector<Lease>* payload = nullptr, uint64_t payload_len = 0);
void send_error(Server::Connection* c, Metrics* m, uint8_t opcode, uint64_t request_id, FrameStatus status,
                const std::string& message);
// After a fatal error response: half-close so the response is delivered
// before FIN, then drain (bounded) so closing does not reset the peer.
void linger_close(Server::Connection* c);
// Parses a request's metadata map: "keys", "lens", "sums", "epoch"; other
// keys are skipped. An empty metadata section means {}.
Server::Reply parse_batch_meta(const std::vector<uint8_t>& meta, uint32_t batch_keys_max, BatchMeta* b);
// A parsed "worth" (PUT_BATCH, RESERVE) against its n keys: the version this
// node speaks, one kind and one cost per key, known kinds.
Server::Reply check_worth(const BatchMeta& b, size_t n);
// The checksum a reader gets for a leased value: its own, or for a reader
// that speaks only xxh64 (no "ck" in its request) the value's xxh64, taken
// from the leased bytes now (a pass a legacy peer costs; new peers never).
inline uint64_t sum_for_reader(const Lease& l, const BatchMeta& b) {
  if (b.has_ck || l.checksum_kind == ChecksumKind::Xxh64) return l.checksum;
  return xxh64(l.data, l.length);
}
// Writes "cks": the kind of each value's sum (misses 0), for a reader that speaks them.
inline void write_checksum_kinds(MsgpackWriter& out, const std::vector<uint8_t>& kinds) {
  out.str("cks");
  out.array(uint32_t(kinds.size()));
  for (uint8_t k : kinds) out.uint(k);
}
// Writes "cks": every checksum kind this node speaks (PING, SHM_ATTACH).
inline void write_kinds_spoken(MsgpackWriter& out) {
  out.str("cks");
  out.array(kChecksumKindsSpoken);
  for (uint8_t k = 0; k < kChecksumKindsSpoken; ++k) out.uint(k);
}
// Gives every key of the request its store name (the tenant prefix, auth on).
void namespace_keys(Server::Connection* c);
// Whose quota a stored value counts against.
OwnerId owner_of(const Server::Connection* c, const TenantTable* tenants, std::string_view stored_key);

}  // namespace gcache
