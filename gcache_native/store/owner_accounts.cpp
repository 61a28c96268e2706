#include "store/owner_accounts.h"

#include <stdexcept>

namespace gcache {

OwnerAccounts::OwnerAccounts(const std::vector<OwnerQuota>& quotas, PolicyKind policy) {
  for (const OwnerQuota& q : quotas) {
    if (q.memory_bytes > 0 && policy == PolicyKind::S3Fifo)
      throw std::invalid_argument("owner '" + q.name +
                                  "' has a memory quota, which the s3fifo eviction policy "
                                  "cannot enforce (it cannot evict one owner's values); use chain or lru");
    accounts_[q.owner].quota = q;
    by_name_[q.name] = q.owner;
  }
}

OwnerId OwnerAccounts::owner_of_key(std::string_view key) const {
  size_t nul = key.find('\0');
  if (nul == std::string_view::npos) return 0;
  auto it = by_name_.find(std::string(key.substr(0, nul)));
  return it == by_name_.end() ? 0 : it->second;
}

bool OwnerAccounts::disk_allowed(OwnerId owner, uint64_t length) {
  OwnerAccount* a = find(owner);
  if (!a) return true;
  bool ok = !a->quota.disk_off && (a->quota.disk_bytes == 0 || a->disk + length <= a->quota.disk_bytes);
  if (!ok) ++a->disk_refusals;
  return ok;
}

std::vector<OwnerUsage> OwnerAccounts::usage() const {
  std::vector<OwnerUsage> out;
  for (const auto& [owner, a] : accounts_) {
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

}  // namespace gcache
