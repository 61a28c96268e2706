// Tenants of an authenticated node (--auth-file): who may connect, with which
// roles, and the key prefix that keeps each tenant's keys apart.
//
// Handshake (docs/protocol.md, "Authentication"): the client sends AUTH {} and
// gets a fresh random nonce; it answers AUTH {"id": token_id(token), "mac":
// HMAC-SHA256(token, kAuthDomain + nonce)}. The token never crosses the wire,
// and a recorded answer is worthless for the next connection (new nonce).
// The data server's side of it, Server::handle_auth, is in auth.cpp too.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/sha256.h"

namespace gcache {

enum TenantRole : uint8_t {
  kRoleRead = 1,     // GET, EXISTS
  kRoleWrite = 2,    // PUT, REMOVE
  kRoleAdmin = 4,    // admin HTTP/gRPC state changes (flush, drain); nothing extra here
  kRoleCluster = 8,  // node <-> node: read and write raw (already prefixed) keys of every tenant
};

constexpr size_t kAuthNonceBytes = 32;
constexpr size_t kAuthMacBytes = 32;
constexpr size_t kTokenIdBytes = 16;
constexpr size_t kTenantNameBytesMax = 32;
constexpr size_t kTokenBytesMin = 16;
constexpr std::string_view kAuthDomain{"gcache-auth-v1\0", 15};
constexpr std::string_view kTokenIdDomain{"gcache-token-id\0", 16};

struct Tenant {
  std::string name;
  std::string token;
  uint8_t roles = 0;
  uint64_t memory_quota = 0;  // bytes in the memory tier; 0 = no quota
  uint64_t disk_quota = 0;    // bytes on disk; 0 = no quota (disk_off: none at all)
  bool disk_off = false;      // quota "0": this tenant's values never go to disk
  std::string key_prefix;     // name + '\0', prepended to every key; empty for the cluster role
  uint32_t index = 0;         // position in the table (1-based; 0 = no tenant)
  // Live counts, kept by the server.
  mutable std::atomic<uint32_t> connections{0};
};

class TenantTable {
 public:
  // Throws std::invalid_argument naming the bad tenant (name, token length,
  // duplicate token, unknown role bits).
  explicit TenantTable(std::vector<std::unique_ptr<Tenant>> tenants);

  // The tenant whose token produced `mac` over `nonce`, or null.
  const Tenant* verify(std::string_view token_id, const uint8_t* nonce, std::string_view mac) const;
  Tenant* by_name(std::string_view name) const;
  const std::vector<std::unique_ptr<Tenant>>& all() const { return tenants_; }

  static std::string token_id(std::string_view token);
  static Sha256Digest mac(std::string_view token, const uint8_t* nonce);

 private:
  std::vector<std::unique_ptr<Tenant>> tenants_;
  std::unordered_map<std::string, Tenant*> by_id_;
};

// Cryptographically random bytes (getrandom); throws std::runtime_error if
// the kernel cannot supply them.
void random_bytes(uint8_t* out, size_t n);

}  // namespace gcache
