// S3-FIFO over the memory tier (Yang et al., SOSP'23): new values enter a small
// FIFO (`small_queue_fraction` of the arena, default 10%); a value hit while
// there moves to the main FIFO, others leave memory and their key hash goes to
// a bounded ghost FIFO. A value whose key is in the ghost re-enters straight
// into main. Main reinserts values with freq > 0 (decrementing). So a scan of
// one-off keys churns the small FIFO and never reaches the hot values in main.
// `--eviction-policy s3fifo`; it ignores put-batch hints and owners.
#pragma once

#include <cstdint>
#include <list>

#include "eviction/ghost.h"
#include "eviction/policy.h"

namespace gcache {

class S3Fifo : public EvictionPolicy {
 public:
  S3Fifo(uint64_t memory_bytes, double small_fraction);

  PolicyKind kind() const override { return PolicyKind::S3Fifo; }
  void insert(Entry* e, const PutHint& hint) override;  // main on a ghost hit, else small
  void insert_cold(Entry* e, QueueId queue, uint8_t freq) override;
  void remove(Entry* e) override;
  void on_read(Entry* e) override { touch(e); }
  // Every key present in memory counts as a use, wherever it is in the batch.
  void on_exists(Entry* const* in_memory, const uint64_t* key_hashes, size_t n, size_t prefix) override;
  Step next(Entry** victim, OwnerId owner) override;
  bool scopes_owners() const override { return false; }
  void coldest_first(std::vector<Entry*>* out) const override;
  Entry* peek(OwnerId owner) const override;
  size_t count() const override { return small_.size() + main_.size(); }
  void fill_gauges(const GaugeSink& add) const override;
  void check() const override;

 private:
  void touch(Entry* e) {
    if (e->freq < 3) ++e->freq;
  }
  void push(Entry* e, QueueId queue, bool front);

  uint64_t small_target_bytes_;
  std::list<Entry*> small_, main_;
  uint64_t small_bytes_ = 0, main_bytes_ = 0;
  GhostFifo ghosts_;
};

}  // namespace gcache
