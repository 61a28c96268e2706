// The chain policy (`--eviction-policy chain`, the default): recency, made
// aware of what a KV cache's keys are.
//  - Two lists per owner (eviction/chain_queues.h): fresh values (not used
//    since their put) and used ones. The victim is the colder head, a fresh
//    value's age weighing `fresh_weight` times: most new blocks of a KV cache
//    are never read again, while a block read once is read again twice as often.
//  - Prefix chains: a put batch is one chain in order; its values are queued
//    head-hottest and its last value (typically the partial block a session's
//    next turn replaces) first in line. An EXISTS batch is a chain too: its
//    keys present in memory count as used, deepest first, so the head ends
//    hottest. A probe and the GET that follows it count as one use.
//  - A key put again while a ghost of it is remembered (it was evicted recently,
//    `ghost_factor` x the values in memory) goes straight to used.
//  - fresh_weight 0 (the default) lets ChainTuner pick it online among
//    1, 2, 4, 8, 16, 32 and plain LRU; a fixed weight turns the tuner off.
//    While LRU is picked the policy is LRU (eviction/lru.cpp): every put goes
//    to the hot end in key order, every read and probe is a use, in key order,
//    weight 1; what the chain order placed before stays until used or evicted.
//  - Owners: each owner's values have their own lists; eviction compares the
//    heads of all owners' lists (O(owners) per step, one owner today), and
//    next(victim, owner) evicts from one owner only (tenant quotas).
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "eviction/chain_queues.h"
#include "eviction/chain_tuner.h"
#include "eviction/ghost.h"
#include "eviction/policy.h"

namespace gcache {

class ChainPolicy : public EvictionPolicy {
 public:
  ChainPolicy(uint64_t memory_bytes, const EvictionConfig& config);

  PolicyKind kind() const override { return PolicyKind::Chain; }
  void insert(Entry* e, const PutHint& hint) override;
  void insert_cold(Entry* e, QueueId queue, uint8_t freq) override;
  void remove(Entry* e) override;
  void on_read(Entry* e) override;
  void on_exists(Entry* const* in_memory, const uint64_t* key_hashes, size_t n, size_t prefix) override;
  Step next(Entry** victim, OwnerId owner) override;
  bool scopes_owners() const override { return true; }
  Entry* peek(OwnerId owner) const override;
  void coldest_first(std::vector<Entry*>* out) const override;
  size_t count() const override { return count_; }
  void fill_gauges(const GaugeSink& add) const override;
  void check() const override;

  double fresh_weight() const { return lru_mode() ? 1.0 : tuner_ ? tuner_->weight() : config_.fresh_weight; }
  bool lru_mode() const { return tuner_ && tuner_->lru(); }

 private:
  ChainQueues<Entry>& queues_of(OwnerId owner) { return queues_[owner]; }
  void use(Entry* e);

  EvictionConfig config_;
  std::unique_ptr<ChainTuner> tuner_;  // null with a fixed fresh_weight
  std::unordered_map<OwnerId, ChainQueues<Entry>> queues_;
  size_t count_ = 0;
  GhostFifo ghosts_;
  uint64_t tick_ = 1;                    // 4 KiB pages put into memory so far (+1: last_use 0 means "before anything")
  uint64_t batch_ = 0, batch_when_ = 0;  // the put batch being inserted, and its time
  Entry* batch_last_ = nullptr;          // its value inserted last
};

}  // namespace gcache
