// One connection's one-sided state (docs/protocol.md, "Shared memory and
// RDMA"): the values it leased with LOOKUP and the arena blocks it reserved
// with RESERVE, each group with a deadline. No socket I/O here: the server's
// handlers (server/shm.cpp) frame requests and answers around it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "store/store.h"

namespace gcache {

class ShmSession {
 public:
  // Bounds per connection: a client holds few batches at once.
  static constexpr size_t kLeaseGroupsMax = 1024;
  static constexpr size_t kLeasedKeysMax = 65536;
  static constexpr size_t kReserveGroupsMax = 64;

  struct ReserveGroup {
    std::vector<std::string> keys;          // store names (tenant prefix included)
    std::vector<Reservation> reservations;  // one per key; data == nullptr: not reserved
    std::vector<uint8_t> statuses;          // PutStatus per key from begin_put
    uint64_t budget_bytes = 0;              // bytes held in the server's reservation budget
    bool has_epoch = false;
    int64_t epoch = 0;
    int64_t deadline_us = 0;
    uint64_t chain = 0;      // the put batch (prefix chain) its values join (PutHint)
    bool chain_ends = true;  // its last value is the chain's last
    bool chain_continued = false;
    std::vector<uint64_t> worth_kinds, worth_costs;  // RESERVE "worth", per key; empty: not said
  };

  ShmSession() = default;
  ShmSession(const ShmSession&) = delete;
  ShmSession& operator=(const ShmSession&) = delete;

  bool can_lease(size_t keys) const;  // within kLeaseGroupsMax / kLeasedKeysMax
  // Takes ownership of `leases` (released by release_lease, expiry or release_all); returns its id.
  uint64_t add_leases(std::vector<Lease>&& leases, int64_t deadline_us);
  bool release_lease(Store* store, uint64_t id);  // false: unknown or already released
  // A reader found the leased values of group `id` at these arena offsets
  // (from `base`) bad: the node checks each itself (Store::verify_leased), so a
  // false report costs one hash of a value the reporter leased and changes
  // nothing. Returns how many were bad (removed).
  size_t verify_reported(Store* store, uint64_t id, std::vector<uint64_t> offsets, const uint8_t* base);

  // An empty group (or lease list) for the next RESERVE (LOOKUP): the
  // vectors of the last one committed (released) when there is one, their
  // capacity kept, so a steady stream of batches does not allocate them anew.
  // A group's `keys` keep their strings (assign() into them reuses their
  // bytes): size it with keys.resize().
  ReserveGroup spare_reserve_group();
  void recycle(ReserveGroup&& group);
  std::vector<Lease> spare_leases();

  bool can_reserve() const { return reserves_.size() < kReserveGroupsMax; }
  uint64_t add_reservation(ReserveGroup&& group);
  // Removes and returns the group (false: unknown id); the caller commits or aborts it.
  bool take_reservation(uint64_t id, ReserveGroup* out);
  // Aborts every reservation of the group; returns its budget bytes to give back.
  static uint64_t abort(Store* store, const ReserveGroup& group);

  bool holds_reservations() const { return !reserves_.empty(); }

  // Releases the lease groups past their deadline. True when a reservation is
  // past its deadline: the client may still be writing there, so the
  // connection must close (release_all then frees its blocks).
  bool expire(Store* store, int64_t now_us);
  // 0: nothing held. Every group gets the same lifetime from when it is added,
  // and ids grow with time, so the oldest group of each kind expires first.
  int64_t next_deadline_us() const;
  // Releases everything; returns the reservation budget bytes to give back.
  uint64_t release_all(Store* store);

  size_t leased_keys() const { return leased_keys_; }
  // The chain of this connection's latest RESERVE: a put batch split into
  // several RESERVEs ("cont") stays one chain for the eviction policy.
  uint64_t chain = 0;

 private:
  struct LeaseGroup {
    std::vector<Lease> leases;
    int64_t deadline_us = 0;
  };
  uint64_t next_id_ = 1;
  size_t leased_keys_ = 0;
  std::map<uint64_t, LeaseGroup> leases_;
  std::map<uint64_t, ReserveGroup> reserves_;
  // One of each kept for reuse (spare_reserve_group, spare_leases), only from a
  // batch of at most kSpareKeysMax keys (bounds what an idle connection holds).
  static constexpr size_t kSpareKeysMax = 256;
  ReserveGroup spare_group_;
  std::vector<Lease> spare_leases_;
  void recycle_leases(std::vector<Lease>&& leases);
};

}  // namespace gcache
