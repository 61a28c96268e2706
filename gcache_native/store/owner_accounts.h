// Per-owner usage and quotas of the Store (docs/security.md, "Quotas"): one
// account per owner named in StoreConfig::owner_quotas, fixed at open (so
// pointers to an account stay valid). Value bytes, not blocks: what a quota
// names. Not thread-safe: the Store's lock guards it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "eviction/config.h"
#include "store/store.h"

namespace gcache {

struct OwnerAccount {
  OwnerQuota quota;
  uint64_t memory = 0, reserved = 0, disk = 0;  // value bytes in memory, reserved by puts, on disk
  uint64_t quota_evictions = 0, disk_refusals = 0, puts_over_quota = 0;
};

class OwnerAccounts {
 public:
  // Throws std::invalid_argument for a memory quota under a policy that
  // cannot evict one owner's values (s3fifo).
  OwnerAccounts(const std::vector<OwnerQuota>& quotas, PolicyKind policy);

  // The owner's account, or null when it has no quota (then nothing is counted).
  OwnerAccount* find(OwnerId owner) {
    if (accounts_.empty()) return nullptr;
    auto it = accounts_.find(owner);
    return it == accounts_.end() ? nullptr : &it->second;
  }
  // The owner named by a stored key's tenant prefix (name + NUL), or 0: a
  // restart gives disk values back to their owner.
  OwnerId owner_of_key(std::string_view key) const;
  // May a value of `length` bytes of `owner` be written to disk? Not if the
  // owner's disk is off or its disk quota would be exceeded (counted as a
  // refusal: the value is dropped where it would have been demoted).
  bool disk_allowed(OwnerId owner, uint64_t length);

  std::vector<OwnerUsage> usage() const;
  const std::unordered_map<OwnerId, OwnerAccount>& all() const { return accounts_; }

 private:
  std::unordered_map<OwnerId, OwnerAccount> accounts_;
  std::unordered_map<std::string, OwnerId> by_name_;
};

}  // namespace gcache
