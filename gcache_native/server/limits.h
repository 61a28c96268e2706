// Abuse limits of the data server (docs/protocol.md, "Limits"): what one peer
// may hold at once, so a few cheap requests cannot push everyone else out.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

namespace gcache {

// A pool of bytes shared by owners (a peer address, or a tenant with auth on):
// at most `total` held overall and `owner_max` by one owner. A request larger
// than a cap is admitted alone (nothing else held under that cap), so any
// single request can make progress. Waiters are woken on every release.
class ByteBudget {
 public:
  ByteBudget(uint64_t total, uint64_t owner_max) : total_(total), owner_max_(owner_max) {}

  // Waits until `bytes` fit, or until deadline_us (steady-clock microseconds,
  // 0 = do not wait). True when acquired: release() the same bytes later.
  bool acquire(const std::string& owner, uint64_t bytes, int64_t deadline_us);
  void release(const std::string& owner, uint64_t bytes);
  void wake_all() { cv_.notify_all(); }  // stop(): waiters re-check their deadline

  uint64_t used() const;
  uint64_t total() const { return total_; }

 private:
  bool fits(const std::string& owner, uint64_t bytes) const;

  const uint64_t total_, owner_max_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t used_ = 0;
  std::unordered_map<std::string, uint64_t> by_owner_;
};

// Open connections per peer address, for --connections-per-address-max (and
// the pre-auth budget's per-address cap).
class PeerCounts {
 public:
  explicit PeerCounts(uint32_t per_peer_max) : max_(per_peer_max) {}
  bool try_add(const std::string& peer);  // false: the peer is at its cap (0 = no cap)
  void remove(const std::string& peer);
  bool at_cap(const std::string& peer) const;  // false when there is no cap
  std::string heaviest() const;                // the peer with the most connections ("" when none)

 private:
  const uint32_t max_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, uint32_t> counts_;
};

// When each address last did something (lost an unauthenticated connection;
// authenticated), for `window_us`: what the pre-auth budget knows of an
// address beyond its current connections (server/admission.cpp). At most
// `entries_max` addresses: when full, the expired ones go, and if none has
// expired, all of them (forgetting costs only the preference it gives). Not
// locked: the server guards it with conns_mu_.
class AddressMemory {
 public:
  AddressMemory(int64_t window_us, size_t entries_max) : window_us_(window_us), entries_max_(entries_max) {}
  void note(const std::string& address, int64_t now_us);
  bool recent(const std::string& address, int64_t now_us) const;  // noted within the window

 private:
  const int64_t window_us_;
  const size_t entries_max_;
  std::unordered_map<std::string, int64_t> last_us_;
};

}  // namespace gcache
