#include "eviction_s3fifo.h"

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <string>

namespace gcache {

namespace {
constexpr size_t kGhostMin = 1024;
}

uint64_t key_hash_of(const std::string& key) { return std::hash<std::string>()(key); }

S3Fifo::S3Fifo(uint64_t memory_bytes, double small_fraction)
    : small_target_bytes_(static_cast<uint64_t>(memory_bytes * std::clamp(small_fraction, 0.01, 0.9))) {}

void S3Fifo::push(Entry* e, QueueId queue, bool front) {
  auto& list = queue == QueueId::Small ? small_ : main_;
  (queue == QueueId::Small ? small_bytes_ : main_bytes_) += e->mem_block;
  e->queue = queue;
  e->queue_pos = front ? list.insert(list.begin(), e) : list.insert(list.end(), e);
}

void S3Fifo::insert(Entry* e, uint64_t key_hash) {
  if (e->queue != QueueId::None) throw std::logic_error("s3fifo: entry already queued");
  push(e, take_ghost(key_hash) ? QueueId::Main : QueueId::Small, false);
}

void S3Fifo::insert_cold(Entry* e, QueueId queue, uint8_t freq) {
  if (e->queue != QueueId::None) throw std::logic_error("s3fifo: entry already queued");
  e->freq = std::min<uint8_t>(freq, 3);
  push(e, queue == QueueId::Main ? QueueId::Main : QueueId::Small, true);
}

void S3Fifo::remove(Entry* e) {
  if (e->queue == QueueId::None) return;
  if (e->queue == QueueId::Small) {
    small_.erase(e->queue_pos);
    small_bytes_ -= e->mem_block;
  } else {
    main_.erase(e->queue_pos);
    main_bytes_ -= e->mem_block;
  }
  e->queue = QueueId::None;
}

S3Fifo::Step S3Fifo::next(Entry** victim) {
  if (small_.empty() && main_.empty()) return Step::Empty;
  bool from_small = !small_.empty() && (small_bytes_ >= small_target_bytes_ || main_.empty());
  Entry* e = from_small ? small_.front() : main_.front();
  if (e->leases > 0) {  // never evict a value being read; look at it again later
    remove(e);
    push(e, from_small ? QueueId::Small : QueueId::Main, false);
    return Step::Skipped;
  }
  if (e->freq > 0) {
    --e->freq;  // the hit pays for one more round (small -> main, or main -> main)
    remove(e);
    push(e, QueueId::Main, false);
    return Step::Moved;
  }
  remove(e);
  if (from_small) remember_ghost(key_hash_of(e->key));
  *victim = e;
  return Step::Victim;
}

void S3Fifo::remember_ghost(uint64_t key_hash) {
  ghost_order_.push_back(key_hash);
  ++ghost_counts_[key_hash];
  size_t capacity = std::max(kGhostMin, count());
  while (ghost_order_.size() > capacity) {
    // Invariant: ghost_counts_[h] <= occurrences of h in ghost_order_, so an
    // aged-out hash with no live count left is one a hit already consumed.
    auto it = ghost_counts_.find(ghost_order_.front());
    if (it == ghost_counts_.end()) {
      --ghost_stale_;
    } else if (--it->second == 0) {
      ghost_counts_.erase(it);
    }
    ghost_order_.pop_front();
  }
}

bool S3Fifo::take_ghost(uint64_t key_hash) {
  // A hit consumes one ghost occurrence; its slot in the FIFO order turns
  // stale and is skipped when it ages out (no O(n) search of the deque).
  auto it = ghost_counts_.find(key_hash);
  if (it == ghost_counts_.end()) return false;
  if (--it->second == 0) ghost_counts_.erase(it);
  ++ghost_stale_;
  return true;
}

void S3Fifo::check() const {
  uint64_t bytes = 0;
  for (Entry* e : small_) {
    if (e->queue != QueueId::Small || !e->in_memory || e->doomed) throw std::logic_error("s3fifo: bad entry in small queue");
    bytes += e->mem_block;
  }
  if (bytes != small_bytes_) throw std::logic_error("s3fifo: small queue byte count drifted");
  bytes = 0;
  for (Entry* e : main_) {
    if (e->queue != QueueId::Main || !e->in_memory || e->doomed) throw std::logic_error("s3fifo: bad entry in main queue");
    bytes += e->mem_block;
  }
  if (bytes != main_bytes_) throw std::logic_error("s3fifo: main queue byte count drifted");
  size_t ghosts = 0;
  for (auto& [hash, n] : ghost_counts_) {
    if (n == 0) throw std::logic_error("s3fifo: zero ghost count kept");
    ghosts += n;
  }
  if (ghosts + ghost_stale_ != ghost_order_.size()) throw std::logic_error("s3fifo: ghost counts drifted");
}

}  // namespace gcache
