// Cost-aware eviction for values whose client said what they are worth (a
// PUT's "worth" field, docs/protocol.md "Value worth"): kind and recompute
// cost. Wraps the configured policy (chain, s3fifo or lru), which keeps
// ordering every value that carried no "worth", as before.
//
// A value with a worth goes to one of 31 LRU lists by its cost per byte:
// class c = round(log2(cost per KiB)) + 16, clamped to 1..31 (a state
// checkpoint that spares a long prefix per byte sits above the page of one
// block). Class c weighs 2^((c - m) / 4), within [1/4, 4], m the running mean
// class of the worth values put lately: the victim is the value of greatest
// age / weight, age counted in 4 KiB pages put since its last insert or use;
// the wrapped policy's next value counts with weight 1 (a value of typical
// worth). The bound is measured: steeper weights lose to recency on the
// hybrid traces (docs/hybrid-models.md).
// A GreedyDual-Size-style order (priority = cost/size, aged by a clock), in
// CAMP's form: rounded classes of LRU lists, O(classes) per step. With no
// value carrying a worth, every call goes straight to the wrapped policy.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "eviction/chain_queues.h"
#include "eviction/policy.h"

namespace gcache {

class WorthPolicy : public EvictionPolicy {
 public:
  static constexpr int kClasses = 31;
  static constexpr int kMiddle = 16;  // the class of 1 token per KiB

  explicit WorthPolicy(std::unique_ptr<EvictionPolicy> base) : base_(std::move(base)) {}

  PolicyKind kind() const override { return base_->kind(); }
  void insert(Entry* e, const PutHint& hint) override;
  void insert_cold(Entry* e, QueueId queue, uint8_t freq) override;
  void remove(Entry* e) override;
  void on_read(Entry* e) override;
  void on_exists(Entry* const* in_memory, const uint64_t* key_hashes, size_t n, size_t prefix) override;
  Step next(Entry** victim, OwnerId owner) override;
  bool scopes_owners() const override { return base_->scopes_owners(); }
  Entry* peek(OwnerId owner) const override;
  void coldest_first(std::vector<Entry*>* out) const override;
  size_t count() const override { return base_->count() + count_; }
  void fill_gauges(const GaugeSink& add) const override;
  void check() const override;

  // The class of a value of `cost` over `bytes` (1..kClasses).
  static uint8_t class_of(uint64_t cost, uint64_t bytes);
  const EvictionPolicy& base() const { return *base_; }

 private:
  static bool weighed(const Entry* e) { return e->worth_class != 0; }
  ChainQueues<Entry>& list_of(const Entry* e) { return classes_[e->worth_class]; }
  double score(const Entry* e) const;  // age / weight
  Entry* coldest_weighed(OwnerId owner, double* best) const;
  void counted(const Entry* e, int sign);  // count_ and bytes_by_kind_, +1 queued / -1 out

  std::unique_ptr<EvictionPolicy> base_;
  std::array<ChainQueues<Entry>, kClasses + 1> classes_;  // [0] unused
  size_t count_ = 0;                                      // values in classes_
  uint64_t bytes_by_kind_[kValueKindMax + 1] = {};        // their memory bytes, by ValueKind
  uint64_t tick_ = 1;                                     // 4 KiB pages put so far (every value)
  double mean_class_ = kMiddle;                           // running mean of the classes put
  bool has_mean_ = false;
  std::vector<Entry*> scratch_;  // on_exists: the batch without weighed values
};

}  // namespace gcache
