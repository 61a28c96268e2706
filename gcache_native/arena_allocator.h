// Best-fit block allocator over one arena: size classes bound internal waste
// (<= 12.5%), coalescing on free bounds external fragmentation. Metadata only:
// it never touches the arena bytes. Not thread-safe (the Store locks it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

namespace gcache {

constexpr uint64_t kArenaPageBytes = 4096;

// Rounds a value length up to its block size: 4 KiB steps up to 64 KiB, then
// 8 classes per power of two. 0 stays 0 (empty values take no block).
uint64_t block_bytes_for(uint64_t length);

class BlockAllocator {
 public:
  explicit BlockAllocator(uint64_t arena_bytes);

  // Takes `block_bytes` (a multiple of 4 KiB) from the smallest free range
  // that fits. Returns false when no free range is large enough.
  bool allocate(uint64_t block_bytes, uint64_t* offset);
  void free(uint64_t offset, uint64_t block_bytes);

  uint64_t arena_bytes() const { return arena_bytes_; }
  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t largest_free() const;
  size_t free_ranges() const { return by_offset_.size(); }
  const std::map<uint64_t, uint64_t>& free_by_offset() const { return by_offset_; }

  // Throws std::logic_error unless the free ranges plus `used` (offset, size)
  // blocks tile the arena exactly: no overlap, no gap, no double free.
  void check(std::vector<std::pair<uint64_t, uint64_t>> used) const;

 private:
  void insert_range(uint64_t offset, uint64_t bytes);
  void erase_range(std::map<uint64_t, uint64_t>::iterator it);

  uint64_t arena_bytes_;
  uint64_t free_bytes_ = 0;
  std::map<uint64_t, uint64_t> by_offset_;           // offset -> bytes
  std::set<std::pair<uint64_t, uint64_t>> by_size_;  // (bytes, offset)
};

}  // namespace gcache
