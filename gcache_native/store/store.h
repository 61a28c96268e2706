// The node's storage engine: a shared-memory arena (memory tier) in front of
// append-only disk segments (disk tier), one index over both.
// Thread-safe: every public method may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/checksum.h"
#include "common/key_limits.h"
#include "common/metrics.h"
#include "eviction/config.h"

namespace gcache {

// One tenant's bounds in the store (docs/security.md, "Quotas"). Values carry
// their owner (PutHint::owner); keys stored as name + NUL + key let a restart
// give disk values back to their owner.
struct OwnerQuota {
  OwnerId owner = 0;
  std::string name;           // the tenant's name (its key prefix without the NUL)
  uint64_t memory_bytes = 0;  // value bytes in the memory tier; 0 = no quota
  uint64_t disk_bytes = 0;    // value bytes on disk; 0 = no quota unless disk_off
  bool disk_off = false;      // this owner's values never go to disk (dropped instead of demoted)
};

// One owner's usage, for /metrics.
struct OwnerUsage {
  OwnerQuota quota;
  uint64_t memory_bytes = 0, disk_bytes = 0;
  uint64_t quota_evictions = 0;  // own values pushed out of memory to stay under the memory quota
  uint64_t disk_refusals = 0;    // evicted values dropped, not demoted: disk off or disk quota full
  uint64_t puts_over_quota = 0;  // puts refused: the value cannot fit in the memory quota
};

struct StoreConfig {
  uint64_t memory_bytes = 1ull << 30;      // size of the shared-memory arena
  uint64_t disk_bytes = 4ull << 30;        // bound on the sum of segment file sizes; 0 = no disk tier
  std::string data_dir;                    // segments + warm list live here; empty = no disk tier
  uint64_t segment_bytes = 64ull << 20;    // target segment file size (a larger record gets its own)
  uint64_t value_bytes_max = 64ull << 20;  // larger puts get PutStatus::TooLarge
  EvictionConfig eviction;                 // memory-tier eviction policy and its settings
  bool disk_exclusive = true;              // a value loaded from disk gives up its disk copy
  uint32_t eviction_attempts_max = 4096;   // victims tried per allocation before NoSpace
  bool warm_restart = true;                // reload the warm list into memory at open
  // Heap the key index may take (estimated per key: the entry, its key, hash
  // node); a new key beyond it first drops the oldest disk segments, then
  // memory values. 0 = no limit.
  uint64_t index_bytes_max = 0;
  // Per-owner quotas. A memory quota needs a policy that can scope eviction by
  // owner (chain, lru): with s3fifo the Store throws std::invalid_argument.
  std::vector<OwnerQuota> owner_quotas;
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
  uint8_t* data = nullptr;  // where the caller writes `length` bytes
  uint64_t length = 0;
  uint64_t offset = 0;       // arena offset of the block
  uint64_t block_bytes = 0;  // size-class rounded block size
  OwnerId owner = 0;         // whose memory quota the reservation counts against
  uint64_t index_cost = 0;   // the key's share of --index-bytes-max, held until commit or abort
};

struct Entry;  // private to store/store.cpp

// A readable value pinned in the memory tier: it cannot be evicted, moved or
// freed until release(). `data` points into the arena.
struct Lease {
  Entry* entry = nullptr;
  const uint8_t* data = nullptr;
  uint64_t length = 0;
  uint64_t checksum = 0;  // of the value, by checksum_kind
  ChecksumKind checksum_kind = ChecksumKind::Xxh64;
  bool verified = true;  // false: its bytes were never checked against `checksum` (commit_unverified)
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
  // `owner` over its memory quota first evicts its own coldest values
  // (never others'); NoSpace if the value cannot fit in the quota even then.
  PutStatus begin_put(std::string_view key, uint64_t length, Reservation* out, OwnerId owner = 0);
  // KeyInvalid or TooLarge when a put of `length` bytes under `key` can never
  // be stored (a bad key; over value_bytes_max or the arena), else Stored.
  // Takes no lock: the server asks before a value takes (or waits for) budget.
  PutStatus check_put(std::string_view key, uint64_t length) const;
  // Verifies that the block's bytes hash to `declared` (else frees:
  // ChecksumMismatch), then publishes the value with that checksum. With
  // `landed` (the checksum of the same kind the caller computed as the bytes
  // landed in the block, e.g. while receiving them) the bytes are not read
  // again: landed must equal declared.sum. If another put of the same key
  // committed first, the reservation is freed and Exists returned: exactly
  // one value remains. `hint` tells the eviction policy which put batch
  // (chain) the value belongs to.
  PutStatus commit_put(std::string_view key, const Reservation& r, const ValueChecksum& declared,
                       const PutHint& hint = {}, const uint64_t* landed = nullptr);
  // Publishes the block with the writer's declared checksum without reading
  // it (a one-sided COMMIT: one memory pass per put). The value is marked
  // unverified: every reader checks it before a byte reaches its caller
  // (verify_leased, or the client's copy), so a writer that lies about its
  // sum only turns its own value into a miss. ChecksumMismatch for a kind
  // this node cannot compute; otherwise as commit_put.
  PutStatus commit_unverified(std::string_view key, const Reservation& r, const ValueChecksum& declared,
                              const PutHint& hint = {});
  void abort_put(const Reservation& r);
  // A fresh id for one put batch: the values committed with it are one prefix
  // chain, in order (PutHint).
  uint64_t new_put_batch();

  // Get path. A disk-only value is read into the arena (checksum verified;
  // a bad checksum is a miss, counts checksum_failures and drops the record).
  // Returns false on a miss.
  bool acquire(std::string_view key, Lease* out);
  void release(const Lease& lease);
  // Checks a leased value's bytes against its checksum (outside the lock; a
  // no-op for a verified one unless `recheck`: a reader reported its copy bad).
  // Sound: the value is marked verified. Bad: it is removed (the lease stays
  // valid until released), counted in checksum_failures_read, and false
  // returned: the caller answers a miss.
  bool verify_leased(Lease* lease, bool recheck = false);
  // A reader copies this unverified leased value and hashes it itself: queue
  // it for scrub() (once, bounded), so its later readers need not. A value
  // no one reads is never read again by the node (one pass per put).
  // Returns true when it queued the value (the caller may wake scrub()'s thread).
  bool queue_check(const Lease& lease);
  // Checks up to `max_values` queued values (oldest first), as verify_leased
  // does, off every request's path: a shared-memory reader of a checked value
  // then copies it without hashing. Returns how many keys it looked at (0:
  // none waiting). Counts no reads, moves nothing in the policy.
  size_t scrub(size_t max_values);

  // One EXISTS batch, keys in the client's order: present[i] = key i has a value
  // (either tier); returns how many leading keys are present. The eviction
  // policy learns of the probe (a use of that prefix); disk-only values in the
  // prefix are marked as about to be read, so a disk reclaim before the GET
  // that follows copies them forward instead of dropping them. One lock hold.
  size_t exists(const std::vector<std::string_view>& keys, std::vector<uint8_t>* present);
  bool contains(std::string_view key);  // exists() of one key: no lease, no promotion
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

  // Evicts values of `owner` from memory, coldest first (demoted to disk like
  // any eviction), until `bytes` are freed or it has none left there; returns
  // the bytes freed. The hook for per-tenant quotas: a tenant over its quota
  // evicts its own values first. 0 if the policy cannot scope by owner (s3fifo).
  uint64_t evict_owned(OwnerId owner, uint64_t bytes);

  // Usage and quota of every owner named in StoreConfig::owner_quotas.
  std::vector<OwnerUsage> owner_usage();

  // Warm shutdown: writes every memory-only value to disk (coldest first), then
  // the warm list, and fsyncs. Each value is written without the store lock (it
  // is pinned meanwhile), so gets and puts go on during a flush; values put
  // meanwhile may or may not be written. `progress(done, total)` is called
  // after each value, with no lock held. The store stays usable afterwards.
  void flush(const std::function<void(uint64_t done, uint64_t total)>& progress = {});

  // Throws std::logic_error naming the first broken invariant (allocator
  // accounting, queue membership, lease counts, capacity bounds).
  void check_integrity();
  // How many entries check_integrity walks (the index and the doomed ones).
  uint64_t debug_entries();

  // Arena shared-memory fd (memfd) and size, for same-host one-sided readers.
  int arena_fd() const;
  uint64_t arena_bytes() const;
  const uint8_t* arena_base() const;  // where data/offsets of leases and reservations point

  // Gauges: keys/bytes per tier, free arena bytes, disk bytes used, segments.
  void fill_gauges(std::vector<std::pair<std::string, int64_t>>* out);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gcache
