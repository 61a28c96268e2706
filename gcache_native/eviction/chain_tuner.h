// Picks the chain policy's fresh weight online, by miniature simulation
// (Waldspurger et al., "Cache Modeling and Optimization using Miniature
// Simulations", ATC'17): a fixed sample of the key space (by key hash, about
// 16 MiB worth of the memory tier, at least 1/64 of it) is replayed into a few
// metadata-only shadow caches, scaled down by the same rate, each running the
// chain policy with one candidate weight (1, 2, 4 ... 32), plus one running
// plain LRU (every put to the hot end, every read and probe a use, in key
// order: exactly eviction/lru.cpp), so the live policy can become LRU. Shadows
// score one point per hit (an EXISTS prefix or a GET). Four times an epoch (a
// shadow's capacity of sampled inserts) the live candidate becomes the best scorer if it
// beats the weight in use by 2% (near-ties are sampling noise; LRU, the
// baseline, needs only to beat the candidate in use, and keeps its place
// unless beaten by 2%), and scores decay. It starts as LRU. So the node keeps what
// works for the workload it serves, and is plain LRU where recency wins. Cost: O(candidates) per sampled
// key, nothing for the others.
#pragma once

#include <cstdint>
#include <list>
#include <unordered_map>
#include <vector>

#include "eviction/chain_queues.h"
#include "eviction/ghost.h"
#include "eviction/policy.h"

namespace gcache {

class ChainTuner {
 public:
  static constexpr uint64_t kShadowBytesTarget = 16ull << 20;
  static constexpr double kRateMin = 1.0 / 64;
  // A decision every quarter of a shadow's capacity of sampled inserts (an epoch);
  // scores decay by 0.9 per epoch, 0.9^(1/4) per decision.
  static constexpr int kDecisionsPerEpoch = 4;
  static constexpr double kScoreDecay = 0.9;
  static constexpr double kSwitchMargin = 0.02;           // a candidate must beat the weight in use by 2%
  static constexpr size_t kGhostsMin = 1024;              // the chain policy's ghost floor
  static constexpr uint64_t kShadowValueBytesMin = 1024;  // a shadow value's least cost (bounds the heap)

  ChainTuner(uint64_t memory_bytes, double ghost_factor, bool tail_hint, std::vector<double> weights,
             double initial_weight);

  double weight() const { return weight_; }
  bool lru() const { return lru_; }  // the LRU candidate won: the live policy runs as plain LRU
  uint64_t epochs() const { return epochs_; }
  size_t shadow_values() const;
  bool sampled(uint64_t key_hash) const;

  // The live policy's events, for the sampled keys among them.
  void on_put(uint64_t key_hash, uint64_t bytes, const PutHint& hint);
  void on_read(uint64_t key_hash);
  void on_exists(const uint64_t* key_hashes, size_t n);

  void check() const;  // throws std::logic_error

 private:
  struct Node {
    uint64_t key_hash = 0;
    uint64_t mem_block = 0;
    uint64_t last_use = 0;
    QueueId queue = QueueId::None;
    std::list<Node*>::iterator queue_pos;
  };
  struct Shadow {
    bool lru = false;  // the plain LRU candidate (weight 1, LRU's insert and use rules)
    double weight = 1;
    double score = 0;
    uint64_t bytes = 0, tick = 1;
    ChainQueues<Node> queues;
    std::unordered_map<uint64_t, Node> nodes;  // node-based: Node addresses are stable
    GhostFifo ghosts;
    uint64_t batch = 0, batch_when = 0;
    Node* batch_last = nullptr;
  };

  void insert(Shadow& s, uint64_t key_hash, uint64_t bytes, const PutHint& hint);
  void evict_one(Shadow& s);
  void end_epoch();

  uint32_t threshold_;  // a key is sampled when its 24-bit sampling hash is below this
  uint64_t capacity_bytes_;
  size_t ghosts_min_;
  double ghost_factor_;
  bool tail_hint_;
  std::vector<Shadow> shadows_;
  double weight_;
  bool lru_ = true;  // starts as LRU, the baseline: left only for a candidate 2% better
  uint64_t epoch_pages_ = 0, epochs_ = 0;
};

}  // namespace gcache
