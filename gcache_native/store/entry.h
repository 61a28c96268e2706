// One index entry: a key's value, its copies in the memory and disk tiers,
// and its eviction and lease state. Private to the Store (guarded by its lock).
#pragma once

#include <cstdint>
#include <list>
#include <string>

#include "disk/segments.h"
#include "eviction/config.h"

namespace gcache {

// Which eviction queue holds the memory copy. s3fifo: its small and main FIFOs;
// chain: Small = fresh (not used since put), Main = used; lru: Main.
enum class QueueId : uint8_t { None = 0, Small = 1, Main = 2 };

struct Entry {
  std::string key;
  uint64_t key_hash = 0;  // key_hash_of(key): ghosts and sampling
  OwnerId owner = 0;
  uint64_t length = 0;
  uint64_t checksum = 0;  // xxh64 of the value

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

  uint32_t leases = 0;  // readers holding the memory copy
  uint32_t pins = 0;    // loads from disk in flight (keep the Entry alive)
  bool doomed = false;  // unlinked from the index; freed when leases and pins reach 0
  bool demoting = false;  // being written to disk outside the lock: out of the queues, pinned

  bool read_since_written = false;  // earns one copy-forward when its segment is reclaimed
  bool probed = false;  // disk-only, in an EXISTS prefix and not read since: a reclaim copies it forward
  bool copied_forward = false;
};

}  // namespace gcache
