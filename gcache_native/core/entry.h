// One index entry: a key's value, its copies in the memory and disk tiers,
// and its eviction and lease state. Private to the Store (guarded by its lock).
#pragma once

#include <cstdint>
#include <list>
#include <string>

#include "common/assert.h"
#include "common/checksum.h"
#include "core/owner.h"
#include "disk/segments.h"

namespace gcache {

// Which eviction queue holds the memory copy. s3fifo: its small and main FIFOs;
// chain: Small = fresh (not used since put), Main = used; lru: Main.
enum class QueueId : uint8_t { None = 0, Small = 1, Main = 2 };

// Where an Entry is in its life; the moves are Entry's member functions:
//   Indexed  -> Demoting  start_demoting(): its memory copy is being written
//                         to disk outside the lock (out of the queues, pinned)
//   Demoting -> Indexed   end_demoting()
//   Indexed or Demoting -> Doomed   doom(): unlinked from the index; it is
//                         freed when its leases and pins reach 0 (no way back)
enum class EntryLife : uint8_t { Indexed, Demoting, Doomed };

// The disk record's claim to one copy-forward when its segment is reclaimed:
//   None   -> Earned  note_read(): read since the record was written
//   any    -> Spent   copied_forward(): it had its copy-forward
//   any    -> None    new_disk_record(): written anew from memory
enum class SecondChance : uint8_t { None, Earned, Spent };

struct Entry {
  std::string key;
  uint64_t key_hash = 0;  // key_hash_of(key): ghosts and sampling
  OwnerId owner = 0;
  uint64_t length = 0;
  uint64_t checksum = 0;  // of the value, by checksum_kind
  ChecksumKind checksum_kind = ChecksumKind::Xxh64;
  // The node has seen the memory copy's bytes hash to `checksum`: false for a
  // value published by a COMMIT (a one-sided writer's sum, taken on trust,
  // docs/security.md) until a reader checks it (Store::verify_leased).
  bool verified = true;
  bool check_queued = false;  // in the Store's queue for scrub() (at most once at a time)

  // The two tiers are independent: a value is in memory, on disk, or both
  // (in neither only while a load from disk is in flight, pinned). Both flags
  // change only through the Store's attach/detach functions, which keep the
  // tier counters.

  // Memory copy: a block of the arena.
  bool in_memory = false;
  uint64_t mem_offset = 0;
  uint64_t mem_block = 0;

  // Disk copy: a value record in a segment. Entries without a disk copy are
  // "dirty": evicting them from memory writes a record first.
  bool on_disk = false;
  RecordLocation disk;
  std::list<Entry*>::iterator disk_pos;  // in the segment's live list

  // Eviction state of the memory copy (eviction/policy.h).
  QueueId queue = QueueId::None;
  uint8_t freq = 0;       // s3fifo: 0..3, bumped per hit
  uint64_t last_use = 0;  // chain, lru: the policy's clock at the last insert or use
  std::list<Entry*>::iterator queue_pos;
  // Cost-aware eviction (eviction/worth.h): 0 = the value carried no "worth"
  // and the policy orders it; else its cost-per-byte class, kept while the
  // Entry lives (a reload from disk keeps it).
  uint8_t worth_class = 0;
  uint8_t value_kind = 0;  // ValueKind, as the client said
  uint64_t touched = 0;    // the worth layer's clock at the last insert or use

  uint32_t leases = 0;  // readers holding the memory copy
  uint32_t pins = 0;    // loads from disk in flight (keep the Entry alive)

  // Disk-only, in an EXISTS prefix and not read since: a reclaim copies it
  // forward (the GET that follows must find it). Independent of the rest.
  bool probed = false;

  // ---- life (EntryLife) ----
  EntryLife life() const { return life_; }
  bool doomed() const { return life_ == EntryLife::Doomed; }
  bool demoting() const { return life_ == EntryLife::Demoting; }
  void start_demoting() {
    GCACHE_ASSERT(life_ == EntryLife::Indexed && in_memory && !on_disk && pins > 0 && queue == QueueId::None);
    life_ = EntryLife::Demoting;
  }
  void end_demoting() {  // a value unlinked meanwhile stays Doomed
    if (life_ == EntryLife::Demoting) life_ = EntryLife::Indexed;
  }
  void doom() {
    GCACHE_ASSERT(life_ != EntryLife::Doomed);
    life_ = EntryLife::Doomed;
  }

  // ---- the disk record's second chance (SecondChance) ----
  // A GET read the value: it earns its record a copy-forward, and a probe's
  // promise is kept.
  void note_read() {
    if (chance_ == SecondChance::None) chance_ = SecondChance::Earned;
    probed = false;
  }
  bool second_chance_earned() const { return chance_ == SecondChance::Earned; }
  void copied_forward() { chance_ = SecondChance::Spent; }
  void new_disk_record() { chance_ = SecondChance::None; }

 private:
  EntryLife life_ = EntryLife::Indexed;
  SecondChance chance_ = SecondChance::None;
};

inline ValueChecksum sum_of(const Entry* e) { return ValueChecksum{e->checksum, e->checksum_kind}; }

}  // namespace gcache
