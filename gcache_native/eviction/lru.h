// Plain LRU (`--eviction-policy lru`): every insert, GET and EXISTS of a value
// in memory makes it the most recent; the least recent leaves. The baseline the
// other policies are measured against (bench/store/eviction_replay.py). Put-batch
// hints are ignored; owners get their own lists, as in the chain policy.
#pragma once

#include <cstdint>
#include <unordered_map>

#include "eviction/chain_queues.h"
#include "eviction/policy.h"

namespace gcache {

class LruPolicy : public EvictionPolicy {
 public:
  LruPolicy() { queues_[0]; }

  PolicyKind kind() const override { return PolicyKind::Lru; }
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

 private:
  // Only the `used` list of ChainQueues: one recency list per owner.
  std::unordered_map<OwnerId, ChainQueues<Entry>> queues_;
  size_t count_ = 0;
  uint64_t tick_ = 1;  // accesses so far
};

}  // namespace gcache
