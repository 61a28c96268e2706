// The Store: one lock (mu) over its parts: the index (store/index.h), the
// memory tier (store/memory_tier.h), the disk tier (store/disk_tier.h), the
// owner accounts (store/owner_accounts.h) and the eviction policy's queues.
// What is here is what spans them: the put, get and remove paths, eviction
// and demotion, reclaims and copy-forwards, loads from disk, flush. Payload
// copies into and out of the arena happen outside the lock (the caller's, or
// ours for loads from disk), and so do demotion and flush writes: a second
// lock (disk_mu, always taken before mu) serializes disk appends and
// reclaims, so only the last record can ever be torn.
#include "store/store.h"

#include <algorithm>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "common/assert.h"
#include "common/checksum.h"
#include "core/entry.h"
#include "disk/segments.h"
#include "eviction/policy.h"
#include "store/disk_tier.h"
#include "store/index.h"
#include "store/memory_tier.h"
#include "store/owner_accounts.h"
#include "store/warm_list.h"

namespace gcache {

namespace {

#ifdef GCACHE_DEBUG
// Debug builds: every public operation ends with check_integrity, once its
// own locks are released (not when it is leaving by an exception), so a
// broken invariant fails the operation that broke it. The check walks every
// entry: past kCheckEveryOpEntries entries it runs after every
// (entries / kCheckEveryOpEntries)-th operation instead, so a test that
// stores 70,000 keys stays linear (about 128 entry visits per operation).
constexpr uint64_t kCheckEveryOpEntries = 128;
std::atomic<uint64_t> ops_since_check{0};

struct CheckAfterOp {
  Store* store;
  ~CheckAfterOp() noexcept(false) {
    if (std::uncaught_exceptions() > 0) return;
    const uint64_t every = store->debug_entries() / kCheckEveryOpEntries + 1;
    if (ops_since_check.fetch_add(1, std::memory_order_relaxed) + 1 < every) return;
    ops_since_check.store(0, std::memory_order_relaxed);
    store->check_integrity();
  }
};
#define GCACHE_CHECK_AFTER_OP() \
  CheckAfterOp check_after_op_ { this }
#else
#define GCACHE_CHECK_AFTER_OP() ((void)0)
#endif

void bump(std::atomic<uint64_t>& counter, uint64_t n = 1) { counter.fetch_add(n, std::memory_order_relaxed); }
uint64_t index_cost(size_t key_bytes) { return Index::cost(key_bytes); }
}  // namespace

struct Store::Impl {
  StoreConfig cfg;
  Metrics* metrics;
  MemoryTier memory;
  std::unique_ptr<EvictionPolicy> policy;
  OwnerAccounts owners;
  DiskTier disk;  // false: no disk tier
  Index index;

  std::mutex disk_mu;  // order: disk_mu, then mu
  std::mutex mu;
  std::atomic<uint64_t> put_batches{0};
  // Keys of unverified values a reader has copied (queue_check), oldest
  // first, for scrub() (under mu). Bounded: a key past the bound is not
  // queued, and its readers go on checking it themselves.
  static constexpr size_t kUnverifiedQueueMax = 65536;
  std::deque<std::string> unverified;
  uint64_t flush_written = 0, flush_total = 0;  // gauges of the flush in progress (or the last one)

  static std::unique_ptr<DiskSegments> open_disk(const StoreConfig& c, Metrics* m) {
    if (c.data_dir.empty() || c.disk_bytes == 0) return nullptr;
    return std::make_unique<DiskSegments>(c.data_dir, c.disk_bytes, c.segment_bytes, m);
  }

  // In member order: the arena, the policy, the owner quotas' check, the disk.
  Impl(const StoreConfig& c, Metrics* m)
      : cfg(c),
        metrics(m),
        memory(c.memory_bytes),
        policy(make_eviction_policy(c.eviction, memory.bytes())),
        owners(c.owner_quotas, c.eviction.kind),
        disk(open_disk(c, m)) {}

  struct Locks {
    std::unique_lock<std::mutex> store;
    std::unique_lock<std::mutex> disk;
    explicit Locks(Impl& s) : store(s.mu), disk(s.disk_mu, std::defer_lock) {}
  };
  // Adds disk_mu to a held mu, dropping mu while waiting (lock order), so the
  // caller must re-check what it looked at. True if it was taken here.
  bool hold_disk(Locks& l) {
    GCACHE_ASSERT(l.store.owns_lock());
    if (l.disk.owns_lock()) return false;
    if (!l.disk.try_lock()) {
      l.store.unlock();
      l.disk.lock();
      l.store.lock();
    }
    return true;
  }

  Entry* find(std::string_view key) { return index.find(key); }
  OwnerAccount* account_of(OwnerId owner) { return owners.find(owner); }

  // ---- tier membership; every counter change goes through these four ----
  // (the tier's own counters, and the owner's account)
  // Every copy that enters memory other than by a COMMIT was checked on its
  // way in (a PUT hashed as it landed, a disk load): publish() says otherwise.
  void attach_memory(Entry* e, uint64_t offset, uint64_t block) {
    e->verified = true;
    memory.attach(e, offset, block);
    if (OwnerAccount* a = account_of(e->owner)) a->memory += e->length;
  }
  void detach_memory(Entry* e) {
    policy->remove(e);
    memory.detach(e);
    if (OwnerAccount* a = account_of(e->owner)) a->memory -= e->length;
  }
  void attach_disk(Entry* e, const RecordLocation& location) {
    disk.attach(e, location);
    if (OwnerAccount* a = account_of(e->owner)) a->disk += e->length;
  }
  void detach_disk(Entry* e) {
    disk.detach(e);
    if (OwnerAccount* a = account_of(e->owner)) a->disk -= e->length;
  }

  // Removes the key from the index; the Entry dies now or at its last release.
  void unlink(Entry* e) {
    index.erase(e);
    policy->remove(e);
    if (e->on_disk) detach_disk(e);
    if (e->leases > 0 || e->pins > 0) {
      e->doom();
      index.keep_doomed(e);
      return;
    }
    if (e->in_memory) detach_memory(e);
    e->doom();
    index.free(e);
  }
  void destroy_if_unused(Entry* e) {
    if (!e->doomed() || e->leases > 0 || e->pins > 0) return;
    if (!index.forget_doomed(e)) return;  // already freed (retired during a flush)
    if (e->in_memory) detach_memory(e);
    index.free(e);
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
    std::list<Entry*> live = disk.take_segment(id);
    SegmentFileRef file = disk->drop(id);  // stays readable for the copies below
    uint64_t free_after = disk->disk_bytes() - std::min(disk->disk_bytes(), disk->used_bytes() + bytes_needed);
    uint64_t budget = std::min<uint64_t>(free_after, cfg.segment_bytes / 4);
    std::vector<uint8_t> bounce;
    for (Entry* e : live) {
      disk.forget_taken(e);  // detach_disk without the list erase (the list was taken whole)
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
    const uint8_t* value = memory.base() + e->mem_offset;
    if (!e->in_memory) {
      bounce->resize(e->length);
      if (!read_segment(file, e->disk.offset + sizeof(RecordHeader) + e->key.size(), e->length, bounce->data()))
        return false;
      if (checksum_of(e->checksum_kind, bounce->data(), e->length) != e->checksum) {
        bump(metrics->checksum_failures);
        return false;
      }
      value = bounce->data();
    }
    RecordLocation location;
    if (!disk->append(kRecordValue, e->key, value, e->length, sum_of(e), &location)) return false;
    attach_disk(e, location);
    e->copied_forward();
    return true;
  }

  void write_tombstone(const std::string& key) {
    RecordLocation location;
    if (disk && make_room(record_bytes(key.size(), 0)))
      disk->append(kRecordTombstone, key, nullptr, 0, ValueChecksum{0, ChecksumKind::Xxh64}, &location);
  }

  // Writes a memory value's disk record without mu (the value is pinned, so
  // its key, length, checksum and block stay put). Takes disk_mu if `l` does
  // not hold it yet, which may drop mu meanwhile. If the key was removed in
  // the meantime, a tombstone follows the record so it does not come back.
  // True if a record was written now.
  bool write_copy(Entry* e, Locks& l) {
    if (!owners.disk_allowed(e->owner, e->length)) return false;
    ++e->pins;
    bool took_disk = hold_disk(l);
    uint64_t bytes = record_bytes(e->key.size(), e->length);
    RecordLocation location;
    SegmentFileRef file;
    bool written =
        !e->doomed() && !e->on_disk && make_room(bytes) && disk->reserve(e->key, e->length, &location, &file);
    if (written) {
      // Across the unlocked write: the pin keeps e, its memory copy and its
      // block where they are; disk_mu keeps other appends and reclaims out.
      GCACHE_ASSERT(e->pins > 0 && e->in_memory && l.disk.owns_lock());
      l.store.unlock();
      written = DiskSegments::write_record(*file, location, kRecordValue, e->key, memory.base() + e->mem_offset,
                                           e->length, sum_of(e));
      l.store.lock();
      GCACHE_ASSERT(e->pins > 0 && e->in_memory && !e->on_disk);
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
    if (e->on_disk) detach_memory(e);
    else unlink(e);
    return freed;
  }

  // Takes a block, evicting when `l` is given (which may drop mu meanwhile).
  bool allocate(uint64_t block, uint64_t* offset, Locks* l) {
    if (block > memory.bytes()) return false;
    for (uint32_t attempt = 0;; ++attempt) {
      if (memory.allocate(block, offset)) return true;
      if (!l) return false;
      // Enough bytes are free, just not in one piece: stop evicting in FIFO
      // order (it would take many more victims) and clear one window instead.
      bool fragmented = attempt >= 64 && memory.free_bytes() >= 2 * block;
      if (fragmented || attempt >= cfg.eviction_attempts_max)
        // A small value needs a whole free page (a slot of another class would not do).
        return evict_window(std::max(block, kArenaPageBytes), *l) && memory.allocate(block, offset);
      Entry* victim = nullptr;
      switch (policy->next(&victim, kAnyOwner)) {
        case EvictionPolicy::Step::Empty: return false;
        case EvictionPolicy::Step::Skipped: bump(metrics->lease_skips); break;
        case EvictionPolicy::Step::Moved: break;
        case EvictionPolicy::Step::Victim: evict_from_memory(victim, *l); break;
      }
    }
  }

  // Fallback when FIFO order frees enough bytes but not in one piece: evicts
  // every value of the first address window of `block` bytes that holds no
  // leased, loading or reserved block (MemoryTier::window_victims).
  bool evict_window(uint64_t block, Locks& l) {
    std::vector<Entry*> victims;
    if (!memory.window_victims(block, &victims)) return false;
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

  // A lease pins the memory copy: it stays (not evicted, moved or freed) until release.
  void lease(Entry* e, Lease* out) {
    GCACHE_ASSERT(e->in_memory && !e->doomed());
    ++e->leases;
    memory.note_lease();
    out->entry = e;
    out->data = memory.base() + e->mem_offset;
    out->length = e->length;
    out->checksum = e->checksum;
    out->checksum_kind = e->checksum_kind;
    out->verified = e->verified;
  }

  // ---- loads from disk (the get path of a disk-only value) ----
  // What a load takes down under mu before reading without it: where the
  // record is, and the private arena block (in `reserved`) it is read into.
  struct DiskLoad {
    RecordLocation location;
    SegmentFileRef file;  // stays readable even if the segment is dropped meanwhile
    uint64_t length = 0, checksum = 0, value_offset = 0;
    ChecksumKind checksum_kind = ChecksumKind::Xxh64;
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
    const LoadRead read = read_unlocked(e, l, load);
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
    load->checksum_kind = e->checksum_kind;
    load->value_offset = load->location.offset + sizeof(RecordHeader) + e->key.size();
    load->block = block_bytes_for(load->length);
    const bool allocated = allocate(load->block, &load->offset, &l);  // may drop mu while evicting
    if (allocated && !e->doomed() && !e->in_memory) {
      memory.reserve(load->offset, load->block);
      return LoadStart::Ready;
    }
    if (allocated) memory.free(load->offset, load->block);
    return allocated && !e->doomed() ? LoadStart::LoadedMeanwhile : LoadStart::Gone;
  }

  // Reads the record's value into the load's block with mu dropped, and
  // checks it against the checksum taken down under mu.
  LoadRead read_unlocked(Entry* e, Locks& l, const DiskLoad& load) {
    uint8_t* dest = memory.base() + load.offset;
    // Across the unlocked read: the pin keeps e alive, the block is reserved
    // (no window eviction touches it), the file reference keeps the record.
    GCACHE_ASSERT(l.store.owns_lock() && e->pins > 0 && !e->in_memory);
    l.store.unlock();
    const bool read_ok = load.file && read_segment(*load.file, load.value_offset, load.length, dest);
    const bool sound = read_ok && checksum_of(load.checksum_kind, dest, load.length) == load.checksum;
    l.store.lock();
    GCACHE_ASSERT(e->pins > 0);
    return !read_ok ? LoadRead::Failed : sound ? LoadRead::Sound : LoadRead::Corrupt;
  }

  // Back under mu: e may have been removed, loaded by another reader, or lost
  // its record to a reclaim meanwhile. Publishes the block or frees it, unpins
  // e, and leases it (true) or counts the miss (false).
  bool finish_load(Entry* e, Locks& l, const DiskLoad& load, LoadRead read, Lease* out) {
    const bool exclusive = read == LoadRead::Sound && cfg.disk_exclusive;
    if (read == LoadRead::Corrupt || exclusive) hold_disk(l);  // a detach or unlink and its tombstone go together
    memory.unreserve(load.offset, load.block);
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
      memory.free(load.offset, load.block);  // failed, removed meanwhile, or another reader loaded it first
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
      evict_owned(owner, over, l);            // may drop mu: the loop re-checks
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
    for (int attempt = 0; index.over(key_bytes, cfg.index_bytes_max); ++attempt) {
      if (attempt >= kAttemptsMax) return false;
      uint32_t id;
      if (disk) {
        hold_disk(l);
        if (!index.over(key_bytes, cfg.index_bytes_max)) break;
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
      if (!checksum_kind_valid(record.header.checksum_kind)) {
        // A checksum this node cannot compute (a newer node's record): never
        // served unverified. An older record of the key stays as it was.
        bump(metrics->checksum_failures);
        return;
      }
      if (!e) {
        e = new Entry;
        e->key = record.key;
        e->key_hash = key_hash_of(e->key);
        e->owner = owners.owner_of_key(e->key);
        index.insert(e);
      } else {
        detach_disk(e);
      }
      e->length = record.header.value_len;
      e->checksum = record.header.value_checksum;
      e->checksum_kind = ChecksumKind(record.header.checksum_kind);
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
      if (!memory.allocate(block, &offset)) continue;
      SegmentFileRef file = disk->file(e->disk.segment);
      uint8_t* dest = memory.base() + offset;
      if (!file || !read_segment(*file, e->disk.offset + sizeof(RecordHeader) + e->key.size(), e->length, dest) ||
          checksum_of(e->checksum_kind, dest, e->length) != e->checksum) {
        memory.free(offset, block);
        continue;  // a bad record is found (and dropped) by its first read
      }
      attach_memory(e, offset, block);
      policy->insert_cold(e, static_cast<QueueId>(item.queue), item.freq);
    }
  }
  static void unlink_file(const std::string& path) { ::remove(path.c_str()); }

  // The end of every put: frees the reservation's block on a bad sum
  // (ChecksumMismatch), a bad key or a lost race (Exists), else publishes it
  // as the key's value; `verified`: the node has seen the bytes match.
  PutStatus publish(std::string_view key, const Reservation& r, const ValueChecksum& declared, const PutHint& hint,
                    bool sound, bool verified) {
    const uint64_t key_hash = key_hash_of(key);
    std::lock_guard<std::mutex> guard(mu);
    if (!memory.unreserve(r.offset, r.block_bytes)) throw std::logic_error("commit_put: unknown reservation");
    index.unreserve(r.index_cost);
    if (OwnerAccount* a = account_of(r.owner)) a->reserved -= r.length;
    if (!sound || key.empty() || key.size() > kKeyBytesMax) {
      memory.free(r.offset, r.block_bytes);
      if (!sound) bump(metrics->checksum_failures_put);
      return sound ? PutStatus::KeyInvalid : PutStatus::ChecksumMismatch;
    }
    Entry* e = index.make_entry();
    e->key.assign(key);
    e->key_hash = key_hash;
    e->owner = r.owner != 0 ? r.owner : hint.owner;
    e->length = r.length;
    e->checksum = declared.sum;
    e->checksum_kind = declared.kind;
    if (!index.try_insert(e)) {  // a concurrent put of the same key won (one lookup: no find first)
      index.discard(e);
      memory.free(r.offset, r.block_bytes);
      bump(metrics->puts_exists);
      return PutStatus::Exists;
    }
    attach_memory(e, r.offset, r.block_bytes);
    e->verified = verified;
    policy->insert(e, hint);
    bump(metrics->puts_stored);
    return PutStatus::Stored;
  }

  // Store::check_integrity with the locks held.
  void check_locked() const;
};

Store::Store(const StoreConfig& config, Metrics* metrics) : impl_(new Impl(config, metrics)) {
  GCACHE_CHECK_AFTER_OP();
  if (impl_->disk) {
    impl_->rebuild_index();
    if (config.warm_restart) impl_->load_warm_list();
  }
}

Store::~Store() = default;

PutStatus Store::begin_put(std::string_view key, uint64_t length, Reservation* out, OwnerId owner) {
  GCACHE_CHECK_AFTER_OP();
  Impl& s = *impl_;
  const PutStatus storable = check_put(key, length);
  if (storable != PutStatus::Stored) {
    if (storable == PutStatus::TooLarge) bump(s.metrics->puts_too_large);
    return storable;
  }
  Impl::Locks l(s);
  // Making room may drop mu: the key is looked up again only if a key was
  // indexed meanwhile (a put of this key is one).
  uint64_t inserts_seen = s.index.inserts();
  const auto indexed_meanwhile = [&] {
    if (s.index.inserts() == inserts_seen) return false;
    inserts_seen = s.index.inserts();
    return s.find(key) != nullptr;
  };
  if (s.find(key)) {
    bump(s.metrics->puts_exists);
    return PutStatus::Exists;
  }
  if (!s.make_index_room(key.size(), l)) {  // may drop mu: look again
    bump(s.metrics->puts_no_space);
    return PutStatus::NoSpace;
  }
  if (indexed_meanwhile()) {
    bump(s.metrics->puts_exists);
    return PutStatus::Exists;
  }
  if (!s.make_owner_room(owner, length, l)) {  // may drop mu: look again
    if (OwnerAccount* a = s.account_of(owner)) ++a->puts_over_quota;
    bump(s.metrics->puts_no_space);
    return PutStatus::NoSpace;
  }
  if (indexed_meanwhile()) {
    bump(s.metrics->puts_exists);
    return PutStatus::Exists;
  }
  uint64_t block = block_bytes_for(length), offset = 0;
  if (!s.allocate(block, &offset, &l)) {
    bump(s.metrics->puts_no_space);
    return PutStatus::NoSpace;
  }
  s.memory.reserve(offset, block);
  if (OwnerAccount* a = s.account_of(owner)) a->reserved += length;
  out->owner = owner;
  out->data = s.memory.base() + offset;
  out->length = length;
  out->offset = offset;
  out->block_bytes = block;
  out->index_cost = index_cost(key.size());
  s.index.reserve(out->index_cost);
  return PutStatus::Stored;
}

PutStatus Store::check_put(std::string_view key, uint64_t length) const {
  const Impl& s = *impl_;
  if (key.empty() || key.size() > kKeyBytesMax) return PutStatus::KeyInvalid;
  // A block larger than the arena would evict everything and still not fit.
  if (length > s.cfg.value_bytes_max || block_bytes_for(length) > s.memory.bytes()) return PutStatus::TooLarge;
  return PutStatus::Stored;
}

uint64_t Store::new_put_batch() { return impl_->put_batches.fetch_add(1, std::memory_order_relaxed) + 1; }

PutStatus Store::commit_put(std::string_view key, const Reservation& r, const ValueChecksum& declared,
                            const PutHint& hint, const uint64_t* landed) {
  GCACHE_CHECK_AFTER_OP();
  GCACHE_ASSERT(landed == nullptr || *landed == checksum_of(declared.kind, r.data, r.length));
  // Outside the lock: the big read, unless the caller hashed the bytes as they landed.
  const bool known_kind = checksum_kind_valid(uint8_t(declared.kind));
  const bool sound = known_kind && (landed ? *landed : checksum_of(declared.kind, r.data, r.length)) == declared.sum;
  return impl_->publish(key, r, declared, hint, sound, true);
}

PutStatus Store::commit_unverified(std::string_view key, const Reservation& r, const ValueChecksum& declared,
                                   const PutHint& hint) {
  GCACHE_CHECK_AFTER_OP();
  return impl_->publish(key, r, declared, hint, checksum_kind_valid(uint8_t(declared.kind)), false);
}

void Store::abort_put(const Reservation& r) {
  GCACHE_CHECK_AFTER_OP();
  Impl& s = *impl_;
  std::lock_guard<std::mutex> guard(s.mu);
  if (!s.memory.unreserve(r.offset, r.block_bytes)) throw std::logic_error("abort_put: unknown reservation");
  s.index.unreserve(r.index_cost);
  if (OwnerAccount* a = s.account_of(r.owner)) a->reserved -= r.length;
  s.memory.free(r.offset, r.block_bytes);
}

bool Store::acquire(std::string_view key, Lease* out) {
  GCACHE_CHECK_AFTER_OP();
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
  GCACHE_CHECK_AFTER_OP();
  Impl& s = *impl_;
  std::lock_guard<std::mutex> guard(s.mu);
  Entry* e = lease.entry;
  if (!e || e->leases == 0) throw std::logic_error("release: lease not held");
  GCACHE_ASSERT(e->in_memory && lease.data == s.memory.base() + e->mem_offset);  // leased: never moved or freed
  --e->leases;
  s.memory.note_release();
  s.destroy_if_unused(e);
}

size_t Store::exists(const std::vector<std::string_view>& keys, std::vector<uint8_t>* present) {
  GCACHE_CHECK_AFTER_OP();
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
  GCACHE_CHECK_AFTER_OP();
  if (owner == kAnyOwner) throw std::invalid_argument("evict_owned: name one owner");
  Impl& s = *impl_;
  Impl::Locks l(s);
  return s.evict_owned(owner, bytes, l);
}

std::vector<OwnerUsage> Store::owner_usage() {
  GCACHE_CHECK_AFTER_OP();
  Impl& s = *impl_;
  std::lock_guard<std::mutex> guard(s.mu);
  return s.owners.usage();
}

bool Store::verify_leased(Lease* lease, bool recheck) {
  if (lease->verified && !recheck) return true;
  GCACHE_CHECK_AFTER_OP();
  Impl& s = *impl_;
  // Outside the lock: the lease keeps the block's place (never moved or freed).
  const bool sound = checksum_of(lease->checksum_kind, lease->data, lease->length) == lease->checksum;
  Impl::Locks l(s);
  Entry* e = lease->entry;
  if (sound) {
    e->verified = true;
    lease->verified = true;
    return true;
  }
  if (e->doomed()) return false;  // removed meanwhile (or found bad by another reader)
  bump(s.metrics->checksum_failures_read);
  if (e->on_disk) s.hold_disk(l);  // the unlink and its tombstone go together (may drop mu)
  if (!e->doomed()) {              // leased: unlink only dooms it, the block stays until the last release
    const bool had_disk_copy = e->on_disk;
    std::string bad_key = e->key;
    s.unlink(e);
    if (had_disk_copy) s.write_tombstone(bad_key);
  }
  return false;
}

bool Store::queue_check(const Lease& lease) {
  if (lease.verified) return false;
  Impl& s = *impl_;
  std::lock_guard<std::mutex> guard(s.mu);
  Entry* e = lease.entry;
  if (e->verified || e->check_queued || e->doomed() || s.unverified.size() >= Impl::kUnverifiedQueueMax) return false;
  e->check_queued = true;
  s.unverified.push_back(e->key);
  return true;
}

size_t Store::scrub(size_t max_values) {
  Impl& s = *impl_;
  size_t looked_at = 0;
  for (; looked_at < max_values; ++looked_at) {
    Lease lease;
    {
      std::lock_guard<std::mutex> guard(s.mu);
      if (s.unverified.empty()) break;
      const std::string key = std::move(s.unverified.front());
      s.unverified.pop_front();
      Entry* e = s.find(key);
      if (e != nullptr) e->check_queued = false;
      // Gone, checked by a reader meanwhile, or only on disk (a load checks it).
      if (e == nullptr || e->verified || !e->in_memory || e->doomed()) continue;
      s.lease(e, &lease);  // pins the block; no read is counted, the policy is not told
    }
    verify_leased(&lease);
    release(lease);
  }
  return looked_at;
}

bool Store::remove(std::string_view key) {
  GCACHE_CHECK_AFTER_OP();
  Impl& s = *impl_;
  Impl::Locks l(s);
  Entry* e = s.find(key);
  if (!e) return false;
  if (e->on_disk) {  // the unlink and its tombstone go together: a put in between would be shadowed
    s.hold_disk(l);
    e = s.find(key);
    if (!e) return false;
  }
  const bool had_disk_copy = e->on_disk;
  std::string removed_key;  // the tombstone's key (unlink may free e)
  if (had_disk_copy) removed_key = e->key;
  s.unlink(e);
  if (had_disk_copy) s.write_tombstone(removed_key);
  bump(s.metrics->removes);
  return true;
}

Store::KeysPage Store::keys_page(uint64_t cursor, size_t limit) {
  GCACHE_CHECK_AFTER_OP();
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
  const Index::Map& index = s.index.map();
  const size_t buckets = index.bucket_count();
  if (buckets >= (size_t(1) << 31)) throw std::logic_error("keys_page: index has too many buckets for a cursor");
  size_t bucket = 0;
  if (cursor != 0) {
    if (cursor_buckets == buckets) bucket = size_t(cursor_next);
    else page.restarted = true;  // rehashed: keys moved between buckets, start over
  }
  page.keys.reserve(std::min(limit, index.size()));
  for (size_t visited = 0; bucket < buckets && page.keys.size() < limit && visited < buckets_max; ++bucket, ++visited) {
    const size_t n = index.bucket_size(bucket);
    if (n == 0) continue;
    if (!page.keys.empty() && page.keys.size() + n > limit) break;  // whole buckets only
    for (auto it = index.begin(bucket); it != index.end(bucket); ++it) page.keys.emplace_back(it->first);
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
  GCACHE_CHECK_AFTER_OP();
  Impl& s = *impl_;
  if (!s.disk) return;
  // Coldest first, so if the disk is smaller than memory the hottest survive.
  // Entries that die while the lock is dropped are kept (doomed) until the
  // last flush ends, so every pointer in `order` stays valid.
  std::vector<Entry*> order;
  {
    std::lock_guard<std::mutex> guard(s.mu);
    s.index.begin_flush();
    s.policy->coldest_first(&order);
    s.flush_written = 0;
    s.flush_total = order.size();
  }
  struct EndFlush {  // also when `progress` throws
    Impl& s;
    ~EndFlush() {
      std::lock_guard<std::mutex> guard(s.mu);
      s.index.end_flush();
    }
  } end_flush{s};
  uint64_t done = 0;
  for (Entry* e : order) {
    {
      Impl::Locks l(s);
      if (!e->doomed() && e->in_memory && !e->on_disk && !e->demoting()) {
        s.write_copy(e, l);      // drops mu while writing
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
  s.check_locked();
}

// With mu and disk_mu held. What each part can check alone it checks itself
// (MemoryTier::check, DiskSegments::check, the policy's check); what spans
// them (entries against tiers, counters, owners) is checked here.
void Store::Impl::check_locked() const {
  auto fail = [](const std::string& what) { throw std::logic_error("store integrity: " + what); };
  std::vector<std::pair<uint64_t, uint64_t>> used;
  uint64_t mem_entries = 0, mem_value_bytes = 0, disk_entries = 0, leases = 0, blocks = 0, queued = 0;
  auto visit = [&](Entry* e) {
    if (e->in_memory) {
      if (e->mem_block != block_bytes_for(e->length)) fail("block size class mismatch for key " + e->key);
      if (e->mem_offset + e->mem_block > memory.bytes()) fail("block outside the arena");
      used.emplace_back(e->mem_offset, e->mem_block);
      if (e->mem_block > 0) ++blocks;
      ++mem_entries;
      mem_value_bytes += e->length;
    }
    leases += e->leases;
  };
  for (auto& [key, e] : index.map()) {
    if (e->key != key || e->doomed()) fail("index entry mismatch for key " + e->key);
    visit(e);
    if (!e->demoting() && e->in_memory != (e->queue != QueueId::None))
      fail("queue membership does not match the memory tier");
    if (e->queue != QueueId::None) ++queued;
    if (e->demoting() && (e->queue != QueueId::None || !e->in_memory || e->pins == 0)) fail("demoting entry state");
    if (!e->in_memory && !e->on_disk && !loading(e)) fail("entry in neither tier: " + e->key);
    if (e->on_disk) {
      if (!disk) fail("disk copy without a disk tier");
      ++disk_entries;
      if (*e->disk_pos != e) fail("segment list position broken");
      if (e->disk.offset + record_bytes(e->key.size(), e->length) > disk->segment_size(e->disk.segment))
        fail("disk record past the end of its segment");
    }
  }
  for (Entry* e : index.doomed()) {
    if (!e->doomed() || (e->leases == 0 && e->pins == 0) || e->queue != QueueId::None || e->on_disk)
      fail("doomed entry state");
    visit(e);
  }
  memory.check(std::move(used), blocks);
  for (auto& [owner, a] : owners.all()) {  // per-owner bytes match the entries
    uint64_t in_memory = 0, on_disk = 0;
    for (auto& [key, e] : index.map()) {
      if (e->owner != owner) continue;
      if (e->in_memory) in_memory += e->length;
      if (e->on_disk) on_disk += e->length;
    }
    for (Entry* e : index.doomed())
      if (e->owner == owner && e->in_memory) in_memory += e->length;
    if (in_memory != a.memory || on_disk != a.disk) fail("owner byte counts drifted for '" + a.quota.name + "'");
    if (a.quota.disk_off && a.disk > 0) fail("owner '" + a.quota.name + "' has values on disk with disk off");
  }
  if (mem_entries != memory.entries() || mem_value_bytes != memory.value_bytes()) fail("memory tier counters drifted");
  uint64_t index_bytes = 0;
  for (auto& [key, e] : index.map()) index_bytes += index_cost(key.size());
  if (index_bytes != index.bytes()) fail("index byte count drifted");
  if (leases != memory.leases_active()) fail("lease count drifted");
  policy->check();
  if (policy->count() != queued) fail("eviction policy count differs from the queued values");
  for (Entry* e : index.retired())
    if (!e->doomed() || e->leases > 0 || e->pins > 0 || e->in_memory || e->on_disk) fail("retired entry state");
  size_t listed = 0;
  for (auto& [id, list] : disk.live())
    for (Entry* e : list) {
      ++listed;
      if (!e->on_disk || e->disk.segment != id) fail("segment list holds a foreign entry");
    }
  if (listed != disk_entries || disk_entries != disk.entries()) fail("disk tier counters drifted");
  if (disk) disk->check();
  if (memory.bytes() - memory.free_bytes() > cfg.memory_bytes) fail("memory tier over capacity");
}

uint64_t Store::debug_entries() {
  std::lock_guard<std::mutex> guard(impl_->mu);
  return impl_->index.size() + impl_->index.doomed().size();
}

int Store::arena_fd() const { return impl_->memory.fd(); }
uint64_t Store::arena_bytes() const { return impl_->memory.bytes(); }
const uint8_t* Store::arena_base() const { return impl_->memory.base(); }

void Store::fill_gauges(std::vector<std::pair<std::string, int64_t>>* out) {
  GCACHE_CHECK_AFTER_OP();
  Impl& s = *impl_;
  std::lock_guard<std::mutex> guard(s.mu);
  auto add = [out](const char* name, uint64_t value) { out->emplace_back(name, static_cast<int64_t>(value)); };
  add("keys", s.index.size());
  add("index_bytes", s.index.bytes());
  add("keys_memory", s.memory.entries());
  add("keys_disk", s.disk.entries());
  add("memory_value_bytes", s.memory.value_bytes());
  add("arena_bytes", s.memory.bytes());
  add("arena_free_bytes", s.memory.free_bytes());
  add("arena_largest_free_bytes", s.memory.largest_free());
  s.policy->fill_gauges([&add](const char* name, uint64_t value) { add(name, value); });
  add("flush_values_written", s.flush_written);
  add("flush_values_total", s.flush_total);
  add("leases_active", s.memory.leases_active());
  add("disk_bytes", s.disk ? s.disk->disk_bytes() : 0);
  add("disk_used_bytes", s.disk ? s.disk->used_bytes() : 0);
  add("disk_segments", s.disk ? s.disk->segment_count() : 0);
}

}  // namespace gcache
