// Connection slots: who gets in when the caps are full (docs/protocol.md,
// "Limits"). Everything here runs under conns_mu_, on the accept thread or on
// a connection's thread at AUTH.
//
// Auth on: a new connection takes a place in the pre-auth budget, never a
// slot. When its address's share is full, that address's oldest
// unauthenticated connection goes (one that has sent nothing before one in
// the middle of its AUTH). When the whole budget is full, the victim is chosen
// by what an attacker cannot steer (preauth_room_victim_locked): never by how
// many connections an address holds, which an attacker with many addresses
// controls. A new client is never refused for unauthenticated ones, and an
// authenticated connection is never closed: at AUTH it moves to a slot, or is
// answered BUSY when the authenticated ones fill the caps.
//
// Auth off: when a cap is full, the longest-idle connection with nothing in
// flight (of this address for its cap; of the address holding the most for
// the global one) is closed to make room; BUSY only when every connection is
// busy.
#include <sys/socket.h>

#include <tuple>

#include "server/connection.h"
#include "server/io.h"
#include "server/server.h"

namespace gcache {

bool Server::admit_locked(Connection* c, std::string* refusal) {
  if (!auth_on()) return take_slot_locked(c, true, refusal);
  const int64_t now = now_us();
  c->reconnect = preauth_losses_.recent(c->peer, now);
  c->vouched = authentications_.recent(c->peer, now);
  if (preauth_peers_.at_cap(c->peer)) {
    Connection* victim = preauth_victim_locked(c->peer);
    GCACHE_ASSERT(victim != nullptr);  // the address holds places, so one of its connections does
    if (victim != nullptr) close_for_room_locked(victim);
  }
  if (preauth_used_ >= config_.preauth_connections_max) {
    Connection* victim = preauth_room_victim_locked(c);
    GCACHE_ASSERT(victim != nullptr);
    if (victim != nullptr) close_for_room_locked(victim);
  }
  const bool added = preauth_peers_.try_add(c->peer);
  GCACHE_ASSERT(added && preauth_used_ < config_.preauth_connections_max);
  if (!added) {  // unreachable: room was made above
    *refusal = "no room for unauthenticated connections; retry";
    return false;
  }
  c->preauth = true;
  ++preauth_used_;
  return true;
}

bool Server::promote_locked(Connection* c, std::string* refusal) {
  refusal->clear();
  authentications_.note(c->peer, now_us());  // it proved a token: its address's next connections go last
  if (c->evicted) return false;
  GCACHE_ASSERT(c->preauth && !c->holds_slot);
  release_slots_locked(c);
  return take_slot_locked(c, false, refusal);
}

bool Server::take_slot_locked(Connection* c, bool may_close_idle, std::string* refusal) {
  for (int attempt = 0; attempt < 3 && peers_.at_cap(c->peer); ++attempt) {
    Connection* victim = may_close_idle ? idle_victim_locked(&c->peer) : nullptr;
    if (victim == nullptr) break;
    close_for_room_locked(victim);
  }
  if (peers_.at_cap(c->peer)) {
    metrics_->connections_refused_address++;
    *refusal = "address " + c->peer + " already has " + std::to_string(config_.connections_per_address_max) +
               (auth_on() ? " authenticated" : " busy") +
               " connections (--connections-per-address-max); reuse pooled connections";
    return false;
  }
  for (int attempt = 0; attempt < 3 && slots_used_ >= config_.connections_max; ++attempt) {
    Connection* victim = may_close_idle ? idle_victim_locked(nullptr) : nullptr;
    if (victim == nullptr) break;
    close_for_room_locked(victim);
  }
  if (slots_used_ >= config_.connections_max) {
    *refusal = "server has " + std::to_string(config_.connections_max) + (auth_on() ? " authenticated" : " busy") +
               " connections (connections_max); retry later, reuse pooled connections, or raise --connections-max";
    return false;
  }
  const bool added = peers_.try_add(c->peer);
  GCACHE_ASSERT(added);  // at_cap said there was room, under the same lock
  if (!added) return false;
  c->holds_slot = true;
  ++slots_used_;
  return true;
}

// The longest-idle connection holding a slot and nothing in flight: of `peer`,
// or (peer null) of the address holding the most slots, else of any address.
Server::Connection* Server::idle_victim_locked(const std::string* peer) {
  const std::string heaviest = peer == nullptr ? peers_.heaviest() : std::string();
  Connection* best = nullptr;
  Connection* best_heaviest = nullptr;
  for (auto& owned : conns_) {
    Connection* c = owned.get();
    if (!c->holds_slot || c->evicted || c->activity.load() != Activity::Idle) continue;
    if (peer != nullptr && c->peer != *peer) continue;
    if (best == nullptr || c->last_work_us.load() < best->last_work_us.load()) best = c;
    if (peer == nullptr && c->peer == heaviest &&
        (best_heaviest == nullptr || c->last_work_us.load() < best_heaviest->last_work_us.load()))
      best_heaviest = c;
  }
  return best_heaviest != nullptr ? best_heaviest : best;
}

// The oldest unauthenticated connection of `peer` that has sent nothing yet,
// else its oldest (conns_ is in accept order): a client in the middle of its
// AUTH outlives sockets that only hold a place.
Server::Connection* Server::preauth_victim_locked(const std::string& peer) {
  Connection* oldest = nullptr;
  for (auto& owned : conns_) {
    Connection* c = owned.get();
    if (!c->preauth || c->evicted || c->peer != peer) continue;
    if (!c->spoke.load(std::memory_order_relaxed)) return c;
    if (oldest == nullptr) oldest = c;
  }
  return oldest;
}

namespace {

// The peer closed its end (EOF is all that waits): a connection it gave up
// itself, such as a health check's probe, is no loss for its address.
bool peer_left(int fd) {
  char byte;
  return fd >= 0 && recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

}  // namespace

// Who makes room when the whole pre-auth budget is full, by what an attacker
// cannot steer. Preferred, in order: a connection of another address than
// the newcomer's (a client opening several at once never pushes out its own);
// of an address that has not authenticated lately; when the newcomer is a
// reconnect (its address lost an unauthenticated connection lately), another
// reconnect (a storm of sockets opened again as soon as they are dropped
// churns its own, over however many addresses it reuses); then the oldest
// (conns_ is in accept order): a client is pushed out only after every older
// connection of its rank, so the longer it takes to authenticate, the more
// connections must arrive meanwhile.
Server::Connection* Server::preauth_room_victim_locked(const Connection* newcomer) {
  auto rank = [newcomer](const Connection* c) {
    return std::make_tuple(c->peer != newcomer->peer, !c->vouched, newcomer->reconnect && c->reconnect);
  };
  Connection* best = nullptr;
  for (auto& owned : conns_) {
    Connection* c = owned.get();
    if (!c->preauth || c->evicted) continue;
    if (best == nullptr || rank(c) > rank(best)) best = c;  // strictly: the oldest of a rank wins
  }
  return best;
}

bool Server::close_for_room_locked(Connection* victim) {
  if (victim->preauth) {
    if (!peer_left(victim->fd)) preauth_losses_.note(victim->peer, now_us());
    victim->activity.store(Activity::Evicted);
    metrics_->preauth_dropped++;
  } else {
    Activity idle = Activity::Idle;
    if (!victim->activity.compare_exchange_strong(idle, Activity::Evicted)) return false;  // a frame began
    metrics_->connections_closed_for_room++;
  }
  victim->evicted = true;
  release_slots_locked(victim);
  // Its thread sees EOF (or Evicted) at its next step and ends; the fd stays
  // open until then (end_connection closes it under conns_mu_).
  if (victim->fd >= 0) shutdown(victim->fd, SHUT_RDWR);
  return true;
}

void Server::release_slots_locked(Connection* c) {
  if (c->holds_slot) {
    GCACHE_ASSERT(slots_used_ > 0);
    --slots_used_;
    peers_.remove(c->peer);
    c->holds_slot = false;
  }
  if (c->preauth) {
    GCACHE_ASSERT(preauth_used_ > 0);
    --preauth_used_;
    preauth_peers_.remove(c->peer);
    c->preauth = false;
  }
}

}  // namespace gcache
