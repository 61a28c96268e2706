#include "eviction/policy.h"

#include <cmath>
#include <stdexcept>

#include "eviction/chain.h"
#include "eviction/lru.h"
#include "eviction/s3fifo.h"
#include "eviction/worth.h"

namespace gcache {

PolicyKind policy_kind_from_name(const std::string& name) {
  if (name == "chain") return PolicyKind::Chain;
  if (name == "s3fifo") return PolicyKind::S3Fifo;
  if (name == "lru") return PolicyKind::Lru;
  throw std::invalid_argument("unknown eviction policy '" + name + "'; choose chain, s3fifo or lru");
}

const char* policy_kind_name(PolicyKind kind) {
  switch (kind) {
    case PolicyKind::Chain: return "chain";
    case PolicyKind::S3Fifo: return "s3fifo";
    case PolicyKind::Lru: return "lru";
  }
  return "?";
}

void validate_eviction_config(const EvictionConfig& c) {
  if (!(c.small_queue_fraction >= 0.01 && c.small_queue_fraction <= 0.9))
    throw std::invalid_argument("small_queue_fraction must be in [0.01, 0.9]");
  if (!(c.ghost_factor >= 0 && c.ghost_factor <= 16)) throw std::invalid_argument("ghost_factor must be in [0, 16]");
  if (!(c.fresh_weight == 0 || (c.fresh_weight >= 1 && c.fresh_weight <= 64)))
    throw std::invalid_argument("fresh_weight must be 0 (tuned online) or in [1, 64]");
}

namespace {
std::unique_ptr<EvictionPolicy> make_recency_policy(const EvictionConfig& config, uint64_t memory_bytes) {
  switch (config.kind) {
    case PolicyKind::Chain: return std::make_unique<ChainPolicy>(memory_bytes, config);
    case PolicyKind::S3Fifo: return std::make_unique<S3Fifo>(memory_bytes, config.small_queue_fraction);
    case PolicyKind::Lru: return std::make_unique<LruPolicy>();
  }
  throw std::invalid_argument("unknown eviction policy");
}
}  // namespace

// Every policy is wrapped in the worth layer: values put with a "worth" are
// weighed by cost per byte; the rest keep the configured policy's order.
std::unique_ptr<EvictionPolicy> make_eviction_policy(const EvictionConfig& config, uint64_t memory_bytes) {
  validate_eviction_config(config);
  return std::make_unique<WorthPolicy>(make_recency_policy(config, memory_bytes));
}

// Equal to std::hash<std::string> of the same bytes (the standard requires it).
uint64_t key_hash_of(std::string_view key) { return std::hash<std::string_view>()(key); }

}  // namespace gcache
