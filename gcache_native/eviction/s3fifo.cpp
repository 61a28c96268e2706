#include "eviction/s3fifo.h"

#include <algorithm>
#include <stdexcept>

namespace gcache {

namespace {
constexpr size_t kGhostMin = 1024;
}

S3Fifo::S3Fifo(uint64_t memory_bytes, double small_fraction)
    : small_target_bytes_(static_cast<uint64_t>(memory_bytes * std::clamp(small_fraction, 0.01, 0.9))) {}

void S3Fifo::push(Entry* e, QueueId queue, bool front) {
  auto& list = queue == QueueId::Small ? small_ : main_;
  (queue == QueueId::Small ? small_bytes_ : main_bytes_) += e->mem_block;
  e->queue = queue;
  e->queue_pos = front ? list.insert(list.begin(), e) : list.insert(list.end(), e);
}

void S3Fifo::insert(Entry* e, const PutHint&) {
  if (e->queue != QueueId::None) throw std::logic_error("s3fifo: entry already queued");
  push(e, ghosts_.take(e->key_hash) ? QueueId::Main : QueueId::Small, false);
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

void S3Fifo::on_exists(Entry* const* in_memory, const uint64_t*, size_t n, size_t) {
  // HiCache clients probe a chain's prefix before reading it, so a hot chain's
  // page 0 outlives its suffix pages.
  for (size_t i = 0; i < n; ++i)
    if (in_memory[i]) touch(in_memory[i]);
}

EvictionPolicy::Step S3Fifo::next(Entry** victim, OwnerId owner) {
  if (owner != kAnyOwner) return Step::Empty;
  if (small_.empty() && main_.empty()) return Step::Empty;
  bool from_small = !small_.empty() && (small_bytes_ >= small_target_bytes_ || main_.empty());
  Entry* e = from_small ? small_.front() : main_.front();
  if (e->leases > 0 || e->pins > 0) {  // never evict a value being read or written; look at it again later
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
  if (from_small) ghosts_.remember(e->key_hash, std::max(kGhostMin, count()));
  *victim = e;
  return Step::Victim;
}

Entry* S3Fifo::peek(OwnerId owner) const {
  if (owner != kAnyOwner || (small_.empty() && main_.empty())) return nullptr;
  bool from_small = !small_.empty() && (small_bytes_ >= small_target_bytes_ || main_.empty());
  return from_small ? small_.front() : main_.front();
}

void S3Fifo::coldest_first(std::vector<Entry*>* out) const {
  out->insert(out->end(), small_.begin(), small_.end());
  out->insert(out->end(), main_.begin(), main_.end());
}

void S3Fifo::fill_gauges(const GaugeSink& add) const {
  add("memory_small_queue_bytes", small_bytes_);
  add("memory_main_queue_bytes", main_bytes_);
  add("ghost_keys", ghosts_.count());
}

void S3Fifo::check() const {
  uint64_t bytes = 0;
  for (Entry* e : small_) {
    if (e->queue != QueueId::Small || !e->in_memory || e->doomed())
      throw std::logic_error("s3fifo: bad entry in small queue");
    bytes += e->mem_block;
  }
  if (bytes != small_bytes_) throw std::logic_error("s3fifo: small queue byte count drifted");
  bytes = 0;
  for (Entry* e : main_) {
    if (e->queue != QueueId::Main || !e->in_memory || e->doomed())
      throw std::logic_error("s3fifo: bad entry in main queue");
    bytes += e->mem_block;
  }
  if (bytes != main_bytes_) throw std::logic_error("s3fifo: main queue byte count drifted");
  ghosts_.check();
}

}  // namespace gcache
