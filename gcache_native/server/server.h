// The node's data server: docs/protocol.md over TCP, one thread per
// connection, payload bytes moved between socket and arena with no copy.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "common/metrics.h"
#include "server/auth.h"
#include "server/limits.h"
#include "store/store.h"

namespace gcache {

struct FrameHeader;

struct ServerConfig {
  std::string host = "127.0.0.1";
  uint16_t port = 7600;                        // 0 = any free port (see Server::port())
  uint32_t connections_max = 1024;             // beyond it: BUSY, then close
  uint32_t connections_per_address_max = 256;  // from one peer address; 0 = no cap
  uint32_t connections_per_tenant_max = 512;   // of one tenant (auth on); 0 = no cap
  double idle_timeout_s = 300;                 // without a data request (PING/STATS do not count)
  double stall_timeout_s = 30;                 // a frame (or a response send) that stops mid-way
  uint32_t meta_bytes_max = 16u << 20;
  uint64_t meta_buffer_bytes_max = 256ull << 20;  // metadata buffers of all connections together
  // Arena bytes PUTs may hold reserved before their values have arrived, all
  // connections together (one peer address or tenant: a quarter of it).
  uint64_t put_reserve_bytes_max = 128ull << 20;
  uint64_t frame_payload_bytes_max = 2ull << 30;  // request payload and response payload
  uint32_t batch_keys_max = 16384;
  int socket_buffer_bytes = 0;    // SO_SNDBUF / SO_RCVBUF; 0 = kernel autotuning (measured faster on loopback)
  int64_t epoch = 0;              // initial cluster-map epoch (see set_cluster_map)
  std::string version = "0.1.0";  // reported by PING
  // Authentication (--auth-file): null = off, every connection may do everything.
  std::shared_ptr<const TenantTable> tenants;
  double auth_timeout_s = 5;  // an unauthenticated connection lives this long
  // The pre-auth budget (auth on): connections that have not authenticated yet
  // count here, not in connections_max or the per-address cap. When it is full
  // an old unauthenticated connection is dropped (server/admission.cpp says
  // which), so a client that authenticates promptly gets in.
  uint32_t preauth_connections_max = 256;
  uint32_t preauth_connections_per_address_max = 64;
  // Same-host clients (docs/protocol.md, "Shared memory and RDMA"): a Unix
  // socket ("" = none) whose connections may map the arena, and how long a
  // LOOKUP lease or a RESERVE reservation lasts.
  std::string unix_socket_path;
  double shm_lease_s = 10;
  bool shm_scrub = true;    // a thread checks values COMMIT published unread (Server::scrub_loop)
  std::string instance_id;  // random per start, reported by PING: a client can tell two paths lead to one server
  // After answering a small request, a connection's thread polls its socket without blocking
  // for up to this long before it sleeps in poll(): a client's next request, a few microseconds
  // behind, is then taken without a wake-up. 0 = never. Bounded: a few threads at once (a
  // share of the cores), backing off on a connection whose frames do not come that fast.
  uint32_t spin_us = 50;
};

// Queue-pair setup for RDMA clients (gcache.server.rdma), called on the
// connection's thread: connect() gets an RDMA_CONNECT's metadata and the
// connection's id; true: *answer is the response metadata (a msgpack map),
// false: *answer says what is wrong with the request. closed(id) runs once
// when a connection that had an RDMA_CONNECT answered ends.
struct RdmaConnectHandler {
  std::function<bool(uint64_t conn_id, std::string_view meta, std::string* answer)> connect;
  std::function<void(uint64_t conn_id)> closed;
};

// Raised when the listening socket cannot be created (port taken, bad host).
class BindError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Counters it owns: requests, bytes_in / bytes_out (value payload bytes),
// connections_accepted, errors_*, the per-opcode latency histograms and the
// connections_open gauge.
class Server {
 public:
  // Binds and listens (throws BindError); serves nothing until start().
  Server(const ServerConfig& config, Store* store, Metrics* metrics);
  ~Server();  // stop(0)

  uint16_t port() const { return port_; }
  void start();

  // Cluster map (docs/cluster.md, "Epochs on the data path"): a data request
  // whose "epoch" is below epoch() is answered STALE_EPOCH with this map and
  // not executed. Throws std::invalid_argument if `epoch` is below the
  // current one (an equal epoch replaces the map) or the map is too large.
  void set_cluster_map(int64_t epoch, std::string map_bytes);
  int64_t epoch() const { return epoch_.load(std::memory_order_acquire); }
  // What one one-sided connection's RESERVEs may hold at once (SHM_ATTACH and
  // RDMA_CONNECT tell clients, who size their put chunks by it).
  uint64_t reserve_bytes_per_connection() const { return config_.put_reserve_bytes_max / 4; }
  // The current epoch and map, read together.
  std::pair<int64_t, std::shared_ptr<const std::string>> cluster_map() const;
  // Server-side gauges: connections_open, put_reserved_bytes, meta_buffer_bytes.
  void fill_gauges(std::vector<std::pair<std::string, int64_t>>* out) const;
  // RDMA (gcache.server.rdma): the registered arena's remote address and rkey,
  // sent with every LOOKUP and RESERVE answer from then on; rkey 0 turns it off.
  void set_rdma_region(uint64_t addr, uint32_t rkey) {
    rdma_addr_.store(addr);
    rdma_rkey_.store(rkey);
  }
  // Answers RDMA_CONNECT from then on (null: refused, the default).
  void set_rdma_connect_handler(std::shared_ptr<const RdmaConnectHandler> handler) {
    std::lock_guard<std::mutex> lock(rdma_mu_);
    rdma_handler_ = std::move(handler);
  }

  // Waits until no PUT_BATCH frame admitted while the server epoch was below
  // `epoch` is still storing (a frame counts from its epoch check until its
  // last value is committed, or it fails). True when there are none, false
  // after timeout_s. The rebalancer calls it after set_cluster_map(epoch), so
  // its key listing sees every value a pre-map writer was still sending.
  bool wait_puts_admitted_before(int64_t epoch, double timeout_s);
  // Stops accepting, lets every connection finish the requests it has
  // already received, closes idle ones, and after grace_s cuts the rest off.
  // Returns once every thread has exited. Idempotent.
  void stop(double grace_s);

  struct Connection;   // private to server/server.cpp
  struct Reply;        // private to server/server.cpp
  class PutAdmission;  // private to server/server.cpp

 private:
  // What one step of serve() leaves to do: go on with this frame, wait for
  // the next one, or close the connection.
  enum class Flow { Proceed, Retry, Close };

  void accept_loop();
  // Checks the values COMMIT published unread (Store::scrub), in batches, until stop.
  void scrub_loop();
  void wake_scrubber();  // a value was queued for it
  void reap_finished();
  // One connection's thread: await_frame, read_frame_header, check_frame,
  // dispatch, in a loop; end_connection when it ends.
  void serve(Connection* conn);
  Flow await_frame(Connection* c);
  bool spin_for_frame(Connection* c);  // true: the next frame's first bytes are buffered
  Flow read_frame_header(Connection* c, FrameHeader* h, int64_t* start_us);
  bool check_frame(Connection* c, const FrameHeader& h);                 // false: answered, close
  bool dispatch(Connection* c, const FrameHeader& h, int64_t start_us);  // false: close
  void end_connection(Connection* c);
  int64_t frame_deadline_us(const Connection* c, int64_t first_byte_us, uint64_t frame_bytes) const;
  void read_meta(Connection* c, const FrameHeader& h);
  // One frame past check_frame: its metadata, check_request, the epoch check, run_handler.
  void handle_frame(Connection* c, const FrameHeader& h);
  bool check_request(Connection* c, const FrameHeader& h);  // false: answered
  void run_handler(Connection* c, const FrameHeader& h, PutAdmission* admission);
  Reply handle_put(Connection* c, const FrameHeader& h, PutAdmission* admission);
  PutStatus put_one(Connection* c, size_t i, PutHint hint, uint64_t* consumed);
  Reply handle_get(Connection* c, const FrameHeader& h);
  Reply handle_exists(Connection* c, const FrameHeader& h);
  Reply handle_remove(Connection* c, const FrameHeader& h);
  Reply handle_stats(Connection* c, const FrameHeader& h);
  Reply handle_ping(Connection* c, const FrameHeader& h);
  // One-sided access (server/shm.cpp).
  Reply handle_shm_attach(Connection* c, const FrameHeader& h);
  Reply handle_lookup(Connection* c, const FrameHeader& h);
  Reply handle_release(Connection* c, const FrameHeader& h);
  Reply handle_reserve(Connection* c, const FrameHeader& h);
  Reply handle_commit(Connection* c, const FrameHeader& h);
  Reply handle_rdma_connect(Connection* c, const FrameHeader& h);
  bool expire_shm(Connection* c);                         // drops expired leases; true: a reservation expired, close
  void end_shm_session(Connection* c);                    // the connection is closing: drop its leases and reservations
  int listen_unix();                                      // binds config_.unix_socket_path; -1 when unset
  bool handle_auth(Connection* c, const FrameHeader& h);  // server/auth.cpp; false: close the connection
  bool auth_on() const { return config_.tenants != nullptr; }
  bool unauthenticated(const Connection* c) const;  // auth on, and no AUTH has succeeded yet
  bool grow_meta(Connection* c, size_t bytes);      // false: the metadata budget stayed full
  void release_meta(Connection* c);
  int64_t budget_wait_deadline(const Connection* c) const;
  void send_stale_epoch(Connection* c, const FrameHeader& h);
  // Connection slots (server/admission.cpp), all under conns_mu_. A new
  // connection takes a pre-auth place (auth on) or a slot (auth off), closing
  // an unauthenticated or an idle one to make room; false: *refusal says why.
  bool admit_locked(Connection* c, std::string* refusal);
  // AUTH succeeded: from the pre-auth budget to a slot. False: dropped meanwhile
  // (*refusal empty) or no slot free (*refusal says why; authenticated
  // connections are never closed to make room).
  bool promote_locked(Connection* c, std::string* refusal);
  bool take_slot_locked(Connection* c, bool may_close_idle, std::string* refusal);
  Connection* idle_victim_locked(const std::string* peer);             // longest idle, nothing in flight
  Connection* preauth_victim_locked(const std::string& peer);          // oldest unauthenticated of peer, silent first
  Connection* preauth_room_victim_locked(const Connection* newcomer);  // when the whole budget is full
  bool close_for_room_locked(Connection* victim);                      // false: it became busy meanwhile
  void release_slots_locked(Connection* c);

  ServerConfig config_;
  Store* store_;
  Metrics* metrics_;
  int listen_fd_ = -1;
  int unix_listen_fd_ = -1;  // --unix-socket, or -1
  // RDMA: the arena's memory region as the server registered it (0 rkey = none).
  std::atomic<uint64_t> rdma_addr_{0};
  std::atomic<uint32_t> rdma_rkey_{0};
  std::mutex rdma_mu_;  // guards rdma_handler_ (copied out for each call)
  std::shared_ptr<const RdmaConnectHandler> rdma_handler_;
  std::atomic<uint64_t> next_rdma_id_{1};
  int wake_fds_[2] = {-1, -1};  // written once on stop; every poll() watches [0]
  uint16_t port_ = 0;
  std::thread accept_thread_;
  std::thread scrub_thread_;  // scrub_loop: checks values COMMIT published unread
  std::mutex scrub_mu_;       // guards scrub_wanted_; scrub_cv_ wakes the thread (or stop)
  std::condition_variable scrub_cv_;
  bool scrub_wanted_ = false;
  std::atomic<bool> started_{false};
  std::atomic<bool> stopping_{false};
  std::atomic<uint32_t> spinners_{0};  // connection threads in spin_for_frame now
  uint32_t spinners_max_ = 1;          // a share of the cores (set in the constructor)
  std::atomic<int64_t> stop_deadline_us_{0};
  std::mutex stop_mu_;  // serializes stop() calls

  // Read lock-free on every data request; written (with the map) under map_mu_.
  std::atomic<int64_t> epoch_{0};
  mutable std::mutex map_mu_;
  std::shared_ptr<const std::string> map_bytes_;  // msgpack of the map; never null

  // PUT frames in flight by the server epoch they were admitted at. A PUT's
  // epoch check and its count move together under admit_mu_, and so does the
  // epoch's rise in set_cluster_map (lock order: map_mu_, then admit_mu_).
  // Holds the current epoch's entry and older ones still counting: few.
  std::mutex admit_mu_;
  std::condition_variable admit_cv_;
  std::map<int64_t, uint64_t> puts_in_flight_;

  PeerCounts peers_;           // slots by address (guarded by conns_mu_ too)
  PeerCounts preauth_peers_;   // pre-auth places by address
  uint32_t slots_used_ = 0;    // guarded by conns_mu_
  uint32_t preauth_used_ = 0;  // guarded by conns_mu_
  // Addresses that lost an unauthenticated connection (dropped to make room,
  // or out of time) in the last 10 s, and that authenticated in the last 10
  // minutes; guarded by conns_mu_.
  AddressMemory preauth_losses_{10'000'000, 1 << 16};
  AddressMemory authentications_{600'000'000, 1 << 16};
  ByteBudget reservations_;  // PUT reservations whose bytes have not all arrived
  ByteBudget meta_buffers_;  // metadata buffers grown past kMetaFreeBytes

  mutable std::mutex conns_mu_;
  std::condition_variable conns_cv_;
  std::list<std::unique_ptr<Connection>> conns_;
};

}  // namespace gcache
