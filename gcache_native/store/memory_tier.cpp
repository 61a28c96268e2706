#include "store/memory_tier.h"

#include <stdexcept>
#include <string>

namespace gcache {
namespace {

uint64_t arena_size_for(uint64_t memory_bytes) {
  if (memory_bytes < kArenaPageBytes) throw std::runtime_error("memory_bytes must be at least 4 KiB");
  return memory_bytes / kArenaPageBytes * kArenaPageBytes;
}

}  // namespace

MemoryTier::MemoryTier(uint64_t memory_bytes) : arena_(arena_size_for(memory_bytes)), allocator_(arena_.bytes()) {}

void MemoryTier::attach(Entry* e, uint64_t offset, uint64_t block) {
  GCACHE_ASSERT(!e->in_memory);
  e->in_memory = true;
  e->mem_offset = offset;
  e->mem_block = block;
  if (block > 0) by_offset_.emplace(offset, e);
  ++entries_;
  value_bytes_ += e->length;
}

void MemoryTier::detach(Entry* e) {
  GCACHE_ASSERT(e->in_memory && e->queue == QueueId::None && e->leases == 0);
  allocator_.free(e->mem_offset, e->mem_block);
  if (e->mem_block > 0) by_offset_.erase(e->mem_offset);
  e->in_memory = false;
  --entries_;
  value_bytes_ -= e->length;
}

bool MemoryTier::window_victims(uint64_t block, std::vector<Entry*>* victims) {
  struct Span {
    uint64_t offset, bytes;
    Entry* entry;
    bool pinned;
  };
  std::vector<Span> spans;  // everything that is not free, in address order
  spans.reserve(by_offset_.size() + reserved_.size());
  auto e_it = by_offset_.begin();
  auto r_it = reserved_.begin();
  while (e_it != by_offset_.end() || r_it != reserved_.end()) {
    if (r_it == reserved_.end() || (e_it != by_offset_.end() && e_it->first < r_it->first)) {
      Entry* e = e_it->second;
      spans.push_back({e->mem_offset, e->mem_block, e, e->leases > 0 || e->pins > 0 || e->doomed()});
      ++e_it;
    } else {
      spans.push_back({r_it->first, r_it->second, nullptr, true});
      ++r_it;
    }
  }
  // The first window at or after `lowest` that overlaps no pinned span.
  auto find_from = [&](uint64_t lowest, uint64_t* start) {
    uint64_t candidate = lowest;
    for (const Span& span : spans) {
      if (!span.pinned || span.offset + span.bytes <= candidate) continue;
      if (span.offset >= candidate + block) break;
      // Overlaps: try the first page after it (a slab page shared with a pinned
      // small value cannot be freed).
      candidate = (span.offset + span.bytes + kArenaPageBytes - 1) / kArenaPageBytes * kArenaPageBytes;
    }
    *start = candidate;
    return candidate + block <= arena_.bytes();
  };
  uint64_t start;
  uint64_t cursor = window_cursor_ / kArenaPageBytes * kArenaPageBytes;
  if (!find_from(cursor, &start) && !find_from(0, &start)) return false;
  window_cursor_ = (start + block) % arena_.bytes();
  for (const Span& span : spans)
    if (span.entry && span.offset < start + block && span.offset + span.bytes > start) victims->push_back(span.entry);
  return true;
}

void MemoryTier::check(std::vector<std::pair<uint64_t, uint64_t>> used, size_t blocks) const {
  auto fail = [](const std::string& what) { throw std::logic_error("store integrity: " + what); };
  for (auto& [offset, block] : reserved_) used.emplace_back(offset, block);
  size_t mapped = 0;
  for (auto& [offset, e] : by_offset_) {
    if (!e->in_memory || e->mem_offset != offset) fail("address map out of step with memory copies");
    ++mapped;
  }
  if (mapped != blocks) fail("address map misses memory copies");
  allocator_.check(std::move(used));
}

}  // namespace gcache
