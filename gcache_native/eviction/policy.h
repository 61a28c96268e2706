// What the Store asks of a memory-tier eviction policy, and how to make one.
// Three policies (docs/storage.md, "Eviction"): `chain` (the default: chain-
// aware, weighted recency, self-tuned), `s3fifo` and plain `lru`. A policy
// only orders the values in memory; the Store does the evicting (demotion to
// disk, leases, pins). Every call is made under the Store's lock and is O(1)
// per value touched, except where noted.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/entry.h"
#include "eviction/config.h"

namespace gcache {

class EvictionPolicy {
 public:
  enum class Step { Victim, Moved, Skipped, Empty };
  using GaugeSink = std::function<void(const char* name, uint64_t value)>;

  virtual ~EvictionPolicy() = default;
  virtual PolicyKind kind() const = 0;

  // A value just placed in memory (a put, or a load from disk). e->key_hash and
  // e->owner are set.
  virtual void insert(Entry* e, const PutHint& hint) = 0;
  // At the eviction end of `queue` (warm reload; a value read while it was being demoted).
  virtual void insert_cold(Entry* e, QueueId queue, uint8_t freq) = 0;
  // Out of the queues (the value leaves memory or the store); no-op if not queued.
  virtual void remove(Entry* e) = 0;
  // A GET of a value in memory.
  virtual void on_read(Entry* e) = 0;
  // One EXISTS batch, keys in the client's order: in_memory[i] is key i's entry
  // if it has a memory copy (else null), key_hashes[i] its key_hash_of(),
  // `prefix` the number of leading keys present in either tier. O(n).
  virtual void on_exists(Entry* const* in_memory, const uint64_t* key_hashes, size_t n, size_t prefix) = 0;
  // One step of eviction. Victim: *victim left the queues and must leave memory.
  // Moved: the policy reordered a value. Skipped: the coldest value is leased or
  // pinned and went to the back. Empty: nothing (of `owner`) left to evict.
  // `owner` other than kAnyOwner looks only at that owner's values (a tenant
  // over its quota evicts its own first); policies with scopes_owners() false
  // answer Empty for it.
  virtual Step next(Entry** victim, OwnerId owner = kAnyOwner) = 0;
  virtual bool scopes_owners() const = 0;
  // The value next(owner) would look at first, unchanged; null when none. Lets
  // the worth layer (eviction/worth.h) compare it with the values it orders.
  virtual Entry* peek(OwnerId owner) const = 0;

  // Every queued value, coldest first (flush order; the warm list is its reverse). O(values).
  virtual void coldest_first(std::vector<Entry*>* out) const = 0;
  virtual size_t count() const = 0;
  // memory_small_queue_bytes / memory_main_queue_bytes / ghost_keys, plus the policy's own.
  virtual void fill_gauges(const GaugeSink& add) const = 0;
  // Throws std::logic_error naming the first broken invariant. O(values).
  virtual void check() const = 0;
};

std::unique_ptr<EvictionPolicy> make_eviction_policy(const EvictionConfig& config, uint64_t memory_bytes);

}  // namespace gcache
