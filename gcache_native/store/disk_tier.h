// The Store's disk tier: the segment files (DiskSegments, reached through
// ->), and which entries hold a live record in which segment. Keeps the
// disk-tier counters. Not thread-safe: the Store's locks guard it (appends
// and reclaims under disk_mu too). What to reclaim and copy forward is the
// Store's call.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <unordered_map>

#include "core/entry.h"
#include "disk/segments.h"

namespace gcache {

class DiskTier {
 public:
  // segments: null when there is no disk tier.
  explicit DiskTier(std::unique_ptr<DiskSegments> segments) : segments_(std::move(segments)) {}

  explicit operator bool() const { return segments_ != nullptr; }
  DiskSegments* operator->() const { return segments_.get(); }

  // ---- disk copies ----
  void attach(Entry* e, const RecordLocation& location) {
    GCACHE_ASSERT(!e->on_disk && !e->doomed());
    e->on_disk = true;
    e->disk = location;
    auto& list = live_[location.segment];
    e->disk_pos = list.insert(list.end(), e);
    ++entries_;
  }
  void detach(Entry* e) {
    GCACHE_ASSERT(e->on_disk);
    auto it = live_.find(e->disk.segment);
    it->second.erase(e->disk_pos);
    if (it->second.empty()) live_.erase(it);
    e->on_disk = false;
    --entries_;
  }
  // A reclaim takes a segment's live list whole; each entry of it is then
  // forgotten (detached without the list erase).
  std::list<Entry*> take_segment(uint32_t id) {
    std::list<Entry*> live;
    auto it = live_.find(id);
    if (it != live_.end()) live.swap(it->second);
    live_.erase(id);
    return live;
  }
  void forget_taken(Entry* e) {
    e->on_disk = false;
    --entries_;
  }

  uint64_t entries() const { return entries_; }
  const std::unordered_map<uint32_t, std::list<Entry*>>& live() const { return live_; }

 private:
  std::unique_ptr<DiskSegments> segments_;
  std::unordered_map<uint32_t, std::list<Entry*>> live_;  // live value records per segment
  uint64_t entries_ = 0;
};

}  // namespace gcache
