#include "common/arena_allocator.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace gcache {

uint64_t block_bytes_for(uint64_t length) {
  if (length == 0) return 0;
  for (uint64_t slot : kSmallClasses)
    if (length <= slot) return slot;
  constexpr uint64_t kSmallMax = 64 * 1024;
  if (length <= kSmallMax) return (length + kArenaPageBytes - 1) / kArenaPageBytes * kArenaPageBytes;
  // Step = 1/8 of the largest power of two <= length (>= 8 KiB here).
  uint64_t power = uint64_t(1) << (63 - __builtin_clzll(length));
  uint64_t step = power / 8;
  return (length + step - 1) / step * step;
}

BlockAllocator::BlockAllocator(uint64_t arena_bytes) : arena_bytes_(arena_bytes) {
  if (arena_bytes % kArenaPageBytes != 0) throw std::invalid_argument("arena size must be a multiple of 4 KiB");
  if (arena_bytes > 0) insert_range(0, arena_bytes);
}

void BlockAllocator::insert_range(uint64_t offset, uint64_t bytes) {
  by_offset_.emplace(offset, bytes);
  by_size_.emplace(bytes, offset);
  free_bytes_ += bytes;
}

void BlockAllocator::erase_range(std::map<uint64_t, uint64_t>::iterator it) {
  by_size_.erase({it->second, it->first});
  free_bytes_ -= it->second;
  by_offset_.erase(it);
}

int BlockAllocator::small_class_of(uint64_t block_bytes) {
  for (size_t i = 0; i < kSmallClasses.size(); ++i)
    if (kSmallClasses[i] == block_bytes) return int(i);
  return -1;
}

bool BlockAllocator::allocate(uint64_t block_bytes, uint64_t* offset) {
  if (block_bytes == 0) {
    *offset = 0;
    return true;
  }
  const int size_class = small_class_of(block_bytes);
  if (size_class >= 0) return allocate_small(size_class, offset);
  return allocate_range(block_bytes, offset);
}

void BlockAllocator::free(uint64_t offset, uint64_t block_bytes) {
  if (block_bytes == 0) return;
  const int size_class = small_class_of(block_bytes);
  if (size_class >= 0) free_small(size_class, offset);
  else free_range(offset, block_bytes);
}

bool BlockAllocator::allocate_small(int size_class, uint64_t* offset) {
  const uint64_t slot = kSmallClasses[size_class];
  const uint64_t slots = kArenaPageBytes / slot;
  const uint64_t full = slots == 64 ? ~uint64_t(0) : (uint64_t(1) << slots) - 1;
  std::set<uint64_t>& partial = partial_[size_class];
  uint64_t page;
  if (!partial.empty()) {
    page = *partial.begin();  // the lowest page: keeps small values packed together
  } else {
    if (!allocate_range(kArenaPageBytes, &page)) return false;
    slabs_[page] = Slab{uint8_t(size_class), 0};
    partial.insert(page);
  }
  Slab& slab = slabs_.at(page);
  const int index = __builtin_ctzll(~slab.used_mask);
  slab.used_mask |= uint64_t(1) << index;
  if (slab.used_mask == full) partial.erase(page);
  *offset = page + uint64_t(index) * slot;
  return true;
}

void BlockAllocator::free_small(int size_class, uint64_t offset) {
  const uint64_t slot = kSmallClasses[size_class];
  const uint64_t page = offset / kArenaPageBytes * kArenaPageBytes;
  auto it = slabs_.find(page);
  if (it == slabs_.end() || it->second.size_class != size_class || (offset - page) % slot != 0)
    throw std::logic_error("free: small block outside a slab page of its class");
  const uint64_t bit = uint64_t(1) << ((offset - page) / slot);
  if (!(it->second.used_mask & bit)) throw std::logic_error("free: small block freed twice");
  it->second.used_mask &= ~bit;
  if (it->second.used_mask == 0) {  // the last slot: the page goes back to the free ranges
    partial_[size_class].erase(page);
    slabs_.erase(it);
    free_range(page, kArenaPageBytes);
  } else {
    partial_[size_class].insert(page);
  }
}

bool BlockAllocator::allocate_range(uint64_t block_bytes, uint64_t* offset) {
  if (block_bytes % kArenaPageBytes != 0) throw std::logic_error("allocate: block not 4 KiB aligned");
  auto fit = by_size_.lower_bound({block_bytes, 0});
  if (fit == by_size_.end()) return false;
  uint64_t range_offset = fit->second, range_bytes = fit->first;
  erase_range(by_offset_.find(range_offset));
  if (range_bytes > block_bytes) insert_range(range_offset + block_bytes, range_bytes - block_bytes);
  *offset = range_offset;
  return true;
}

void BlockAllocator::free_range(uint64_t offset, uint64_t block_bytes) {
  if (offset + block_bytes > arena_bytes_) throw std::logic_error("free: block outside the arena");
  auto next = by_offset_.lower_bound(offset);
  if (next != by_offset_.end() && next->first < offset + block_bytes)
    throw std::logic_error("free: block overlaps a free range (double free)");
  if (next != by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second > offset) throw std::logic_error("free: block overlaps a free range (double free)");
    if (prev->first + prev->second == offset) {  // merge with the left neighbour
      offset = prev->first;
      block_bytes += prev->second;
      erase_range(prev);
    }
  }
  if (next != by_offset_.end() && next->first == offset + block_bytes) {  // and the right one
    block_bytes += next->second;
    erase_range(next);
  }
  insert_range(offset, block_bytes);
}

uint64_t BlockAllocator::largest_free() const { return by_size_.empty() ? 0 : by_size_.rbegin()->first; }

void BlockAllocator::check(std::vector<std::pair<uint64_t, uint64_t>> used) const {
  if (by_offset_.size() != by_size_.size()) throw std::logic_error("allocator: size and offset views differ");
  uint64_t free_sum = 0;
  for (auto& [offset, bytes] : by_offset_) {
    if (!by_size_.count({bytes, offset})) throw std::logic_error("allocator: range missing from size view");
    free_sum += bytes;
  }
  if (free_sum != free_bytes_) throw std::logic_error("allocator: free byte count drifted");
  // Small blocks must be exactly the used slots of their slab pages; each page
  // then counts as one used 4 KiB block in the tiling below.
  std::unordered_map<uint64_t, uint64_t> seen_masks;
  std::vector<std::pair<uint64_t, uint64_t>> all;
  all.reserve(used.size() + by_offset_.size());
  for (auto& block : used) {
    if (block.second == 0) continue;
    const int size_class = small_class_of(block.second);
    if (size_class < 0) {
      all.push_back(block);
      continue;
    }
    const uint64_t page = block.first / kArenaPageBytes * kArenaPageBytes;
    auto slab = slabs_.find(page);
    if (slab == slabs_.end() || slab->second.size_class != size_class || (block.first - page) % block.second)
      throw std::logic_error("allocator: small block at " + std::to_string(block.first) +
                             " not in a slab of its class");
    const uint64_t bit = uint64_t(1) << ((block.first - page) / block.second);
    uint64_t& mask = seen_masks[page];
    if (mask & bit) throw std::logic_error("allocator: two small blocks share a slot");
    mask |= bit;
  }
  if (seen_masks.size() != slabs_.size()) throw std::logic_error("allocator: a slab page holds no used slot");
  for (auto& [page, slab] : slabs_) {
    auto mask = seen_masks.find(page);
    if (mask == seen_masks.end() || mask->second != slab.used_mask)
      throw std::logic_error("allocator: slab page " + std::to_string(page) + " slots out of step");
    const uint64_t slots = kArenaPageBytes / kSmallClasses[slab.size_class];
    const uint64_t full = slots == 64 ? ~uint64_t(0) : (uint64_t(1) << slots) - 1;
    if ((slab.used_mask != full) != (partial_[slab.size_class].count(page) == 1))
      throw std::logic_error("allocator: slab page " + std::to_string(page) + " partial list out of step");
    all.emplace_back(page, kArenaPageBytes);
  }
  for (auto& pages : partial_)
    for (uint64_t page : pages)
      if (!slabs_.count(page)) throw std::logic_error("allocator: partial list names a page that is no slab");
  uint64_t used_sum = 0;
  for (auto& block : all) used_sum += block.second;
  for (auto& range : by_offset_) all.emplace_back(range.first, range.second);
  std::sort(all.begin(), all.end());
  uint64_t cursor = 0;
  bool previous_free = false;
  for (auto& [offset, bytes] : all) {
    if (offset != cursor)
      throw std::logic_error(std::string("allocator: ") + (offset < cursor ? "overlap" : "gap") + " at arena offset " +
                             std::to_string(offset));
    bool is_free = by_offset_.count(offset) && by_offset_.at(offset) == bytes;
    if (is_free && previous_free) throw std::logic_error("allocator: adjacent free ranges not coalesced");
    previous_free = is_free;
    cursor += bytes;
  }
  if (cursor != arena_bytes_) throw std::logic_error("allocator: free + used != arena size");
  if (used_sum + free_bytes_ != arena_bytes_) throw std::logic_error("allocator: used + free != arena size");
}

}  // namespace gcache
