// The Store: one lock (mu) over the index, the arena allocator, the S3-FIFO
// queues and the disk bookkeeping. Payload copies into and out of the arena
// happen outside it (the caller's, or ours for loads from disk), and so do
// demotion writes: a second lock (disk_mu, always taken before mu) serializes
// disk appends and reclaims, so only the last record can ever be torn.
#include "store.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "arena_allocator.h"
#include "arena_shared_memory.h"
#include "checksum.h"
#include "disk_segments.h"
#include "eviction_s3fifo.h"
#include "store_entry.h"
#include "store_warm_list.h"

namespace gcache {

namespace {
void bump(std::atomic<uint64_t>& counter, uint64_t n = 1) { counter.fetch_add(n, std::memory_order_relaxed); }

// Heap one index entry takes beyond its key bytes: the Entry, the hash node
// and bucket slot, the segment-list node, allocator overhead.
constexpr uint64_t kIndexEntryOverheadBytes = sizeof(Entry) + 96;
uint64_t index_cost(size_t key_bytes) { return kIndexEntryOverheadBytes + key_bytes; }

uint64_t arena_size_for(uint64_t memory_bytes) {
  if (memory_bytes < kArenaPageBytes) throw std::runtime_error("memory_bytes must be at least 4 KiB");
  return memory_bytes / kArenaPageBytes * kArenaPageBytes;
}
}  // namespace

struct Store::Impl {
  StoreConfig cfg;
  Metrics* metrics;
  SharedArena arena;
  BlockAllocator allocator;
  S3Fifo fifo;
  std::unique_ptr<DiskSegments> disk;  // null: no disk tier

  std::mutex disk_mu;  // order: disk_mu, then mu
  std::mutex mu;
  // Keys are views of Entry::key (stable: entries never move), so a lookup
  // allocates nothing.
  std::unordered_map<std::string_view, Entry*> index;
  std::unordered_set<Entry*> doomed;                                // unlinked, still leased/pinned
  std::unordered_map<uint32_t, std::list<Entry*>> segment_entries;  // live value records per segment
  std::map<uint64_t, uint64_t> reserved;                            // offset -> block: puts and loads in flight
  std::map<uint64_t, Entry*> mem_by_offset;                         // memory copies in address order
  uint64_t window_cursor = 0;                                       // where the next window search starts
  uint64_t mem_entries = 0, mem_value_bytes = 0, disk_entries = 0, leases_active = 0;
  uint64_t index_bytes = 0;  // estimated heap of the index (index_cost per key)

  Impl(const StoreConfig& c, Metrics* m)
      : cfg(c), metrics(m), arena(arena_size_for(c.memory_bytes)), allocator(arena.bytes()),
        fifo(arena.bytes(), c.small_queue_fraction) {
    if (!cfg.data_dir.empty() && cfg.disk_bytes > 0)
      disk = std::make_unique<DiskSegments>(cfg.data_dir, cfg.disk_bytes, cfg.segment_bytes, metrics);
  }

  ~Impl() {
    for (auto& kv : index) delete kv.second;
    for (Entry* e : doomed) delete e;
  }

  struct Locks {
    std::unique_lock<std::mutex> store;
    std::unique_lock<std::mutex> disk;
    explicit Locks(Impl& s) : store(s.mu), disk(s.disk_mu, std::defer_lock) {}
  };
  // Adds disk_mu to a held mu, dropping mu while waiting (lock order), so the
  // caller must re-check what it looked at. True if it was taken here.
  bool hold_disk(Locks& l) {
    if (l.disk.owns_lock()) return false;
    if (!l.disk.try_lock()) {
      l.store.unlock();
      l.disk.lock();
      l.store.lock();
    }
    return true;
  }

  Entry* find(std::string_view key) {
    auto it = index.find(key);
    return it == index.end() ? nullptr : it->second;
  }

  // ---- tier membership; every counter change goes through these four ----
  void attach_memory(Entry* e, uint64_t offset, uint64_t block) {
    e->in_memory = true;
    e->mem_offset = offset;
    e->mem_block = block;
    if (block > 0) mem_by_offset.emplace(offset, e);
    ++mem_entries;
    mem_value_bytes += e->length;
  }
  void detach_memory(Entry* e) {
    fifo.remove(e);
    allocator.free(e->mem_offset, e->mem_block);
    if (e->mem_block > 0) mem_by_offset.erase(e->mem_offset);
    e->in_memory = false;
    --mem_entries;
    mem_value_bytes -= e->length;
  }
  void attach_disk(Entry* e, const RecordLocation& location) {
    e->on_disk = true;
    e->disk = location;
    auto& list = segment_entries[location.segment];
    e->disk_pos = list.insert(list.end(), e);
    ++disk_entries;
  }
  void detach_disk(Entry* e) {
    auto it = segment_entries.find(e->disk.segment);
    it->second.erase(e->disk_pos);
    if (it->second.empty()) segment_entries.erase(it);
    e->on_disk = false;
    --disk_entries;
  }

  // Removes the key from the index; the Entry dies now or at its last release.
  void unlink(Entry* e) {
    index.erase(std::string_view(e->key));
    index_bytes -= index_cost(e->key.size());
    fifo.remove(e);
    if (e->on_disk) detach_disk(e);
    if (e->leases > 0 || e->pins > 0) {
      e->doomed = true;
      doomed.insert(e);
      return;
    }
    if (e->in_memory) detach_memory(e);
    delete e;
  }
  void destroy_if_unused(Entry* e) {
    if (!e->doomed || e->leases > 0 || e->pins > 0) return;
    doomed.erase(e);
    if (e->in_memory) detach_memory(e);
    delete e;
  }

  // ---- disk tier ----
  // Reclaims oldest segments until `bytes` more fit within disk_bytes.
  bool make_room(uint64_t bytes) {
    if (bytes > disk->disk_bytes()) return false;
    uint32_t id;
    while (disk->used_bytes() + bytes > disk->disk_bytes()) {
      if (!disk->oldest(&id)) return false;
      reclaim(id, bytes);
    }
    return true;
  }

  // Drops one segment. Live records read since they were written get copied
  // forward once, within a bounded budget; other disk-only values leave the
  // store; values also in memory just lose their disk copy.
  void reclaim(uint32_t id, uint64_t bytes_needed) {
    std::list<Entry*> live;
    auto it = segment_entries.find(id);
    if (it != segment_entries.end()) live.swap(it->second);
    segment_entries.erase(id);
    SegmentFileRef file = disk->drop(id);  // stays readable for the copies below
    uint64_t free_after = disk->disk_bytes() - std::min(disk->disk_bytes(), disk->used_bytes() + bytes_needed);
    uint64_t budget = std::min<uint64_t>(free_after, cfg.segment_bytes / 4);
    std::vector<uint8_t> bounce;
    for (Entry* e : live) {
      e->on_disk = false;
      --disk_entries;
      uint64_t bytes = record_bytes(e->key.size(), e->length);
      if (e->read_since_written && !e->copied_forward && bytes <= budget &&
          copy_forward(e, *file, &bounce)) {
        bump(metrics->disk_copy_forwards);
        budget -= bytes;
        continue;
      }
      if (!e->in_memory) {
        bump(metrics->evictions_disk);
        unlink(e);
      }
    }
  }

  bool copy_forward(Entry* e, const SegmentFile& file, std::vector<uint8_t>* bounce) {
    const uint8_t* value = arena.base() + e->mem_offset;
    if (!e->in_memory) {
      bounce->resize(e->length);
      if (!read_segment(file, e->disk.offset + sizeof(RecordHeader) + e->key.size(), e->length, bounce->data()))
        return false;
      if (xxh64(bounce->data(), e->length) != e->checksum) {
        bump(metrics->checksum_failures);
        return false;
      }
      value = bounce->data();
    }
    RecordLocation location;
    if (!disk->append(kRecordValue, e->key, value, e->length, e->checksum, &location)) return false;
    attach_disk(e, location);
    e->copied_forward = true;
    e->read_since_written = false;
    return true;
  }

  bool write_value(Entry* e) {
    if (!disk || !make_room(record_bytes(e->key.size(), e->length))) return false;
    RecordLocation location;
    if (!disk->append(kRecordValue, e->key, arena.base() + e->mem_offset, e->length, e->checksum, &location))
      return false;
    attach_disk(e, location);
    e->copied_forward = false;
    e->read_since_written = false;
    return true;
  }

  void write_tombstone(const std::string& key) {
    RecordLocation location;
    if (disk && make_room(record_bytes(key.size(), 0))) disk->append(kRecordTombstone, key, nullptr, 0, 0, &location);
  }

  // ---- memory tier ----
  // Evicting from memory demotes: a dirty value is written to disk first
  // (without mu, the value pinned); a value that cannot be written leaves the
  // store. A value leased while it was being written stays, now clean.
  void evict_from_memory(Entry* e, Locks& l) {
    fifo.remove(e);
    if (e->on_disk || !disk) {
      bump(metrics->evictions_memory);
      if (e->on_disk) detach_memory(e); else unlink(e);
      return;
    }
    ++e->pins;
    e->demoting = true;
    bool took_disk = hold_disk(l);
    uint64_t bytes = record_bytes(e->key.size(), e->length);
    RecordLocation location;
    SegmentFileRef file;
    bool written = !e->doomed && make_room(bytes) && disk->reserve(e->key, e->length, &location, &file);
    if (written) {
      l.store.unlock();  // key, length, checksum and the block are stable while pinned
      written = DiskSegments::write_record(*file, location, kRecordValue, e->key, arena.base() + e->mem_offset,
                                           e->length, e->checksum);
      l.store.lock();
      if (!written) disk->cancel(location, bytes);
    }
    e->demoting = false;
    --e->pins;
    if (written && e->doomed) {
      write_tombstone(e->key);  // removed meanwhile: keep the record from coming back
    } else if (written) {
      attach_disk(e, location);
      e->copied_forward = false;
      e->read_since_written = false;
      bump(metrics->demotions_to_disk);
    }
    if (e->doomed) {
      destroy_if_unused(e);
    } else if (e->leases > 0) {
      fifo.insert_cold(e, QueueId::Main, e->freq);  // read meanwhile: stays, looked at again soon
    } else {
      bump(metrics->evictions_memory);
      if (written) detach_memory(e); else unlink(e);
    }
    if (took_disk) l.disk.unlock();
  }

  // Takes a block, evicting when `l` is given (which may drop mu meanwhile).
  bool allocate(uint64_t block, uint64_t* offset, Locks* l) {
    if (block > arena.bytes()) return false;
    for (uint32_t attempt = 0;; ++attempt) {
      if (allocator.allocate(block, offset)) return true;
      if (!l) return false;
      // Enough bytes are free, just not in one piece: stop evicting in FIFO
      // order (it would take many more victims) and clear one window instead.
      bool fragmented = attempt >= 64 && allocator.free_bytes() >= 2 * block;
      if (fragmented || attempt >= cfg.eviction_attempts_max)
        // A small value needs a whole free page (a slot of another class would not do).
        return evict_window(std::max(block, kArenaPageBytes), *l) && allocator.allocate(block, offset);
      Entry* victim = nullptr;
      switch (fifo.next(&victim)) {
        case S3Fifo::Step::Empty: return false;
        case S3Fifo::Step::Skipped: bump(metrics->lease_skips); break;
        case S3Fifo::Step::Moved: break;
        case S3Fifo::Step::Victim: evict_from_memory(victim, *l); break;
      }
    }
  }

  // Fallback when FIFO order frees enough bytes but not in one piece (a large
  // value in an arena fragmented by small ones): evicts every value in the
  // first address window of `block` bytes that holds no leased, loading or
  // reserved block, searching from a rotating cursor. O(values) per call.
  bool evict_window(uint64_t block, Locks& l) {
    struct Span { uint64_t offset, bytes; Entry* entry; bool pinned; };
    std::vector<Span> spans;  // everything that is not free, in address order
    spans.reserve(mem_by_offset.size() + reserved.size());
    auto e_it = mem_by_offset.begin();
    auto r_it = reserved.begin();
    while (e_it != mem_by_offset.end() || r_it != reserved.end()) {
      if (r_it == reserved.end() || (e_it != mem_by_offset.end() && e_it->first < r_it->first)) {
        Entry* e = e_it->second;
        spans.push_back({e->mem_offset, e->mem_block, e, e->leases > 0 || e->pins > 0 || e->doomed});
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
      return candidate + block <= arena.bytes();
    };
    uint64_t start;
    uint64_t cursor = window_cursor / kArenaPageBytes * kArenaPageBytes;
    if (!find_from(cursor, &start) && !find_from(0, &start)) return false;
    window_cursor = (start + block) % arena.bytes();
    std::vector<Entry*> victims;
    for (const Span& span : spans)
      if (span.entry && span.offset < start + block && span.offset + span.bytes > start) victims.push_back(span.entry);
    for (Entry* e : victims) ++e->pins;  // evicting one may drop mu: keep the rest alive
    for (Entry* e : victims) {
      --e->pins;
      if (e->doomed) {
        destroy_if_unused(e);
      } else if (e->in_memory && !e->demoting && e->leases == 0 && e->pins == 0) {
        evict_from_memory(e, l);
      }
    }
    return true;
  }

  void lease(Entry* e, Lease* out) {
    ++e->leases;
    ++leases_active;
    out->entry = e;
    out->data = arena.base() + e->mem_offset;
    out->length = e->length;
    out->checksum = e->checksum;
  }

  // ---- index budget ----
  // Makes room in the index for one more key of `key_bytes`: drops the oldest
  // disk segments (their disk-only values leave), then memory values (dropped,
  // not demoted: a demoted value keeps its index entry). May drop mu.
  bool make_index_room(size_t key_bytes, Locks& l) {
    if (cfg.index_bytes_max == 0) return true;
    constexpr int kAttemptsMax = 4096;
    for (int attempt = 0; index_bytes + index_cost(key_bytes) > cfg.index_bytes_max; ++attempt) {
      if (attempt >= kAttemptsMax) return false;
      uint32_t id;
      if (disk) {
        hold_disk(l);
        if (index_bytes + index_cost(key_bytes) <= cfg.index_bytes_max) break;
        if (disk->oldest(&id)) {
          reclaim(id, 0);
          bump(metrics->index_evictions);
          continue;
        }
      }
      Entry* victim = nullptr;
      switch (fifo.next(&victim)) {
        case S3Fifo::Step::Empty: return false;
        case S3Fifo::Step::Skipped: bump(metrics->lease_skips); break;
        case S3Fifo::Step::Moved: break;
        case S3Fifo::Step::Victim:
          bump(metrics->evictions_memory);
          bump(metrics->index_evictions);
          unlink(victim);
          break;
      }
    }
    return true;
  }

  // ---- open ----
  void rebuild_index() {
    disk->scan([this](const ScannedRecord& record) {
      Entry* e = find(record.key);
      if (record.header.kind == kRecordTombstone) {
        if (e) unlink(e);
        return;
      }
      if (!e) {
        e = new Entry;
        e->key = record.key;
        index.emplace(std::string_view(e->key), e);
        index_bytes += index_cost(e->key.size());
      } else {
        detach_disk(e);
      }
      e->length = record.header.value_len;
      e->checksum = record.header.value_checksum;
      attach_disk(e, record.location);
    });
    make_room(0);  // the operator may have lowered disk_bytes
  }

  // Loads the keys of the last warm shutdown back into free arena space.
  void load_warm_list() {
    std::string path = disk->dir() + "/warm.list";
    std::vector<WarmItem> items = read_warm_list(path);
    unlink_file(path);
    for (auto& item : items) {
      Entry* e = find(item.key);
      if (!e || e->in_memory || !e->on_disk) continue;
      uint64_t block = block_bytes_for(e->length), offset;
      if (!allocator.allocate(block, &offset)) continue;
      SegmentFileRef file = disk->file(e->disk.segment);
      uint8_t* dest = arena.base() + offset;
      if (!file || !read_segment(*file, e->disk.offset + sizeof(RecordHeader) + e->key.size(), e->length, dest) ||
          xxh64(dest, e->length) != e->checksum) {
        allocator.free(offset, block);
        continue;  // a bad record is found (and dropped) by its first read
      }
      attach_memory(e, offset, block);
      fifo.insert_cold(e, static_cast<QueueId>(item.queue), item.freq);
    }
  }
  static void unlink_file(const std::string& path) { ::remove(path.c_str()); }
};

Store::Store(const StoreConfig& config, Metrics* metrics) : impl_(new Impl(config, metrics)) {
  if (impl_->disk) {
    impl_->rebuild_index();
    if (config.warm_restart) impl_->load_warm_list();
  }
}

Store::~Store() = default;

PutStatus Store::begin_put(std::string_view key, uint64_t length, Reservation* out) {
  Impl& s = *impl_;
  if (key.empty() || key.size() > kKeyBytesMax) return PutStatus::KeyInvalid;
  if (length > s.cfg.value_bytes_max) {
    bump(s.metrics->puts_too_large);
    return PutStatus::TooLarge;
  }
  Impl::Locks l(s);
  if (s.find(key)) {
    bump(s.metrics->puts_exists);
    return PutStatus::Exists;
  }
  if (!s.make_index_room(key.size(), l)) {  // may drop mu: look again
    bump(s.metrics->puts_no_space);
    return PutStatus::NoSpace;
  }
  if (s.find(key)) {
    bump(s.metrics->puts_exists);
    return PutStatus::Exists;
  }
  uint64_t block = block_bytes_for(length), offset = 0;
  if (!s.allocate(block, &offset, &l)) {
    bump(s.metrics->puts_no_space);
    return PutStatus::NoSpace;
  }
  if (block > 0) s.reserved.emplace(offset, block);
  out->data = s.arena.base() + offset;
  out->length = length;
  out->offset = offset;
  out->block_bytes = block;
  return PutStatus::Stored;
}

PutStatus Store::commit_put(std::string_view key, const Reservation& r, uint64_t checksum) {
  Impl& s = *impl_;
  bool sound = xxh64(r.data, r.length) == checksum;  // outside the lock: the big read
  std::lock_guard<std::mutex> guard(s.mu);
  if (r.block_bytes > 0 && !s.reserved.erase(r.offset)) throw std::logic_error("commit_put: unknown reservation");
  if (!sound || key.empty() || key.size() > kKeyBytesMax) {
    s.allocator.free(r.offset, r.block_bytes);
    if (!sound) bump(s.metrics->checksum_failures_put);
    return sound ? PutStatus::KeyInvalid : PutStatus::ChecksumMismatch;
  }
  if (s.find(key)) {  // a concurrent put of the same key won
    s.allocator.free(r.offset, r.block_bytes);
    bump(s.metrics->puts_exists);
    return PutStatus::Exists;
  }
  Entry* e = new Entry;
  e->key = std::string(key);
  e->length = r.length;
  e->checksum = checksum;
  s.index.emplace(std::string_view(e->key), e);
  s.index_bytes += index_cost(e->key.size());
  s.attach_memory(e, r.offset, r.block_bytes);
  s.fifo.insert(e, key_hash_of(e->key));
  bump(s.metrics->puts_stored);
  return PutStatus::Stored;
}

void Store::abort_put(const Reservation& r) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> guard(s.mu);
  if (r.block_bytes > 0 && !s.reserved.erase(r.offset)) throw std::logic_error("abort_put: unknown reservation");
  s.allocator.free(r.offset, r.block_bytes);
}

bool Store::acquire(std::string_view key, Lease* out) {
  Impl& s = *impl_;
  Impl::Locks l(s);
  Entry* e = s.find(key);
  if (!e) {
    bump(s.metrics->misses);
    return false;
  }
  e->read_since_written = true;
  if (e->in_memory) {
    s.fifo.touch(e);
    s.lease(e, out);
    bump(s.metrics->hits_memory);
    return true;
  }
  // Disk only: load into a private block, outside the lock. The pin keeps
  // `e` alive: making room may reclaim its segment and unlink it.
  ++e->pins;
  uint64_t block = block_bytes_for(e->length), offset = 0;
  bool allocated = s.allocate(block, &offset, &l);  // may drop mu while evicting
  if (!allocated || e->doomed || e->in_memory) {
    if (allocated) s.allocator.free(offset, block);
    --e->pins;
    if (allocated && !e->doomed) {  // another reader loaded it meanwhile
      s.fifo.touch(e);
      s.lease(e, out);
      bump(s.metrics->hits_memory);
      return true;
    }
    s.destroy_if_unused(e);
    bump(s.metrics->misses);
    return false;
  }
  if (block > 0) s.reserved.emplace(offset, block);
  RecordLocation location = e->disk;
  SegmentFileRef file = s.disk->file(location.segment);
  uint64_t length = e->length, checksum = e->checksum;
  uint64_t value_offset = location.offset + sizeof(RecordHeader) + e->key.size();
  uint8_t* dest = s.arena.base() + offset;

  l.store.unlock();
  bool read_ok = file && read_segment(*file, value_offset, length, dest);
  bool sound = read_ok && xxh64(dest, length) == checksum;
  l.store.lock();
  if (read_ok && !sound) s.hold_disk(l);  // the unlink and its tombstone go together

  if (block > 0) s.reserved.erase(offset);
  bool same_record = !e->doomed && e->on_disk && e->disk.segment == location.segment &&
                     e->disk.offset == location.offset;
  if (!read_ok) {
    bump(s.metrics->disk_errors);
  } else if (!sound) {
    bump(s.metrics->checksum_failures);
    if (same_record) {  // drop the record for good: a tombstone keeps it from coming back
      std::string bad_key = e->key;
      s.unlink(e);  // still pinned, so `e` stays valid below
      s.write_tombstone(bad_key);
    }
  }
  bool publish = sound && !e->doomed;
  if (publish && !e->in_memory) {
    s.attach_memory(e, offset, block);  // clean: keeps its disk copy
    s.fifo.insert(e, key_hash_of(e->key));
    bump(s.metrics->hits_disk);
    bump(s.metrics->promotions_to_memory);
  } else {
    s.allocator.free(offset, block);  // failed, removed meanwhile, or another reader loaded it first
    if (publish) {
      s.fifo.touch(e);
      bump(s.metrics->hits_memory);
    }
  }
  --e->pins;
  if (publish) {
    s.lease(e, out);
    return true;
  }
  s.destroy_if_unused(e);
  bump(s.metrics->misses);
  return false;
}

void Store::release(const Lease& lease) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> guard(s.mu);
  Entry* e = lease.entry;
  if (!e || e->leases == 0) throw std::logic_error("release: lease not held");
  --e->leases;
  --s.leases_active;
  s.destroy_if_unused(e);
}

bool Store::contains(std::string_view key) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> guard(s.mu);
  Entry* e = s.find(key);
  // An existence probe is a use: HiCache clients probe a chain's prefix before reading it,
  // and a hot chain's page 0 must outlive its suffix pages (a chain without page 0 is worthless).
  if (e && e->in_memory) s.fifo.touch(e);
  return e != nullptr;
}

bool Store::remove(std::string_view key) {
  Impl& s = *impl_;
  Impl::Locks l(s);
  Entry* e = s.find(key);
  if (!e) return false;
  if (e->on_disk) {  // the unlink and its tombstone go together: a put in between would be shadowed
    s.hold_disk(l);
    e = s.find(key);
    if (!e) return false;
  }
  bool had_disk_copy = e->on_disk;
  std::string removed_key = e->key;
  s.unlink(e);
  if (had_disk_copy) s.write_tombstone(removed_key);
  bump(s.metrics->removes);
  return true;
}

Store::KeysPage Store::keys_page(uint64_t cursor, size_t limit) {
  if (limit == 0) throw std::invalid_argument("keys_page: limit must be at least 1");
  limit = std::min(limit, kKeysPageMax);
  // Bounds the lock hold on a sparse table (many buckets, few keys left).
  const size_t buckets_max = 4 * limit + 64;
  const uint64_t cursor_buckets = cursor >> 32, cursor_next = cursor & 0xffffffffu;
  if (cursor != 0 && (cursor_buckets == 0 || cursor_next >= cursor_buckets))
    throw std::invalid_argument("keys_page: cursor " + std::to_string(cursor) +
                                " was not returned by keys_page; start a scan with cursor 0");
  Impl& s = *impl_;
  KeysPage page;
  std::lock_guard<std::mutex> guard(s.mu);
  const size_t buckets = s.index.bucket_count();
  if (buckets >= (size_t(1) << 31)) throw std::logic_error("keys_page: index has too many buckets for a cursor");
  size_t bucket = 0;
  if (cursor != 0) {
    if (cursor_buckets == buckets) bucket = size_t(cursor_next);
    else page.restarted = true;  // rehashed: keys moved between buckets, start over
  }
  page.keys.reserve(std::min(limit, s.index.size()));
  for (size_t visited = 0; bucket < buckets && page.keys.size() < limit && visited < buckets_max;
       ++bucket, ++visited) {
    const size_t n = s.index.bucket_size(bucket);
    if (n == 0) continue;
    if (!page.keys.empty() && page.keys.size() + n > limit) break;  // whole buckets only
    for (auto it = s.index.begin(bucket); it != s.index.end(bucket); ++it) page.keys.emplace_back(it->first);
  }
  page.next_cursor = bucket < buckets ? (uint64_t(buckets) << 32) | uint64_t(bucket) : 0;
  return page;
}

std::vector<std::string> Store::keys(size_t limit) {
  std::vector<std::string> out;
  uint64_t cursor = 0;
  while (out.size() < limit) {
    KeysPage page = keys_page(cursor, limit - out.size());
    if (page.restarted) out.clear();  // the scan started over: drop what would repeat
    for (std::string& key : page.keys) out.push_back(std::move(key));
    cursor = page.next_cursor;
    if (cursor == 0) break;
  }
  if (out.size() > limit) out.resize(limit);
  return out;
}

void Store::flush() {
  Impl& s = *impl_;
  Impl::Locks l(s);
  if (!s.disk) return;
  s.hold_disk(l);
  // Coldest first, so if the disk is smaller than memory the hottest survive.
  std::vector<Entry*> order(s.fifo.small().begin(), s.fifo.small().end());
  order.insert(order.end(), s.fifo.main().begin(), s.fifo.main().end());
  for (Entry* e : order)
    if (!e->on_disk) s.write_value(e);
  s.disk->sync_all();
  std::vector<WarmItem> warm;
  for (auto it = order.rbegin(); it != order.rend(); ++it)
    if ((*it)->on_disk) warm.push_back({(*it)->key, static_cast<uint8_t>((*it)->queue), (*it)->freq});
  if (!write_warm_list(s.disk->dir() + "/warm.list", warm)) bump(s.metrics->disk_errors);
  s.disk->sync_all();
}

void Store::check_integrity() {
  Impl& s = *impl_;
  Impl::Locks l(s);
  s.hold_disk(l);  // no record half-written
  auto fail = [](const std::string& what) { throw std::logic_error("store integrity: " + what); };
  std::vector<std::pair<uint64_t, uint64_t>> used;
  uint64_t mem_entries = 0, mem_value_bytes = 0, disk_entries = 0, leases = 0, blocks = 0;
  auto visit = [&](Entry* e) {
    if (e->in_memory) {
      if (e->mem_block != block_bytes_for(e->length)) fail("block size class mismatch for key " + e->key);
      if (e->mem_offset + e->mem_block > s.arena.bytes()) fail("block outside the arena");
      used.emplace_back(e->mem_offset, e->mem_block);
      if (e->mem_block > 0) ++blocks;
      ++mem_entries;
      mem_value_bytes += e->length;
    }
    leases += e->leases;
  };
  for (auto& [key, e] : s.index) {
    if (e->key != key || e->doomed) fail("index entry mismatch for key " + e->key);
    visit(e);
    if (!e->demoting && e->in_memory != (e->queue != QueueId::None))
      fail("queue membership does not match the memory tier");
    if (e->demoting && (e->queue != QueueId::None || !e->in_memory || e->pins == 0)) fail("demoting entry state");
    if (!e->in_memory && !e->on_disk) fail("entry in neither tier: " + e->key);
    if (e->on_disk) {
      if (!s.disk) fail("disk copy without a disk tier");
      ++disk_entries;
      if (*e->disk_pos != e) fail("segment list position broken");
      if (e->disk.offset + record_bytes(e->key.size(), e->length) > s.disk->segment_size(e->disk.segment))
        fail("disk record past the end of its segment");
    }
  }
  for (Entry* e : s.doomed) {
    if (!e->doomed || (e->leases == 0 && e->pins == 0) || e->queue != QueueId::None || e->on_disk)
      fail("doomed entry state");
    visit(e);
  }
  for (auto& [offset, block] : s.reserved) used.emplace_back(offset, block);
  size_t mapped = 0;
  for (auto& [offset, e] : s.mem_by_offset) {
    if (!e->in_memory || e->mem_offset != offset) fail("address map out of step with memory copies");
    ++mapped;
  }
  if (mapped != blocks) fail("address map misses memory copies");
  s.allocator.check(used);
  if (mem_entries != s.mem_entries || mem_value_bytes != s.mem_value_bytes) fail("memory tier counters drifted");
  uint64_t index_bytes = 0;
  for (auto& [key, e] : s.index) index_bytes += index_cost(key.size());
  if (index_bytes != s.index_bytes) fail("index byte count drifted");
  if (leases != s.leases_active) fail("lease count drifted");
  s.fifo.check();
  size_t listed = 0;
  for (auto& [id, list] : s.segment_entries)
    for (Entry* e : list) {
      ++listed;
      if (!e->on_disk || e->disk.segment != id) fail("segment list holds a foreign entry");
    }
  if (listed != disk_entries || disk_entries != s.disk_entries) fail("disk tier counters drifted");
  if (s.disk) s.disk->check();
  if (s.arena.bytes() - s.allocator.free_bytes() > s.cfg.memory_bytes) fail("memory tier over capacity");
}

int Store::arena_fd() const { return impl_->arena.fd(); }
uint64_t Store::arena_bytes() const { return impl_->arena.bytes(); }

void Store::fill_gauges(std::vector<std::pair<std::string, int64_t>>* out) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> guard(s.mu);
  auto add = [out](const char* name, uint64_t value) { out->emplace_back(name, static_cast<int64_t>(value)); };
  add("keys", s.index.size());
  add("index_bytes", s.index_bytes);
  add("keys_memory", s.mem_entries);
  add("keys_disk", s.disk_entries);
  add("memory_value_bytes", s.mem_value_bytes);
  add("arena_bytes", s.arena.bytes());
  add("arena_free_bytes", s.allocator.free_bytes());
  add("arena_largest_free_bytes", s.allocator.largest_free());
  add("memory_small_queue_bytes", s.fifo.small_bytes());
  add("memory_main_queue_bytes", s.fifo.main_bytes());
  add("ghost_keys", s.fifo.ghost_count());
  add("leases_active", s.leases_active);
  add("disk_bytes", s.disk ? s.disk->disk_bytes() : 0);
  add("disk_used_bytes", s.disk ? s.disk->used_bytes() : 0);
  add("disk_segments", s.disk ? s.disk->segment_count() : 0);
}

}  // namespace gcache
