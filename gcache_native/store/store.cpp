// The Store: one lock (mu) over the index, the arena allocator, the eviction
// policy's queues and the disk bookkeeping. Payload copies into and out of the arena
// happen outside it (the caller's, or ours for loads from disk), and so do
// demotion and flush writes: a second lock (disk_mu, always taken before mu)
// serializes disk appends and reclaims, so only the last record can ever be torn.
#include "store/store.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "common/arena_allocator.h"
#include "common/arena_shared_memory.h"
#include "common/checksum.h"
#include "disk/segments.h"
#include "eviction/policy.h"
#include "store/entry.h"
#include "store/warm_list.h"

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
  std::unique_ptr<EvictionPolicy> policy;
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
  uint64_t index_reserved = 0;  // index_cost of keys reserved but not yet committed
  std::atomic<uint64_t> put_batches{0};
  // While a flush runs it holds Entry pointers without mu: entries that die
  // meanwhile are kept (doomed) in `retired` until the last flush ends.
  uint32_t flushes_running = 0;
  std::vector<Entry*> retired;
  uint64_t flush_written = 0, flush_total = 0;  // gauges of the flush in progress (or the last one)
  // Per-owner usage, for the owners that have quotas (fixed at open, so
  // pointers into it stay valid). Value bytes, not blocks: what a quota names.
  struct OwnerAccount {
    OwnerQuota quota;
    uint64_t memory = 0, reserved = 0, disk = 0;
    uint64_t quota_evictions = 0, disk_refusals = 0, puts_over_quota = 0;
  };
  std::unordered_map<OwnerId, OwnerAccount> owners;
  std::unordered_map<std::string, OwnerId> owner_by_name;  // a restart gives disk values back

  Impl(const StoreConfig& c, Metrics* m)
      : cfg(c), metrics(m), arena(arena_size_for(c.memory_bytes)), allocator(arena.bytes()),
        policy(make_eviction_policy(c.eviction, arena.bytes())) {
    for (const OwnerQuota& q : cfg.owner_quotas) {
      if (q.memory_bytes > 0 && cfg.eviction.kind == PolicyKind::S3Fifo)
        throw std::invalid_argument("owner '" + q.name + "' has a memory quota, which the s3fifo eviction policy "
                                    "cannot enforce (it cannot evict one owner's values); use chain or lru");
      owners[q.owner].quota = q;
      owner_by_name[q.name] = q.owner;
    }
    if (!cfg.data_dir.empty() && cfg.disk_bytes > 0)
      disk = std::make_unique<DiskSegments>(cfg.data_dir, cfg.disk_bytes, cfg.segment_bytes, metrics);
  }

  ~Impl() {
    for (auto& kv : index) delete kv.second;
    for (Entry* e : doomed) delete e;
    for (Entry* e : retired) delete e;
  }

  void free_entry(Entry* e) {
    if (flushes_running > 0) retired.push_back(e);  // a flush may still look at it
    else delete e;
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

  OwnerAccount* account_of(OwnerId owner) {
    if (owners.empty()) return nullptr;
    auto it = owners.find(owner);
    return it == owners.end() ? nullptr : &it->second;
  }
  // The owner named by a stored key's tenant prefix (name + NUL), or 0.
  OwnerId owner_of_key(std::string_view key) const {
    size_t nul = key.find('\0');
    if (nul == std::string_view::npos) return 0;
    auto it = owner_by_name.find(std::string(key.substr(0, nul)));
    return it == owner_by_name.end() ? 0 : it->second;
  }
  // May e be written to disk? Not if its owner's disk is off or its disk quota
  // would be exceeded: it is then dropped where it would have been demoted.
  bool disk_allowed(Entry* e) {
    OwnerAccount* a = account_of(e->owner);
    if (!a) return true;
    bool ok = !a->quota.disk_off && (a->quota.disk_bytes == 0 || a->disk + e->length <= a->quota.disk_bytes);
    if (!ok) ++a->disk_refusals;
    return ok;
  }

  // ---- tier membership; every counter change goes through these four ----
  void attach_memory(Entry* e, uint64_t offset, uint64_t block) {
    e->in_memory = true;
    e->mem_offset = offset;
    e->mem_block = block;
    if (block > 0) mem_by_offset.emplace(offset, e);
    ++mem_entries;
    mem_value_bytes += e->length;
    if (OwnerAccount* a = account_of(e->owner)) a->memory += e->length;
  }
  void detach_memory(Entry* e) {
    policy->remove(e);
    allocator.free(e->mem_offset, e->mem_block);
    if (e->mem_block > 0) mem_by_offset.erase(e->mem_offset);
    e->in_memory = false;
    --mem_entries;
    mem_value_bytes -= e->length;
    if (OwnerAccount* a = account_of(e->owner)) a->memory -= e->length;
  }
  void attach_disk(Entry* e, const RecordLocation& location) {
    e->on_disk = true;
    e->disk = location;
    auto& list = segment_entries[location.segment];
    e->disk_pos = list.insert(list.end(), e);
    ++disk_entries;
    if (OwnerAccount* a = account_of(e->owner)) a->disk += e->length;
  }
  void detach_disk(Entry* e) {
    auto it = segment_entries.find(e->disk.segment);
    it->second.erase(e->disk_pos);
    if (it->second.empty()) segment_entries.erase(it);
    e->on_disk = false;
    --disk_entries;
    if (OwnerAccount* a = account_of(e->owner)) a->disk -= e->length;
  }

  // Removes the key from the index; the Entry dies now or at its last release.
  void unlink(Entry* e) {
    index.erase(std::string_view(e->key));
    index_bytes -= index_cost(e->key.size());
    policy->remove(e);
    if (e->on_disk) detach_disk(e);
    if (e->leases > 0 || e->pins > 0) {
      e->doom();
      doomed.insert(e);
      return;
    }
    if (e->in_memory) detach_memory(e);
    e->doom();
    free_entry(e);
  }
  void destroy_if_unused(Entry* e) {
    if (!e->doomed() || e->leases > 0 || e->pins > 0) return;
    if (!doomed.erase(e)) return;  // already freed (retired during a flush)
    if (e->in_memory) detach_memory(e);
    free_entry(e);
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

  // Drops one segment. Disk-only values an EXISTS reported to a client that
  // has not read them yet get copied forward (as far as the disk bound allows:
  // the GET that follows must find them). Other live records read since they
  // were written get copied forward once, within a budget of a quarter
  // segment. Other disk-only values leave the store; values also in memory
  // just lose their disk copy. A value being loaded from this segment stays:
  // its reader holds the file open and puts the value in memory.
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
      e->on_disk = false;  // detach_disk without the list erase (the list was taken whole)
      --disk_entries;
      if (OwnerAccount* a = account_of(e->owner)) a->disk -= e->length;
      if (loading(e)) continue;
      uint64_t bytes = record_bytes(e->key.size(), e->length);
      bool promised = e->probed && !e->in_memory && bytes <= free_after;
      bool second_chance = e->second_chance_earned() && bytes <= budget;
      if ((promised || second_chance) && copy_forward(e, *file, &bounce)) {
        bump(metrics->disk_copy_forwards);
        free_after -= bytes;
        budget -= std::min(budget, bytes);
        e->probed = false;  // one extra life per probe
        continue;
      }
      if (!e->in_memory) {
        bump(metrics->evictions_disk);
        unlink(e);
      }
    }
  }

  // A disk-only value an acquire() is reading into memory (pinned, mu dropped).
  static bool loading(const Entry* e) { return e->pins > 0 && !e->in_memory; }
  // After a failed load, e unpinned: if its segment was reclaimed meanwhile,
  // no copy is left, so the key leaves (and e is freed: true). Else e is freed
  // only if it was removed meanwhile and is unused now.
  bool drop_copyless_or_destroy(Entry* e) {
    if (!e->doomed() && !e->in_memory && !e->on_disk && e->pins == 0) {
      bump(metrics->evictions_disk);
      unlink(e);
      return true;
    }
    destroy_if_unused(e);
    return false;
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
    e->copied_forward();
    return true;
  }

  void write_tombstone(const std::string& key) {
    RecordLocation location;
    if (disk && make_room(record_bytes(key.size(), 0))) disk->append(kRecordTombstone, key, nullptr, 0, 0, &location);
  }

  // Writes a memory value's disk record without mu (the value is pinned, so
  // its key, length, checksum and block stay put). Takes disk_mu if `l` does
  // not hold it yet, which may drop mu meanwhile. If the key was removed in
  // the meantime, a tombstone follows the record so it does not come back.
  // True if a record was written now.
  bool write_copy(Entry* e, Locks& l) {
    if (!disk_allowed(e)) return false;
    ++e->pins;
    bool took_disk = hold_disk(l);
    uint64_t bytes = record_bytes(e->key.size(), e->length);
    RecordLocation location;
    SegmentFileRef file;
    bool written = !e->doomed() && !e->on_disk && make_room(bytes) && disk->reserve(e->key, e->length, &location, &file);
    if (written) {
      l.store.unlock();
      written = DiskSegments::write_record(*file, location, kRecordValue, e->key, arena.base() + e->mem_offset,
                                           e->length, e->checksum);
      l.store.lock();
      if (!written) disk->cancel(location, bytes);
    }
    --e->pins;
    if (written && e->doomed()) {
      write_tombstone(e->key);
    } else if (written) {
      attach_disk(e, location);
      e->new_disk_record();
    }
    if (took_disk) l.disk.unlock();
    return written;
  }

  // ---- memory tier ----
  // Evicting from memory demotes: a dirty value is written to disk first
  // (write_copy); a value that cannot be written leaves the store. A value
  // leased while it was being written stays, now clean. Returns the arena
  // bytes freed.
  uint64_t evict_from_memory(Entry* e, Locks& l) {
    policy->remove(e);
    if (!e->on_disk && disk) {
      ++e->pins;  // alive, and out of window evictions, while demoting
      e->start_demoting();
      if (write_copy(e, l) && !e->doomed()) bump(metrics->demotions_to_disk);
      e->end_demoting();
      --e->pins;
    }
    if (e->doomed()) {
      destroy_if_unused(e);
      return 0;
    }
    if (e->leases > 0) {
      policy->insert_cold(e, QueueId::Main, e->freq);  // read meanwhile: stays, looked at again soon
      return 0;
    }
    uint64_t freed = e->mem_block;
    bump(metrics->evictions_memory);
    if (e->on_disk) detach_memory(e); else unlink(e);
    return freed;
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
      switch (policy->next(&victim, kAnyOwner)) {
        case EvictionPolicy::Step::Empty: return false;
        case EvictionPolicy::Step::Skipped: bump(metrics->lease_skips); break;
        case EvictionPolicy::Step::Moved: break;
        case EvictionPolicy::Step::Victim: evict_from_memory(victim, *l); break;
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
      if (e->doomed()) {
        destroy_if_unused(e);
      } else if (e->in_memory && !e->demoting() && e->leases == 0 && e->pins == 0) {
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

  // ---- loads from disk (the get path of a disk-only value) ----
  // What a load takes down under mu before reading without it: where the
  // record is, and the private arena block (in `reserved`) it is read into.
  struct DiskLoad {
    RecordLocation location;
    SegmentFileRef file;  // stays readable even if the segment is dropped meanwhile
    uint64_t length = 0, checksum = 0, value_offset = 0;
    uint64_t block = 0, offset = 0;
  };
  enum class LoadStart { Ready, LoadedMeanwhile, Gone };
  enum class LoadRead { Failed, Corrupt, Sound };

  // Contract. Called with mu held (by l) for e, found in the index and
  // disk-only. Reads the value into a private block without mu, then, under
  // mu again, publishes it in memory and leases it into *out (true: a disk
  // hit, or a memory hit if another reader loaded it first), or counts a
  // miss (false: the key was removed, the record was unreadable or corrupt,
  // or no block could be had). A corrupt record is dropped for good (a
  // tombstone follows); with disk_exclusive the disk copy leaves once the
  // value is in memory. e stays pinned for the whole load (alive, and a
  // reclaim of its segment keeps it in the index). Returns with mu held, and
  // disk_mu too if it was taken for a tombstone.
  bool load_from_disk(Entry* e, Locks& l, Lease* out) {
    ++e->pins;
    DiskLoad load;
    switch (begin_load(e, l, &load)) {
      case LoadStart::Ready: break;
      case LoadStart::LoadedMeanwhile:
        --e->pins;
        policy->on_read(e);
        lease(e, out);
        bump(metrics->hits_memory);
        return true;
      case LoadStart::Gone:
        --e->pins;
        drop_copyless_or_destroy(e);
        bump(metrics->misses);
        return false;
    }
    const LoadRead read = read_unlocked(l, load);
    return finish_load(e, l, load, read, out);
  }

  // Under mu, e pinned: makes room (the owner's quota, then the arena; either
  // may drop mu) and reserves the block. Ready: *load is filled in and its
  // block reserved. Otherwise nothing is held: e was loaded by another reader
  // meanwhile, or it was removed or no block could be had.
  LoadStart begin_load(Entry* e, Locks& l, DiskLoad* load) {
    // Loading counts against the owner's memory quota too: its own coldest
    // values make room (a read is served even if they cannot). May drop mu.
    make_owner_room(e->owner, e->length, l);
    load->location = e->disk;
    load->file = disk->file(load->location.segment);
    load->length = e->length;
    load->checksum = e->checksum;
    load->value_offset = load->location.offset + sizeof(RecordHeader) + e->key.size();
    load->block = block_bytes_for(load->length);
    const bool allocated = allocate(load->block, &load->offset, &l);  // may drop mu while evicting
    if (allocated && !e->doomed() && !e->in_memory) {
      if (load->block > 0) reserved.emplace(load->offset, load->block);
      return LoadStart::Ready;
    }
    if (allocated) allocator.free(load->offset, load->block);
    return allocated && !e->doomed() ? LoadStart::LoadedMeanwhile : LoadStart::Gone;
  }

  // Reads the record's value into the load's block with mu dropped, and
  // checks it against the checksum taken down under mu.
  LoadRead read_unlocked(Locks& l, const DiskLoad& load) {
    uint8_t* dest = arena.base() + load.offset;
    l.store.unlock();
    const bool read_ok = load.file && read_segment(*load.file, load.value_offset, load.length, dest);
    const bool sound = read_ok && xxh64(dest, load.length) == load.checksum;
    l.store.lock();
    return !read_ok ? LoadRead::Failed : sound ? LoadRead::Sound : LoadRead::Corrupt;
  }

  // Back under mu: e may have been removed, loaded by another reader, or lost
  // its record to a reclaim meanwhile. Publishes the block or frees it, unpins
  // e, and leases it (true) or counts the miss (false).
  bool finish_load(Entry* e, Locks& l, const DiskLoad& load, LoadRead read, Lease* out) {
    const bool exclusive = read == LoadRead::Sound && cfg.disk_exclusive;
    if (read == LoadRead::Corrupt || exclusive) hold_disk(l);  // a detach or unlink and its tombstone go together
    if (load.block > 0) reserved.erase(load.offset);
    const bool same_record = !e->doomed() && e->on_disk && e->disk.segment == load.location.segment &&
                             e->disk.offset == load.location.offset;
    if (read == LoadRead::Failed) {
      bump(metrics->disk_errors);
    } else if (read == LoadRead::Corrupt) {
      bump(metrics->checksum_failures);
      if (same_record) {  // drop the record for good: a tombstone keeps it from coming back
        std::string bad_key = e->key;
        unlink(e);  // still pinned, so `e` stays valid below
        write_tombstone(bad_key);
      }
    }
    const bool publish = read == LoadRead::Sound && !e->doomed();
    if (publish && !e->in_memory) {
      attach_memory(e, load.offset, load.block);
      policy->insert(e, PutHint{0, false, e->owner});
      if (exclusive && e->on_disk) {
        // Memory and disk hold their sum: the record leaves the index (a
        // tombstone keeps it from coming back at restart); evicting the value
        // again writes it anew.
        detach_disk(e);
        write_tombstone(e->key);
        bump(metrics->disk_copies_dropped);
      }
      bump(metrics->hits_disk);
      bump(metrics->promotions_to_memory);
    } else {
      allocator.free(load.offset, load.block);  // failed, removed meanwhile, or another reader loaded it first
      if (publish) {
        policy->on_read(e);
        bump(metrics->hits_memory);
      }
    }
    --e->pins;
    if (publish) {
      lease(e, out);
      return true;
    }
    drop_copyless_or_destroy(e);
    bump(metrics->misses);
    return false;
  }

  // Evicts `owner`'s memory values, coldest first, until `bytes` (blocks) are
  // freed or it has none left in memory. May drop mu.
  uint64_t evict_owned(OwnerId owner, uint64_t bytes, Locks& l) {
    uint64_t freed = 0;
    for (uint32_t attempt = 0; freed < bytes && attempt < cfg.eviction_attempts_max; ++attempt) {
      Entry* victim = nullptr;
      switch (policy->next(&victim, owner)) {
        case EvictionPolicy::Step::Empty: return freed;
        case EvictionPolicy::Step::Skipped: bump(metrics->lease_skips); break;
        case EvictionPolicy::Step::Moved: break;
        case EvictionPolicy::Step::Victim: {
          const uint64_t bytes_freed = evict_from_memory(victim, l);
          freed += bytes_freed;
          if (bytes_freed > 0)
            if (OwnerAccount* a = account_of(owner)) ++a->quota_evictions;
          break;
        }
      }
    }
    return freed;
  }

  // Keeps `owner` under its memory quota with `length` more bytes: evicts its
  // own coldest values (never another owner's). False if that cannot make
  // room (the value is larger than the quota, or its values are all in use).
  bool make_owner_room(OwnerId owner, uint64_t length, Locks& l) {
    OwnerAccount* a = account_of(owner);
    if (!a || a->quota.memory_bytes == 0) return true;
    const uint64_t quota = a->quota.memory_bytes;
    for (int attempt = 0; a->memory + a->reserved + length > quota; ++attempt) {
      if (length > quota || attempt >= 64) return false;
      uint64_t over = a->memory + a->reserved + length - quota;
      uint64_t before = a->memory;
      evict_owned(owner, over, l);  // may drop mu: the loop re-checks
      if (a->memory >= before) return false;  // nothing of its own left to evict
    }
    return true;
  }

  // ---- index budget ----
  // Makes room in the index for one more key of `key_bytes`: drops the oldest
  // disk segments (their disk-only values leave), then memory values (dropped,
  // not demoted: a demoted value keeps its index entry). May drop mu.
  bool make_index_room(size_t key_bytes, Locks& l) {
    if (cfg.index_bytes_max == 0) return true;
    constexpr int kAttemptsMax = 4096;
    // Reserved keys count: a batch reserved before any commit (RESERVE) stays within the bound.
    for (int attempt = 0; index_bytes + index_reserved + index_cost(key_bytes) > cfg.index_bytes_max; ++attempt) {
      if (attempt >= kAttemptsMax) return false;
      uint32_t id;
      if (disk) {
        hold_disk(l);
        if (index_bytes + index_reserved + index_cost(key_bytes) <= cfg.index_bytes_max) break;
        if (disk->oldest(&id)) {
          reclaim(id, 0);
          bump(metrics->index_evictions);
          continue;
        }
      }
      Entry* victim = nullptr;
      switch (policy->next(&victim, kAnyOwner)) {
        case EvictionPolicy::Step::Empty: return false;
        case EvictionPolicy::Step::Skipped: bump(metrics->lease_skips); break;
        case EvictionPolicy::Step::Moved: break;
        case EvictionPolicy::Step::Victim:
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
        e->key_hash = key_hash_of(e->key);
        e->owner = owner_of_key(e->key);
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
      policy->insert_cold(e, static_cast<QueueId>(item.queue), item.freq);
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

PutStatus Store::begin_put(std::string_view key, uint64_t length, Reservation* out, OwnerId owner) {
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
  if (!s.make_owner_room(owner, length, l)) {  // may drop mu: look again
    if (Impl::OwnerAccount* a = s.account_of(owner)) ++a->puts_over_quota;
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
  if (Impl::OwnerAccount* a = s.account_of(owner)) a->reserved += length;
  out->owner = owner;
  out->data = s.arena.base() + offset;
  out->length = length;
  out->offset = offset;
  out->block_bytes = block;
  out->index_cost = index_cost(key.size());
  s.index_reserved += out->index_cost;
  return PutStatus::Stored;
}

uint64_t Store::new_put_batch() { return impl_->put_batches.fetch_add(1, std::memory_order_relaxed) + 1; }

PutStatus Store::commit_put(std::string_view key, const Reservation& r, uint64_t checksum, const PutHint& hint) {
  Impl& s = *impl_;
  bool sound = xxh64(r.data, r.length) == checksum;  // outside the lock: the big read
  const uint64_t key_hash = key_hash_of(key);
  std::lock_guard<std::mutex> guard(s.mu);
  if (r.block_bytes > 0 && !s.reserved.erase(r.offset)) throw std::logic_error("commit_put: unknown reservation");
  s.index_reserved -= r.index_cost;
  if (Impl::OwnerAccount* a = s.account_of(r.owner)) a->reserved -= r.length;
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
  e->key_hash = key_hash;
  e->owner = r.owner != 0 ? r.owner : hint.owner;
  e->length = r.length;
  e->checksum = checksum;
  s.index.emplace(std::string_view(e->key), e);
  s.index_bytes += index_cost(e->key.size());
  s.attach_memory(e, r.offset, r.block_bytes);
  s.policy->insert(e, hint);
  bump(s.metrics->puts_stored);
  return PutStatus::Stored;
}

void Store::abort_put(const Reservation& r) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> guard(s.mu);
  if (r.block_bytes > 0 && !s.reserved.erase(r.offset)) throw std::logic_error("abort_put: unknown reservation");
  s.index_reserved -= r.index_cost;
  if (Impl::OwnerAccount* a = s.account_of(r.owner)) a->reserved -= r.length;
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
  e->note_read();
  if (e->in_memory) {
    s.policy->on_read(e);
    s.lease(e, out);
    bump(s.metrics->hits_memory);
    return true;
  }
  return s.load_from_disk(e, l, out);  // disk only
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

size_t Store::exists(const std::vector<std::string_view>& keys, std::vector<uint8_t>* present) {
  Impl& s = *impl_;
  const size_t n = keys.size();
  std::vector<uint64_t> hashes(n);
  for (size_t i = 0; i < n; ++i) hashes[i] = key_hash_of(keys[i]);  // outside the lock
  std::vector<Entry*> in_memory(n, nullptr);
  present->assign(n, 0);
  std::lock_guard<std::mutex> guard(s.mu);
  size_t prefix = 0;
  for (size_t i = 0; i < n; ++i) {
    Entry* e = s.find(keys[i]);
    if (!e) continue;
    (*present)[i] = 1;
    if (e->in_memory) in_memory[i] = e;
    if (prefix == i) {
      ++prefix;
      // The client reads this prefix next: a disk reclaim meanwhile copies it forward.
      if (!e->in_memory) e->probed = true;
    }
  }
  // An existence probe is a use: HiCache clients probe a chain's prefix before reading it,
  // and a hot chain's head must outlive its suffix (a chain without its head is worthless).
  s.policy->on_exists(in_memory.data(), hashes.data(), n, prefix);
  return prefix;
}

bool Store::contains(std::string_view key) {
  std::vector<uint8_t> present;
  return exists({key}, &present) == 1;
}

uint64_t Store::evict_owned(OwnerId owner, uint64_t bytes) {
  if (owner == kAnyOwner) throw std::invalid_argument("evict_owned: name one owner");
  Impl& s = *impl_;
  Impl::Locks l(s);
  return s.evict_owned(owner, bytes, l);
}

std::vector<OwnerUsage> Store::owner_usage() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> guard(s.mu);
  std::vector<OwnerUsage> out;
  for (const auto& [owner, a] : s.owners) {
    OwnerUsage u;
    u.quota = a.quota;
    u.memory_bytes = a.memory;
    u.disk_bytes = a.disk;
    u.quota_evictions = a.quota_evictions;
    u.disk_refusals = a.disk_refusals;
    u.puts_over_quota = a.puts_over_quota;
    out.push_back(std::move(u));
  }
  return out;
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

void Store::flush(const std::function<void(uint64_t done, uint64_t total)>& progress) {
  Impl& s = *impl_;
  if (!s.disk) return;
  // Coldest first, so if the disk is smaller than memory the hottest survive.
  // Entries that die while the lock is dropped are kept (doomed) until the
  // last flush ends, so every pointer in `order` stays valid.
  std::vector<Entry*> order;
  {
    std::lock_guard<std::mutex> guard(s.mu);
    ++s.flushes_running;
    s.policy->coldest_first(&order);
    s.flush_written = 0;
    s.flush_total = order.size();
  }
  struct EndFlush {  // also when `progress` throws
    Impl& s;
    ~EndFlush() {
      std::lock_guard<std::mutex> guard(s.mu);
      if (--s.flushes_running > 0) return;
      for (Entry* e : s.retired) delete e;
      s.retired.clear();
    }
  } end_flush{s};
  uint64_t done = 0;
  for (Entry* e : order) {
    {
      Impl::Locks l(s);
      if (!e->doomed() && e->in_memory && !e->on_disk && !e->demoting()) {
        s.write_copy(e, l);  // drops mu while writing
        s.destroy_if_unused(e);  // removed meanwhile
      }
      s.flush_written = ++done;
    }
    if (progress) progress(done, order.size());
  }
  Impl::Locks l(s);
  s.hold_disk(l);
  s.disk->sync_all();
  std::vector<WarmItem> warm;  // hottest first
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    Entry* e = *it;
    if (!e->doomed() && e->in_memory && e->on_disk && e->queue != QueueId::None)
      warm.push_back({e->key, static_cast<uint8_t>(e->queue), e->freq});
  }
  if (!write_warm_list(s.disk->dir() + "/warm.list", warm)) bump(s.metrics->disk_errors);
  s.disk->sync_all();
}

void Store::check_integrity() {
  Impl& s = *impl_;
  Impl::Locks l(s);
  s.hold_disk(l);  // no record half-written
  auto fail = [](const std::string& what) { throw std::logic_error("store integrity: " + what); };
  std::vector<std::pair<uint64_t, uint64_t>> used;
  uint64_t mem_entries = 0, mem_value_bytes = 0, disk_entries = 0, leases = 0, blocks = 0, queued = 0;
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
    if (e->key != key || e->doomed()) fail("index entry mismatch for key " + e->key);
    visit(e);
    if (!e->demoting() && e->in_memory != (e->queue != QueueId::None))
      fail("queue membership does not match the memory tier");
    if (e->queue != QueueId::None) ++queued;
    if (e->demoting() && (e->queue != QueueId::None || !e->in_memory || e->pins == 0)) fail("demoting entry state");
    if (!e->in_memory && !e->on_disk && !Impl::loading(e)) fail("entry in neither tier: " + e->key);
    if (e->on_disk) {
      if (!s.disk) fail("disk copy without a disk tier");
      ++disk_entries;
      if (*e->disk_pos != e) fail("segment list position broken");
      if (e->disk.offset + record_bytes(e->key.size(), e->length) > s.disk->segment_size(e->disk.segment))
        fail("disk record past the end of its segment");
    }
  }
  for (Entry* e : s.doomed) {
    if (!e->doomed() || (e->leases == 0 && e->pins == 0) || e->queue != QueueId::None || e->on_disk)
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
  for (auto& [owner, a] : s.owners) {  // per-owner bytes match the entries
    uint64_t memory = 0, disk = 0;
    for (auto& [key, e] : s.index) {
      if (e->owner != owner) continue;
      if (e->in_memory) memory += e->length;
      if (e->on_disk) disk += e->length;
    }
    for (Entry* e : s.doomed)
      if (e->owner == owner && e->in_memory) memory += e->length;
    if (memory != a.memory || disk != a.disk) fail("owner byte counts drifted for '" + a.quota.name + "'");
    if (a.quota.disk_off && a.disk > 0) fail("owner '" + a.quota.name + "' has values on disk with disk off");
  }
  s.allocator.check(used);
  if (mem_entries != s.mem_entries || mem_value_bytes != s.mem_value_bytes) fail("memory tier counters drifted");
  uint64_t index_bytes = 0;
  for (auto& [key, e] : s.index) index_bytes += index_cost(key.size());
  if (index_bytes != s.index_bytes) fail("index byte count drifted");
  if (leases != s.leases_active) fail("lease count drifted");
  s.policy->check();
  if (s.policy->count() != queued) fail("eviction policy count differs from the queued values");
  for (Entry* e : s.retired)
    if (!e->doomed() || e->leases > 0 || e->pins > 0 || e->in_memory || e->on_disk) fail("retired entry state");
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
const uint8_t* Store::arena_base() const { return impl_->arena.base(); }

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
  s.policy->fill_gauges([&add](const char* name, uint64_t value) { add(name, value); });
  add("flush_values_written", s.flush_written);
  add("flush_values_total", s.flush_total);
  add("leases_active", s.leases_active);
  add("disk_bytes", s.disk ? s.disk->disk_bytes() : 0);
  add("disk_used_bytes", s.disk ? s.disk->used_bytes() : 0);
  add("disk_segments", s.disk ? s.disk->segment_count() : 0);
}

}  // namespace gcache
