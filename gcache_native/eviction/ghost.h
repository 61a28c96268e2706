// A bounded FIFO of key hashes that recently left memory ("ghosts"): a key put
// again while its ghost is remembered was evicted too soon. O(1) per call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <unordered_map>

namespace gcache {

class GhostFifo {
 public:
  // Adds a ghost, then ages the oldest out until at most `capacity` remain.
  void remember(uint64_t key_hash, size_t capacity);
  // True (and the ghost is used up) if `key_hash` is remembered.
  bool take(uint64_t key_hash);
  size_t count() const { return order_.size() - stale_; }  // live ghosts
  void check() const;                                      // throws std::logic_error

 private:
  std::deque<uint64_t> order_;
  std::unordered_map<uint64_t, uint32_t> counts_;  // live occurrences per hash
  size_t stale_ = 0;                               // entries of order_ already used up by take()
};

}  // namespace gcache
