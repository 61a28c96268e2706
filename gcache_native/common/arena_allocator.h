// Best-fit block allocator over one arena: size classes bound internal waste
// (<= 12.5%), coalescing on free bounds external fragmentation. Values of at
// most 2 KiB take a slot of a small class (64 B .. 2 KiB) in a 4 KiB slab page
// of that class, so a 1-byte value costs 64 B, not 4 KiB; a page goes back to
// the free ranges when its last slot is freed. Metadata only: it never
// touches the arena bytes. Not thread-safe (the Store locks it).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

namespace gcache {

constexpr uint64_t kArenaPageBytes = 4096;
// Slot sizes of the small classes (each divides a 4 KiB page into at most 64 slots).
constexpr std::array<uint64_t, 10> kSmallClasses = {64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048};

// Rounds a value length up to its block size: a small class up to 2 KiB, 4 KiB
// steps up to 64 KiB, then 8 classes per power of two. 0 stays 0 (empty values
// take no block).
uint64_t block_bytes_for(uint64_t length);

class BlockAllocator {
 public:
  explicit BlockAllocator(uint64_t arena_bytes);

  // Takes `block_bytes` (a small class, or a multiple of 4 KiB) from a slab
  // page of its class, or the smallest free range that fits. Returns false
  // when nothing is free that fits.
  bool allocate(uint64_t block_bytes, uint64_t* offset);
  void free(uint64_t offset, uint64_t block_bytes);

  uint64_t arena_bytes() const { return arena_bytes_; }
  uint64_t free_bytes() const { return free_bytes_; }  // in free ranges (slab slots not counted)
  uint64_t slab_pages() const { return slabs_.size(); }
  uint64_t largest_free() const;
  size_t free_ranges() const { return by_offset_.size(); }
  const std::map<uint64_t, uint64_t>& free_by_offset() const { return by_offset_; }

  // Throws std::logic_error unless the free ranges plus `used` (offset, size)
  // blocks tile the arena exactly: no overlap, no gap, no double free (small
  // blocks must fill exactly the used slots of their slab pages).
  void check(std::vector<std::pair<uint64_t, uint64_t>> used) const;

 private:
  struct Slab {
    uint8_t size_class = 0;  // index into kSmallClasses
    uint64_t used_mask = 0;  // bit i: slot i is taken
  };
  static int small_class_of(uint64_t block_bytes);  // -1: not a small class
  bool allocate_range(uint64_t block_bytes, uint64_t* offset);
  void free_range(uint64_t offset, uint64_t block_bytes);
  void insert_range(uint64_t offset, uint64_t bytes);
  void erase_range(std::map<uint64_t, uint64_t>::iterator it);
  bool allocate_small(int size_class, uint64_t* offset);
  void free_small(int size_class, uint64_t offset);

  std::unordered_map<uint64_t, Slab> slabs_;                      // page offset -> slab
  std::array<std::set<uint64_t>, kSmallClasses.size()> partial_;  // pages with a free slot, per class

  uint64_t arena_bytes_;
  uint64_t free_bytes_ = 0;
  std::map<uint64_t, uint64_t> by_offset_;           // offset -> bytes
  std::set<std::pair<uint64_t, uint64_t>> by_size_;  // (bytes, offset)
};

}  // namespace gcache
