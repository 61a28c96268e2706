// S3-FIFO over the memory tier (Yang et al., SOSP'23): new values enter a small
// FIFO (~10% of the arena); a value hit while there moves to the main FIFO,
// others leave memory and their key hash goes to a bounded ghost FIFO. A value
// whose key is in the ghost re-enters straight into main. Main reinserts values
// with freq > 0 (decrementing). So a scan of one-off keys churns the small FIFO
// and never reaches the hot values in main.
#pragma once

#include <cstdint>
#include <deque>
#include <list>
#include <unordered_map>

#include "store_entry.h"

namespace gcache {

class S3Fifo {
 public:
  S3Fifo(uint64_t memory_bytes, double small_fraction);

  void insert(Entry* e, uint64_t key_hash);           // main on a ghost hit, else small
  void insert_cold(Entry* e, QueueId queue, uint8_t freq);  // at the eviction end (warm reload)
  void remove(Entry* e);
  void touch(Entry* e) { if (e->freq < 3) ++e->freq; }

  enum class Step { Victim, Moved, Skipped, Empty };
  // One step of the eviction clock. Victim: *victim left its queue and must
  // leave memory. Moved: a value was promoted or reinserted. Skipped: the head
  // was leased and went to the back of its queue.
  Step next(Entry** victim);

  uint64_t small_bytes() const { return small_bytes_; }
  uint64_t main_bytes() const { return main_bytes_; }
  size_t count() const { return small_.size() + main_.size(); }
  size_t ghost_count() const { return ghost_order_.size() - ghost_stale_; }  // live ghosts
  const std::list<Entry*>& small() const { return small_; }
  const std::list<Entry*>& main() const { return main_; }

  void check() const;  // throws std::logic_error

 private:
  void push(Entry* e, QueueId queue, bool front);
  void remember_ghost(uint64_t key_hash);
  bool take_ghost(uint64_t key_hash);

  uint64_t small_target_bytes_;
  std::list<Entry*> small_, main_;
  uint64_t small_bytes_ = 0, main_bytes_ = 0;
  std::deque<uint64_t> ghost_order_;
  std::unordered_map<uint64_t, uint32_t> ghost_counts_;  // live occurrences per hash
  size_t ghost_stale_ = 0;  // entries of ghost_order_ already consumed by a hit
};

uint64_t key_hash_of(const std::string& key);

}  // namespace gcache
