#include "server/shm_session.h"

#include <algorithm>
#include <utility>

namespace gcache {

bool ShmSession::can_lease(size_t keys) const {
  return leases_.size() < kLeaseGroupsMax && leased_keys_ + keys <= kLeasedKeysMax;
}

uint64_t ShmSession::add_leases(std::vector<Lease>&& leases, int64_t deadline_us) {
  const uint64_t id = next_id_++;
  leased_keys_ += leases.size();
  leases_.emplace(id, LeaseGroup{std::move(leases), deadline_us});
  return id;
}

bool ShmSession::release_lease(Store* store, uint64_t id) {
  auto it = leases_.find(id);
  if (it == leases_.end()) return false;
  for (const Lease& l : it->second.leases) store->release(l);
  leased_keys_ -= it->second.leases.size();
  recycle_leases(std::move(it->second.leases));
  leases_.erase(it);
  return true;
}

namespace {
// v emptied, its capacity kept.
template <class V>
V cleared(V v) {
  v.clear();
  return v;
}
}  // namespace

std::vector<Lease> ShmSession::spare_leases() { return cleared(std::exchange(spare_leases_, {})); }

void ShmSession::recycle_leases(std::vector<Lease>&& leases) {
  if (leases.capacity() <= kSpareKeysMax && leases.capacity() > spare_leases_.capacity())
    spare_leases_ = std::move(leases);
}

ShmSession::ReserveGroup ShmSession::spare_reserve_group() {
  ReserveGroup spare = std::exchange(spare_group_, {});
  ReserveGroup group;  // everything but the vectors' capacity (and the keys' strings) starts anew
  group.keys = std::move(spare.keys);
  group.reservations = cleared(std::move(spare.reservations));
  group.statuses = cleared(std::move(spare.statuses));
  group.worth_kinds = cleared(std::move(spare.worth_kinds));
  group.worth_costs = cleared(std::move(spare.worth_costs));
  return group;
}

void ShmSession::recycle(ReserveGroup&& group) {
  // A larger batch's vectors and key strings are freed: what a connection keeps stays small.
  if (group.keys.size() <= kSpareKeysMax && group.reservations.capacity() >= spare_group_.reservations.capacity())
    spare_group_ = std::move(group);
}

size_t ShmSession::verify_reported(Store* store, uint64_t id, std::vector<uint64_t> offsets, const uint8_t* base) {
  auto it = leases_.find(id);
  if (it == leases_.end() || offsets.empty()) return 0;
  std::sort(offsets.begin(), offsets.end());
  size_t bad = 0;
  for (Lease& l : it->second.leases) {
    const uint64_t off = uint64_t(l.data - base);
    if (std::binary_search(offsets.begin(), offsets.end(), off) && !store->verify_leased(&l, true)) ++bad;
  }
  return bad;
}

uint64_t ShmSession::add_reservation(ReserveGroup&& group) {
  const uint64_t id = next_id_++;
  reserves_.emplace(id, std::move(group));
  return id;
}

bool ShmSession::take_reservation(uint64_t id, ReserveGroup* out) {
  auto it = reserves_.find(id);
  if (it == reserves_.end()) return false;
  *out = std::move(it->second);
  reserves_.erase(it);
  return true;
}

uint64_t ShmSession::abort(Store* store, const ReserveGroup& group) {
  for (const Reservation& r : group.reservations)
    if (r.data != nullptr) store->abort_put(r);
  return group.budget_bytes;
}

bool ShmSession::expire(Store* store, int64_t now_us) {
  // Oldest first (see next_deadline_us): stop at the first group still valid.
  while (!leases_.empty() && leases_.begin()->second.deadline_us <= now_us) {
    const LeaseGroup& group = leases_.begin()->second;
    for (const Lease& l : group.leases) store->release(l);
    leased_keys_ -= group.leases.size();
    leases_.erase(leases_.begin());
  }
  return !reserves_.empty() && reserves_.begin()->second.deadline_us <= now_us;
}

int64_t ShmSession::next_deadline_us() const {
  const int64_t lease = leases_.empty() ? 0 : leases_.begin()->second.deadline_us;
  const int64_t reserve = reserves_.empty() ? 0 : reserves_.begin()->second.deadline_us;
  if (lease == 0 || reserve == 0) return lease + reserve;
  return std::min(lease, reserve);
}

uint64_t ShmSession::release_all(Store* store) {
  for (const auto& [id, group] : leases_)
    for (const Lease& l : group.leases) store->release(l);
  leases_.clear();
  leased_keys_ = 0;
  uint64_t budget = 0;
  for (const auto& [id, group] : reserves_) budget += abort(store, group);
  reserves_.clear();
  return budget;
}

}  // namespace gcache
