#include "eviction/lru.h"

#include <stdexcept>

namespace gcache {

void LruPolicy::insert(Entry* e, const PutHint&) {
  if (e->queue != QueueId::None) throw std::logic_error("lru: entry already queued");
  queues_[e->owner].put_used(e, ++tick_);
  ++count_;
}

void LruPolicy::insert_cold(Entry* e, QueueId, uint8_t) {
  if (e->queue != QueueId::None) throw std::logic_error("lru: entry already queued");
  queues_[e->owner].put_cold(e, QueueId::Main);
  ++count_;
}

void LruPolicy::remove(Entry* e) {
  if (e->queue == QueueId::None) return;
  queues_[e->owner].unlink(e);
  --count_;
}

void LruPolicy::on_read(Entry* e) {
  if (e->queue != QueueId::None) queues_[e->owner].use(e, ++tick_);
}

void LruPolicy::on_exists(Entry* const* in_memory, const uint64_t*, size_t n, size_t) {
  for (size_t i = 0; i < n; ++i)
    if (in_memory[i]) on_read(in_memory[i]);
}

namespace {

// The oldest head among `owner`'s lists (every owner's for kAnyOwner), and its list in *from.
template <class Map, class Queues>
Entry* coldest_head(Map& queues_by_owner, OwnerId owner, uint64_t tick, Queues** from) {
  Entry* e = nullptr;
  double oldest = -1;
  for (auto& [id, queues] : queues_by_owner) {
    if (owner != kAnyOwner && id != owner) continue;
    double age;
    Entry* head = queues.coldest(1.0, tick, &age);
    if (head && age > oldest) {
      e = head;
      *from = &queues;
      oldest = age;
    }
  }
  return e;
}

}  // namespace

EvictionPolicy::Step LruPolicy::next(Entry** victim, OwnerId owner) {
  ChainQueues<Entry>* from = nullptr;
  Entry* e = coldest_head(queues_, owner, tick_, &from);
  if (!e) return Step::Empty;
  if (e->leases > 0 || e->pins > 0) {
    from->requeue(e);
    return Step::Skipped;
  }
  from->unlink(e);
  --count_;
  *victim = e;
  return Step::Victim;
}

Entry* LruPolicy::peek(OwnerId owner) const {
  const ChainQueues<Entry>* from = nullptr;
  return coldest_head(queues_, owner, tick_, &from);
}

void LruPolicy::coldest_first(std::vector<Entry*>* out) const {
  for (auto& [id, queues] : queues_) out->insert(out->end(), queues.used().begin(), queues.used().end());
}

void LruPolicy::fill_gauges(const GaugeSink& add) const {
  uint64_t bytes = 0;
  for (auto& [id, queues] : queues_) bytes += queues.used_bytes();
  add("memory_small_queue_bytes", 0);
  add("memory_main_queue_bytes", bytes);
  add("ghost_keys", 0);
}

void LruPolicy::check() const {
  size_t queued = 0;
  for (auto& [id, queues] : queues_) {
    queues.check("lru");
    if (!queues.fresh().empty()) throw std::logic_error("lru: a value in the fresh list");
    for (Entry* e : queues.used())
      if (e->owner != id || !e->in_memory || e->doomed()) throw std::logic_error("lru: bad entry in a queue");
    queued += queues.size();
  }
  if (queued != count_) throw std::logic_error("lru: value count drifted");
}

}  // namespace gcache
