// The Store's memory tier: the shared-memory arena, its block allocator, the
// blocks handed out but not yet a value's memory copy (reserved: puts and
// loads in flight), and the memory copies in address order (for the window
// eviction). Keeps the memory-tier counters. Not thread-safe: the Store's
// lock guards it. Which value leaves is the eviction policy's call, not its.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "common/arena_allocator.h"
#include "common/arena_shared_memory.h"
#include "common/node_pool.h"
#include "core/entry.h"

namespace gcache {

class MemoryTier {
 public:
  // The arena: memory_bytes rounded down to whole pages (at least one, else
  // std::runtime_error).
  explicit MemoryTier(uint64_t memory_bytes);

  uint8_t* base() const { return arena_.base(); }
  uint64_t bytes() const { return arena_.bytes(); }
  int fd() const { return arena_.fd(); }

  // ---- blocks ----
  bool allocate(uint64_t block, uint64_t* offset) { return allocator_.allocate(block, offset); }
  void free(uint64_t offset, uint64_t block) { allocator_.free(offset, block); }
  uint64_t free_bytes() const { return allocator_.free_bytes(); }
  uint64_t largest_free() const { return allocator_.largest_free(); }
  // A block handed out for a put or a load, not yet a memory copy: window
  // evictions keep off it.
  void reserve(uint64_t offset, uint64_t block) {
    if (block > 0) reserved_.emplace(offset, block);
  }
  // False if no such block was reserved (an empty block is never recorded).
  bool unreserve(uint64_t offset, uint64_t block) { return block == 0 || reserved_.erase(offset) > 0; }

  // ---- memory copies ----
  void attach(Entry* e, uint64_t offset, uint64_t block);
  void detach(Entry* e);  // frees the block (the policy must have let go of e)
  uint64_t entries() const { return entries_; }
  uint64_t value_bytes() const { return value_bytes_; }

  // Leases: readers holding a memory copy (Entry::leases counts per value).
  void note_lease() { ++leases_active_; }
  void note_release() {
    GCACHE_ASSERT(leases_active_ > 0);
    --leases_active_;
  }
  uint64_t leases_active() const { return leases_active_; }

  // Fallback when FIFO order frees enough bytes but not in one piece (a large
  // value in an arena fragmented by small ones): the values of the first
  // address window of `block` bytes that holds no leased, loading or reserved
  // block, searching from a rotating cursor. False: no such window. O(values).
  bool window_victims(uint64_t block, std::vector<Entry*>* victims);

  // Throws std::logic_error unless the address map matches the memory copies
  // (`blocks` of them have a block) and the allocator's accounting matches
  // `used` (the entries' blocks) plus the reserved blocks.
  void check(std::vector<std::pair<uint64_t, uint64_t>> used, size_t blocks) const;

 private:
  SharedArena arena_;
  BlockAllocator allocator_;
  // Both maps take and give one node per put: their nodes are recycled
  // (common/node_pool.h; bound as Index's), each pool declared before
  // (outliving) its map.
  static constexpr size_t kSpareNodesMax = 1 << 18;
  using Reserved =
      std::map<uint64_t, uint64_t, std::less<uint64_t>, PoolAllocator<std::pair<const uint64_t, uint64_t>>>;
  using ByOffset = std::map<uint64_t, Entry*, std::less<uint64_t>, PoolAllocator<std::pair<const uint64_t, Entry*>>>;
  NodePool reserved_nodes_{kSpareNodesMax}, by_offset_nodes_{kSpareNodesMax};
  Reserved reserved_{Reserved::allocator_type(&reserved_nodes_)};    // offset -> block: puts and loads in flight
  ByOffset by_offset_{ByOffset::allocator_type(&by_offset_nodes_)};  // memory copies in address order
  uint64_t window_cursor_ = 0;                                       // where the next window search starts
  uint64_t entries_ = 0, value_bytes_ = 0, leases_active_ = 0;
};

}  // namespace gcache
