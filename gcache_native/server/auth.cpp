#include "server/auth.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

#include "common/msgpack_lite.h"
#include "server/connection.h"
#include "server/server.h"

namespace gcache {
namespace {

bool valid_name(std::string_view name) {
  if (name.empty() || name.size() > kTenantNameBytesMax) return false;
  for (char ch : name) {
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
                    ch == '-' || ch == '.';
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
      throw std::invalid_argument("tenant name '" + t->name + "' must be 1.." + std::to_string(kTenantNameBytesMax) +
                                  " of [A-Za-z0-9_.-]");
    if (t->token.size() < kTokenBytesMin)
      throw std::invalid_argument("tenant '" + t->name + "': token must be at least " + std::to_string(kTokenBytesMin) +
                                  " bytes");
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

// The AUTH opcode, on the data server's connection thread (Server::dispatch).
// AUTH {} answers a fresh nonce; AUTH {"id", "mac"} checks the answer to it.
// A node without --auth-file answers {"auth": false} to both.
bool Server::handle_auth(Connection* c, const FrameHeader& h) {
  // The budgeted, grow-as-bytes-arrive path of every frame (check_frame
  // already refused an AUTH claiming more than kAuthMetaBytesMax).
  read_meta(c, h);
  if (h.payload_len > 0) {
    discard(c, h.payload_len);
    send_error(c, metrics_, h.opcode, h.request_id, FrameStatus::BadFrame,
               "AUTH carries no payload; send payload_len=0");
    return true;
  }
  std::string_view id, mac;
  bool has_id = false, has_mac = false;
  MsgpackReader r(c->meta.data(), c->meta.size());
  uint32_t entries = 0;
  bool ok = c->meta.empty() || r.read_map(&entries);
  for (uint32_t i = 0; ok && i < entries; ++i) {
    std::string_view name;
    ok = r.read_bytes(&name);
    if (!ok) break;
    if (name == "id") ok = has_id = r.read_bytes(&id);
    else if (name == "mac") ok = has_mac = r.read_bytes(&mac);
    else ok = r.skip();
  }
  if (!ok || !r.at_end() || has_id != has_mac) {
    send_error(c, metrics_, h.opcode, h.request_id, FrameStatus::BadFrame,
               "AUTH metadata must be {} (ask for a nonce) or {\"id\": bin, \"mac\": bin} "
               "(docs/protocol.md, \"Authentication\")");
    return true;
  }
  MsgpackWriter& out = c->out;
  out.clear();
  if (!auth_on()) {
    out.map(1);
    out.str("auth");
    out.boolean(false);
    send_response(c, h.opcode, h.request_id, FrameStatus::Ok);
    return true;
  }
  if (c->tenant != nullptr) {
    send_error(c, metrics_, h.opcode, h.request_id, FrameStatus::BadFrame,
               "this connection is already authenticated as tenant '" + c->tenant->name +
                   "'; open a new connection to use another token");
    return true;
  }
  if (!has_id) {
    random_bytes(c->nonce, kAuthNonceBytes);
    c->nonce_issued = true;
    out.map(2);
    out.str("auth");
    out.boolean(true);
    out.str("nonce");
    out.bin(std::string_view(reinterpret_cast<const char*>(c->nonce), kAuthNonceBytes));
    send_response(c, h.opcode, h.request_id, FrameStatus::Ok);
    return true;
  }
  const Tenant* t = c->nonce_issued ? config_.tenants->verify(id, c->nonce, mac) : nullptr;
  c->nonce_issued = false;  // one answer per nonce
  if (t == nullptr) {
    metrics_->auth_failures++;
    metrics_->errors_unauthenticated++;
    send_error(c, metrics_, h.opcode, h.request_id, FrameStatus::Unauthenticated,
               "authentication failed: this node's --auth-file has no tenant with that token "
               "(check GCACHE_TOKEN or the client's token=); the connection is closed");
    return false;
  }
  {  // from the pre-auth budget to a slot: the authenticated caps apply from here
    std::string refusal;
    std::unique_lock<std::mutex> lock(conns_mu_);
    if (!promote_locked(c, &refusal)) {
      lock.unlock();
      if (refusal.empty()) return false;  // dropped to make room while it authenticated
      send_error(c, metrics_, h.opcode, h.request_id, FrameStatus::Busy, refusal);
      return false;
    }
  }
  const uint32_t tenant_max = config_.connections_per_tenant_max;
  if (t->connections.fetch_add(1) >= tenant_max && tenant_max > 0) {
    t->connections--;
    metrics_->connections_refused_tenant++;
    send_error(c, metrics_, h.opcode, h.request_id, FrameStatus::Busy,
               "tenant '" + t->name + "' already has " + std::to_string(tenant_max) +
                   " connections (--connections-per-tenant-max); reuse pooled connections");
    return false;
  }
  c->tenant = t;
  c->owner = "t:" + t->name;
  c->last_work_us = now_us();
  metrics_->auth_successes++;
  out.map(2);
  out.str("tenant");
  out.str(t->name);
  out.str("roles");
  uint32_t n = 0;
  for (uint8_t bit : {kRoleRead, kRoleWrite, kRoleAdmin, kRoleCluster}) n += (t->roles & bit) ? 1 : 0;
  out.array(n);
  if (t->roles & kRoleRead) out.str("read");
  if (t->roles & kRoleWrite) out.str("write");
  if (t->roles & kRoleAdmin) out.str("admin");
  if (t->roles & kRoleCluster) out.str("cluster");
  send_response(c, h.opcode, h.request_id, FrameStatus::Ok);
  return true;
}

}  // namespace gcache
