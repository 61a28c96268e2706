// The Store's key index and the lives of its entries: the map from key to
// Entry, the entries unlinked but still leased or pinned (doomed), the ones a
// running flush may still look at (retired), and the index's heap budget
// (--index-bytes-max). Owns every Entry. Not thread-safe: the Store's lock
// guards it.
#pragma once

#include <cstdint>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/node_pool.h"
#include "core/entry.h"

namespace gcache {

class Index {
 public:
  // Keys are views of Entry::key (stable: entries never move), so a lookup
  // allocates nothing; the hash nodes are recycled (common/node_pool.h).
  using Map = std::unordered_map<std::string_view, Entry*, std::hash<std::string_view>, std::equal_to<std::string_view>,
                                 PoolAllocator<std::pair<const std::string_view, Entry*>>>;

  // Heap one index entry takes: its key bytes, the Entry, the hash node and
  // bucket slot, the segment-list node, allocator overhead.
  static uint64_t cost(size_t key_bytes) { return sizeof(Entry) + 96 + key_bytes; }

  Index() = default;
  Index(const Index&) = delete;
  Index& operator=(const Index&) = delete;
  ~Index();  // frees every entry: indexed, doomed and retired

  Entry* find(std::string_view key) const {
    auto it = map_.find(key);
    return it == map_.end() ? nullptr : it->second;
  }
  // e's key must not be indexed yet.
  void insert(Entry* e) {
    GCACHE_ASSERT(!e->doomed() && find(e->key) == nullptr);
    const bool inserted = try_insert(e);
    GCACHE_ASSERT(inserted);
    (void)inserted;
  }
  // Indexes e unless its key is indexed already (false: nothing changed, e is
  // still the caller's). One hash lookup, where find + insert take two.
  bool try_insert(Entry* e) {
    GCACHE_ASSERT(!e->doomed());
    if (!map_.emplace(std::string_view(e->key), e).second) return false;
    bytes_ += cost(e->key.size());
    ++inserts_;
    return true;
  }
  // Grows with every key indexed: a key that find() missed is still missing
  // as long as this has not changed (the caller held the lock meanwhile or
  // checks this instead of a second find).
  uint64_t inserts() const { return inserts_; }
  void erase(Entry* e) {
    map_.erase(std::string_view(e->key));
    bytes_ -= cost(e->key.size());
  }
  const Map& map() const { return map_; }
  size_t size() const { return map_.size(); }

  // ---- unlinked entries ----
  // Keeps a doomed entry that is still leased or pinned until forget_doomed.
  void keep_doomed(Entry* e) { doomed_.insert(e); }
  // False if e is not kept (already freed: retired during a flush).
  bool forget_doomed(Entry* e) { return doomed_.erase(e) > 0; }
  const std::unordered_set<Entry*>& doomed() const { return doomed_; }
  // A new Entry (nothing set but its defaults) for a key about to be indexed:
  // a freed one when one is spare, so a store that removes and puts keys at
  // the same pace does not go through malloc for every Entry and key.
  Entry* make_entry();
  // Gives back an entry make_entry() handed out that was never indexed.
  void discard(Entry* e) { recycle(e); }
  // Frees an entry nothing references, or retires it while a flush runs (a
  // flush holds Entry pointers without the lock).
  void free(Entry* e) {
    if (flushes_running_ > 0) retired_.push_back(e);
    else recycle(e);
  }
  void begin_flush() { ++flushes_running_; }
  void end_flush();  // the last flush to end frees the retired entries
  const std::vector<Entry*>& retired() const { return retired_; }

  // ---- the heap budget ----
  uint64_t bytes() const { return bytes_; }
  // Would one more key of key_bytes take the index past `bytes_max`?
  // Reserved keys count: a batch reserved before any commit (RESERVE) stays
  // within the bound.
  bool over(size_t key_bytes, uint64_t bytes_max) const { return bytes_ + reserved_ + cost(key_bytes) > bytes_max; }
  void reserve(uint64_t cost) { reserved_ += cost; }  // a key reserved by begin_put, until commit or abort
  void unreserve(uint64_t cost) { reserved_ -= cost; }

 private:
  static constexpr size_t kSpareNodesMax = 1 << 18;  // hash nodes kept for reuse (see kSpareEntriesMax)
  NodePool nodes_{kSpareNodesMax};                   // before map_: it outlives the map
  Map map_{Map::allocator_type(&nodes_)};
  std::unordered_set<Entry*> doomed_;  // unlinked, still leased/pinned
  std::vector<Entry*> retired_;        // died during a flush, freed when the last flush ends
  uint32_t flushes_running_ = 0;
  uint64_t bytes_ = 0;     // estimated heap of the index (cost() per key)
  uint64_t reserved_ = 0;  // cost() of keys reserved but not yet committed
  uint64_t inserts_ = 0;   // keys indexed so far (inserts())
  // Freed entries kept for make_entry (their key strings keep their bytes):
  // at most kSpareEntriesMax, the rest deleted. Never more than the index
  // held at once. A small bound is worse than none: the entries kept pin
  // holes in malloc's heap between the ones given back, and a large REMOVE
  // then leaves every other allocation a fragmented heap.
  static constexpr size_t kSpareEntriesMax = 1 << 18;
  std::vector<Entry*> spare_;
  void recycle(Entry* e);
};

}  // namespace gcache
