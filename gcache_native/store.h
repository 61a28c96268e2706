// The node's storage engine: a shared-memory arena (memory tier) in front of
// append-only disk segments (disk tier), one index over both.
// Thread-safe: every public method may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "metrics.h"

namespace gcache {

// A client key is 1..512 bytes (docs/protocol.md); an authenticated node
// stores it behind its tenant's prefix (name + NUL, at most 33 bytes).
constexpr uint32_t kUserKeyBytesMax = 512;
constexpr uint32_t kTenantPrefixBytesMax = 33;
constexpr uint32_t kKeyBytesMax = kUserKeyBytesMax + kTenantPrefixBytesMax;

struct StoreConfig {
  uint64_t memory_bytes = 1ull << 30;         // size of the shared-memory arena
  uint64_t disk_bytes = 4ull << 30;           // bound on the sum of segment file sizes; 0 = no disk tier
  std::string data_dir;                       // segments + warm list live here; empty = no disk tier
  uint64_t segment_bytes = 64ull << 20;       // target segment file size (a larger record gets its own)
  uint64_t value_bytes_max = 64ull << 20;     // larger puts get PutStatus::TooLarge
  double small_queue_fraction = 0.10;         // S3-FIFO small-queue share of the memory tier
  uint32_t eviction_attempts_max = 4096;      // victims tried per allocation before NoSpace
  bool warm_restart = true;                   // reload the warm list into memory at open
  // Heap the key index may take (estimated per key: the entry, its key, hash
  // node); a new key beyond it first drops the oldest disk segments, then
  // memory values. 0 = no limit.
  uint64_t index_bytes_max = 0;
};

enum class PutStatus : uint8_t {
  Stored = 0,
  Exists = 1,
  NoSpace = 2,
  ChecksumMismatch = 3,
  TooLarge = 4,
  KeyInvalid = 5,
};

// Arena space reserved for one incoming value; invisible to readers until
// commit_put. Exactly one of commit_put / abort_put must follow begin_put
// when it returned Stored.
struct Reservation {
  uint8_t* data = nullptr;   // where the caller writes `length` bytes
  uint64_t length = 0;
  uint64_t offset = 0;       // arena offset of the block
  uint64_t block_bytes = 0;  // size-class rounded block size
};

struct Entry;  // private to store.cpp

// A readable value pinned in the memory tier: it cannot be evicted, moved or
// freed until release(). `data` points into the arena.
struct Lease {
  Entry* entry = nullptr;
  const uint8_t* data = nullptr;
  uint64_t length = 0;
  uint64_t checksum = 0;   // xxh64 of the value
};

class Store {
 public:
  // Opens (creating if needed) the data dir, rebuilds the index from disk
  // segments (torn tails skipped), then reloads the warm list. Throws
  // std::runtime_error with a readable message on failure.
  explicit Store(const StoreConfig& config, Metrics* metrics);
  ~Store();  // does NOT flush: call flush() for a warm shutdown

  // Put path. begin_put answers Exists when the key already has a committed
  // value (nothing reserved), TooLarge/KeyInvalid/NoSpace on refusal, Stored
  // when `out` now holds a reservation. Never blocks on other puts.
  PutStatus begin_put(std::string_view key, uint64_t length, Reservation* out);
  // Verifies xxh64(data) == checksum (else frees: ChecksumMismatch), then
  // publishes the value. If another put of the same key committed first, the
  // reservation is freed and Exists returned: exactly one value remains.
  PutStatus commit_put(std::string_view key, const Reservation& r, uint64_t checksum);
  void abort_put(const Reservation& r);

  // Get path. A disk-only value is read into the arena (checksum verified;
  // a bad checksum is a miss, counts checksum_failures and drops the record).
  // Returns false on a miss.
  bool acquire(std::string_view key, Lease* out);
  void release(const Lease& lease);

  bool contains(std::string_view key);  // no lease, no promotion, no recency bump
  bool remove(std::string_view key);    // true if it existed; idempotent

  // One page of a scan over the keys stored (either tier), values untouched;
  // what rebalancing walks. The lock is held for one page only, so a scan of
  // millions of keys never stalls gets and puts for long.
  // Start with cursor 0 and pass each next_cursor back; 0 = the scan is done.
  // A page holds whole hash buckets: at most min(limit, kKeysPageMax) keys
  // (more only if one bucket alone holds more), possibly none with a nonzero
  // next_cursor (it visits a bounded number of buckets). Every key stored for
  // the whole scan is listed at least once; keys put or removed meanwhile may
  // or may not be. The cursor names (bucket count, next bucket): if the index
  // rehashed in between, the page restarts from bucket 0 (restarted = true;
  // keys already listed come again). Throws std::invalid_argument for a
  // cursor no page returned, or limit 0.
  static constexpr size_t kKeysPageMax = 65536;
  struct KeysPage {
    std::vector<std::string> keys;
    uint64_t next_cursor = 0;
    bool restarted = false;
  };
  KeysPage keys_page(uint64_t cursor, size_t limit);

  // Up to `limit` keys stored now (either tier), in no particular order,
  // without duplicates; read page by page (keys_page), so not one snapshot.
  std::vector<std::string> keys(size_t limit);

  // Warm shutdown: writes every memory-only value to disk, writes the warm
  // list, fsyncs. Safe to call once; the store stays usable afterwards.
  void flush();

  // Throws std::logic_error naming the first broken invariant (allocator
  // accounting, queue membership, lease counts, capacity bounds).
  void check_integrity();

  // Arena shared-memory fd (memfd) and size, for same-host one-sided readers.
  int arena_fd() const;
  uint64_t arena_bytes() const;

  // Gauges: keys/bytes per tier, free arena bytes, disk bytes used, segments.
  void fill_gauges(std::vector<std::pair<std::string, int64_t>>* out);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gcache
