#include "server/auth.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace gcache {
namespace {

bool valid_name(std::string_view name) {
  if (name.empty() || name.size() > kTenantNameBytesMax) return false;
  for (char ch : name) {
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
                    ch == '_' || ch == '-' || ch == '.';
    if (!ok) return false;
  }
  return true;
}

}  // namespace

TenantTable::TenantTable(std::vector<std::unique_ptr<Tenant>> tenants) : tenants_(std::move(tenants)) {
  uint32_t index = 0;
  std::unordered_map<std::string, int> names;
  for (auto& t : tenants_) {
    if (!valid_name(t->name))
      throw std::invalid_argument("tenant name '" + t->name + "' must be 1.." +
                                  std::to_string(kTenantNameBytesMax) + " of [A-Za-z0-9_.-]");
    if (t->token.size() < kTokenBytesMin)
      throw std::invalid_argument("tenant '" + t->name + "': token must be at least " +
                                  std::to_string(kTokenBytesMin) + " bytes");
    if (t->roles == 0 || (t->roles & ~(kRoleRead | kRoleWrite | kRoleAdmin | kRoleCluster)))
      throw std::invalid_argument("tenant '" + t->name + "': roles must be a non-empty set of known roles");
    if (names[t->name]++ > 0) throw std::invalid_argument("tenant '" + t->name + "' is listed twice");
    t->index = ++index;
    t->key_prefix = (t->roles & kRoleCluster) ? std::string() : t->name + std::string(1, '\0');
    if (!by_id_.emplace(token_id(t->token), t.get()).second)
      throw std::invalid_argument("tenant '" + t->name + "' has the same token as another tenant");
  }
}

Tenant* TenantTable::by_name(std::string_view name) const {
  for (auto& t : tenants_)
    if (t->name == name) return t.get();
  return nullptr;
}

std::string TenantTable::token_id(std::string_view token) {
  Sha256 h;
  h.update(kTokenIdDomain);
  h.update(token);
  const Sha256Digest d = h.finish();
  return std::string(reinterpret_cast<const char*>(d.data()), kTokenIdBytes);
}

Sha256Digest TenantTable::mac(std::string_view token, const uint8_t* nonce) {
  std::string message(kAuthDomain);
  message.append(reinterpret_cast<const char*>(nonce), kAuthNonceBytes);
  return hmac_sha256(token, message);
}

const Tenant* TenantTable::verify(std::string_view id, const uint8_t* nonce, std::string_view mac_bytes) const {
  if (id.size() != kTokenIdBytes || mac_bytes.size() != kAuthMacBytes) return nullptr;
  auto it = by_id_.find(std::string(id));
  if (it == by_id_.end()) return nullptr;
  const Sha256Digest expected = mac(it->second->token, nonce);
  if (!constant_time_equal(expected.data(), reinterpret_cast<const uint8_t*>(mac_bytes.data()), kAuthMacBytes))
    return nullptr;
  return it->second;
}

void random_bytes(uint8_t* out, size_t n) {
  while (n > 0) {
    const ssize_t got = getrandom(out, n, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(std::string("getrandom failed: ") + std::strerror(errno));
    }
    out += got;
    n -= size_t(got);
  }
}

}  // namespace gcache
