#include "eviction/ghost.h"

#include <stdexcept>

namespace gcache {

void GhostFifo::remember(uint64_t key_hash, size_t capacity) {
  order_.push_back(key_hash);
  ++counts_[key_hash];
  while (order_.size() > capacity) {
    // Invariant: counts_[h] <= occurrences of h in order_, so an aged-out hash
    // with no live count left is one take() already used up.
    auto it = counts_.find(order_.front());
    if (it == counts_.end()) {
      --stale_;
    } else if (--it->second == 0) {
      counts_.erase(it);
    }
    order_.pop_front();
  }
}

bool GhostFifo::take(uint64_t key_hash) {
  // Its slot in the FIFO order turns stale and is skipped when it ages out
  // (no O(n) search of the deque).
  auto it = counts_.find(key_hash);
  if (it == counts_.end()) return false;
  if (--it->second == 0) counts_.erase(it);
  ++stale_;
  return true;
}

void GhostFifo::check() const {
  size_t live = 0;
  for (auto& [hash, n] : counts_) {
    if (n == 0) throw std::logic_error("ghosts: zero count kept");
    live += n;
  }
  if (live + stale_ != order_.size()) throw std::logic_error("ghosts: counts drifted");
}

}  // namespace gcache
