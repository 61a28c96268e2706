#include "server/limits.h"

#include <chrono>
#include <iterator>

#include "common/assert.h"

namespace gcache {

bool ByteBudget::fits(const std::string& owner, uint64_t bytes) const {
  auto it = by_owner_.find(owner);
  const uint64_t held = it == by_owner_.end() ? 0 : it->second;
  const bool total_ok = used_ == 0 || (bytes <= total_ && used_ <= total_ - bytes);
  const bool owner_ok = held == 0 || (bytes <= owner_max_ && held <= owner_max_ - bytes);
  return total_ok && owner_ok;
}

bool ByteBudget::acquire(const std::string& owner, uint64_t bytes, int64_t deadline_us) {
  if (bytes == 0) return true;
  std::unique_lock<std::mutex> lock(mu_);
  while (!fits(owner, bytes)) {
    const int64_t now =
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count();
    if (deadline_us <= now) return false;
    cv_.wait_for(lock, std::chrono::microseconds(deadline_us - now));
  }
  used_ += bytes;
  by_owner_[owner] += bytes;
  return true;
}

void ByteBudget::release(const std::string& owner, uint64_t bytes) {
  if (bytes == 0) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    GCACHE_ASSERT(used_ >= bytes);  // only bytes acquired come back
    used_ -= bytes;
    auto it = by_owner_.find(owner);
    GCACHE_ASSERT(it != by_owner_.end() && it->second >= bytes);
    if (it != by_owner_.end() && (it->second -= bytes) == 0) by_owner_.erase(it);
  }
  cv_.notify_all();
}

uint64_t ByteBudget::used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_;
}

bool PeerCounts::try_add(const std::string& peer) {
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t& n = counts_[peer];
  if (max_ > 0 && n >= max_) {
    if (n == 0) counts_.erase(peer);
    return false;
  }
  ++n;
  return true;
}

void PeerCounts::remove(const std::string& peer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = counts_.find(peer);
  GCACHE_ASSERT(it != counts_.end() && it->second > 0);  // only peers added come back
  if (it != counts_.end() && --it->second == 0) counts_.erase(it);
}

bool PeerCounts::at_cap(const std::string& peer) const {
  if (max_ == 0) return false;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = counts_.find(peer);
  return it != counts_.end() && it->second >= max_;
}

void AddressMemory::note(const std::string& address, int64_t now_us) {
  if (last_us_.size() >= entries_max_ && last_us_.find(address) == last_us_.end()) {
    for (auto it = last_us_.begin(); it != last_us_.end();)
      it = now_us - it->second > window_us_ ? last_us_.erase(it) : std::next(it);
    if (last_us_.size() >= entries_max_) last_us_.clear();
  }
  last_us_[address] = now_us;
}

bool AddressMemory::recent(const std::string& address, int64_t now_us) const {
  auto it = last_us_.find(address);
  return it != last_us_.end() && now_us - it->second <= window_us_;
}

std::string PeerCounts::heaviest() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string best;
  uint32_t most = 0;
  for (const auto& [peer, n] : counts_) {
    if (n > most) {
      most = n;
      best = peer;
    }
  }
  return best;
}

}  // namespace gcache
