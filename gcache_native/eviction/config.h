// Settings and hints of the memory tier's eviction policy, without the policy
// itself (eviction/policy.h), so the Store's public header can name them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/owner.h"

namespace gcache {

enum class PolicyKind : uint8_t { Chain = 0, S3Fifo = 1, Lru = 2 };

// Parses "chain" / "s3fifo" / "lru"; throws std::invalid_argument naming the choices.
PolicyKind policy_kind_from_name(const std::string& name);
const char* policy_kind_name(PolicyKind kind);

struct EvictionConfig {
  PolicyKind kind = PolicyKind::Chain;
  double small_queue_fraction = 0.10;  // s3fifo: the small FIFO's share of the memory tier
  double ghost_factor = 2.0;           // chain: keys remembered after eviction, per value in memory
  double fresh_weight = 0.0;           // chain: age weight of never-reused values; 0 = tuned online
  bool chain_tail_hint = true;         // chain: the last value of a put batch is evicted first
};

// Throws std::invalid_argument with a readable message for out-of-range values.
void validate_eviction_config(const EvictionConfig& config);

// What a value is, as its client says in a PUT's "worth" field (docs/protocol.md,
// "Value worth"). The numbers are the contract: never renumber.
enum class ValueKind : uint8_t { Other = 0, AttentionPage = 1, StateCheckpoint = 2 };
constexpr uint64_t kValueKindMax = 2;
constexpr uint64_t kWorthVersion = 1;  // the "worth" field's "v" this node speaks

// What the Store knows about a value it inserts: the values of one put batch
// form one prefix chain, in order (docs/protocol.md, PUT_BATCH).
struct PutHint {
  uint64_t batch = 0;       // put batch id from Store::new_put_batch(); 0 = not part of a batch
  bool chain_tail = false;  // the batch's last value, in a batch of two or more
  OwnerId owner = 0;        // who the value belongs to (tenants); 0 = the default owner
  // From "worth": what recomputing the value would cost (prefill tokens it
  // spares); 0 = not said, the value is ordered by the policy alone.
  uint64_t worth_cost = 0;
  ValueKind kind = ValueKind::Other;
};

uint64_t key_hash_of(std::string_view key);

}  // namespace gcache
