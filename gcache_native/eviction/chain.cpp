#include "eviction/chain.h"

#include <algorithm>
#include <stdexcept>

namespace gcache {

namespace {
constexpr size_t kGhostMin = ChainTuner::kGhostsMin;
constexpr double kInitialWeight = 2.0;

uint64_t pages_of(uint64_t bytes) { return std::max<uint64_t>(1, bytes / 4096); }
}  // namespace

ChainPolicy::ChainPolicy(uint64_t memory_bytes, const EvictionConfig& config) : config_(config) {
  if (config.fresh_weight == 0)
    tuner_ = std::make_unique<ChainTuner>(memory_bytes, config.ghost_factor, config.chain_tail_hint,
                                          std::vector<double>{1, 2, 4, 8, 16, 32}, kInitialWeight);
  queues_[0];  // the default owner always has its lists
}

void ChainPolicy::insert(Entry* e, const PutHint& hint) {
  if (e->queue != QueueId::None) throw std::logic_error("chain: entry already queued");
  bool same_batch = hint.batch != 0 && hint.batch == batch_;
  if (!same_batch) {
    batch_ = hint.batch;
    batch_when_ = tick_;
    batch_last_ = nullptr;
  }
  ChainQueues<Entry>& queues = queues_of(e->owner);
  if (lru_mode()) {
    ghosts_.take(e->key_hash);
    queues.put_used(e, tick_);  // LRU: to the hot end, in key order
  } else if (ghosts_.take(e->key_hash)) {
    queues.put_used(e, batch_when_);  // evicted recently and wanted again
  } else {
    Entry* prev = batch_last_ && batch_last_->owner == e->owner ? batch_last_ : nullptr;
    queues.put_fresh(e, batch_when_, prev, config_.chain_tail_hint && hint.chain_tail);
  }
  batch_last_ = e;
  ++count_;
  tick_ += pages_of(e->mem_block);
  if (tuner_) tuner_->on_put(e->key_hash, e->mem_block, hint);
}

void ChainPolicy::insert_cold(Entry* e, QueueId queue, uint8_t) {
  if (e->queue != QueueId::None) throw std::logic_error("chain: entry already queued");
  queues_of(e->owner).put_cold(e, queue);
  ++count_;
}

void ChainPolicy::remove(Entry* e) {
  if (batch_last_ == e) batch_last_ = nullptr;
  if (e->queue == QueueId::None) return;
  queues_of(e->owner).unlink(e);
  --count_;
}

void ChainPolicy::use(Entry* e) {
  if (e->queue == QueueId::None || e->last_use == tick_) return;  // probed just now: one use
  queues_of(e->owner).use(e, tick_);
}

void ChainPolicy::on_read(Entry* e) {
  if (tuner_) tuner_->on_read(e->key_hash);
  if (lru_mode()) {
    if (e->queue != QueueId::None) queues_of(e->owner).use(e, tick_);  // LRU: every read is a use
    return;
  }
  use(e);
}

void ChainPolicy::on_exists(Entry* const* in_memory, const uint64_t* key_hashes, size_t n, size_t) {
  if (tuner_) tuner_->on_exists(key_hashes, n);
  if (lru_mode()) {  // as LruPolicy: every present key, in key order
    for (size_t i = 0; i < n; ++i)
      if (in_memory[i] && in_memory[i]->queue != QueueId::None) queues_of(in_memory[i]->owner).use(in_memory[i], tick_);
    return;
  }
  // Deepest first: the chain's head ends hottest. Keys after a gap count too: the
  // client puts the missing ones next, and the chain is whole again.
  for (size_t i = n; i-- > 0;)
    if (in_memory[i]) use(in_memory[i]);
}

EvictionPolicy::Step ChainPolicy::next(Entry** victim, OwnerId owner) {
  const double weight = fresh_weight();
  ChainQueues<Entry>* from = nullptr;
  Entry* e = nullptr;
  double oldest = -1;
  auto consider = [&](ChainQueues<Entry>& queues) {
    double age;
    Entry* head = queues.coldest(weight, tick_, &age);
    if (head && age > oldest) {
      e = head;
      from = &queues;
      oldest = age;
    }
  };
  if (owner == kAnyOwner) {
    for (auto& [id, queues] : queues_) consider(queues);
  } else if (auto it = queues_.find(owner); it != queues_.end()) {
    consider(it->second);
  }
  if (!e) return Step::Empty;
  if (e->leases > 0 || e->pins > 0) {  // being read or written: look at it again later
    from->requeue(e);
    return Step::Skipped;
  }
  from->unlink(e);
  --count_;
  if (batch_last_ == e) batch_last_ = nullptr;
  ghosts_.remember(e->key_hash, std::max(kGhostMin, size_t(config_.ghost_factor * double(count_))));
  *victim = e;
  return Step::Victim;
}

Entry* ChainPolicy::peek(OwnerId owner) const {
  const double weight = fresh_weight();
  Entry* e = nullptr;
  double oldest = -1;
  for (auto& [id, queues] : queues_) {
    if (owner != kAnyOwner && id != owner) continue;
    double age;
    Entry* head = queues.coldest(weight, tick_, &age);
    if (head && age > oldest) {
      e = head;
      oldest = age;
    }
  }
  return e;
}

void ChainPolicy::coldest_first(std::vector<Entry*>* out) const {
  for (auto& [id, queues] : queues_) {
    out->insert(out->end(), queues.fresh().begin(), queues.fresh().end());
    out->insert(out->end(), queues.used().begin(), queues.used().end());
  }
}

void ChainPolicy::fill_gauges(const GaugeSink& add) const {
  uint64_t fresh = 0, used = 0;
  for (auto& [id, queues] : queues_) {
    fresh += queues.fresh_bytes();
    used += queues.used_bytes();
  }
  add("memory_small_queue_bytes", fresh);
  add("memory_main_queue_bytes", used);
  add("ghost_keys", ghosts_.count());
  add("eviction_fresh_weight_pct", uint64_t(fresh_weight() * 100 + 0.5));
  add("eviction_tuner_epochs", tuner_ ? tuner_->epochs() : 0);
  add("eviction_tuner_lru", lru_mode() ? 1 : 0);
  add("eviction_tuner_shadow_keys", tuner_ ? tuner_->shadow_values() : 0);
}

void ChainPolicy::check() const {
  size_t queued = 0;
  for (auto& [id, queues] : queues_) {
    queues.check("chain");
    for (const auto* list : {&queues.fresh(), &queues.used()})
      for (Entry* e : *list)
        if (e->owner != id || !e->in_memory || e->doomed()) throw std::logic_error("chain: bad entry in a queue");
    queued += queues.size();
  }
  if (queued != count_) throw std::logic_error("chain: value count drifted");
  if (batch_last_ && batch_last_->queue == QueueId::None) throw std::logic_error("chain: batch cursor not queued");
  ghosts_.check();
  if (tuner_) tuner_->check();
}

}  // namespace gcache
