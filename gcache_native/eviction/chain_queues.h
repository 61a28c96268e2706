// The two recency lists of the chain policy, over one owner's values in memory
// (or over one shadow cache of the tuner, eviction/chain_tuner.h):
//   fresh  values not used since they were put (QueueId::Small)
//   used   values read or probed since (QueueId::Main)
// Front = coldest. The victim is the colder of the two heads, where a fresh
// value's age counts `fresh_weight` times: weight 1 is plain LRU over both
// lists, a larger weight evicts values nobody came back for sooner.
//
// Chain order: the values of one put batch are one prefix chain, and a chain
// is worthless past its first missing value, so its values sit head-hottest:
// each one goes just colder than the one before it, and the batch's last value
// (usually a partial block the next turn will not share) goes to the very
// front, last_use 0, so it is the next victim. Uses of a chain are applied
// deepest first for the same reason.
//
// Node: QueueId queue; std::list<Node*>::iterator queue_pos; uint64_t last_use;
// uint64_t mem_block. Every call is O(1).
#pragma once

#include <algorithm>
#include <cstdint>
#include <list>
#include <stdexcept>
#include <string>

#include "core/entry.h"

namespace gcache {

template <class Node>
class ChainQueues {
 public:
  using List = std::list<Node*>;

  // A new value, used at `when`. `batch_prev`: the value put just before it in
  // the same batch, if still fresh here; `tail`: the batch's last value.
  void put_fresh(Node* n, uint64_t when, Node* batch_prev, bool tail) {
    n->last_use = tail ? 0 : when;
    if (tail) {
      push(n, QueueId::Small, fresh_.begin());
    } else if (batch_prev && batch_prev->queue == QueueId::Small && batch_prev->last_use == when) {
      push(n, QueueId::Small, batch_prev->queue_pos);  // just colder than its predecessor
    } else {
      push(n, QueueId::Small, fresh_.end());
    }
  }
  void put_used(Node* n, uint64_t when) {
    n->last_use = when;
    push(n, QueueId::Main, used_.end());
  }
  // At the front of `queue`, keeping n->last_use.
  void put_cold(Node* n, QueueId queue) {
    push(n, queue == QueueId::Main ? QueueId::Main : QueueId::Small,
         queue == QueueId::Main ? used_.begin() : fresh_.begin());
  }
  // To the back of the used list (a splice: no allocation on the read path).
  void use(Node* n, uint64_t when) {
    if (n->queue == QueueId::None) throw std::logic_error("chain queues: use of an unqueued node");
    if (n->queue == QueueId::Small) {
      fresh_bytes_ -= n->mem_block;
      used_bytes_ += n->mem_block;
      used_.splice(used_.end(), fresh_, n->queue_pos);
      n->queue = QueueId::Main;
    } else {
      used_.splice(used_.end(), used_, n->queue_pos);
    }
    n->last_use = when;
  }
  // To the back of its own list, last_use kept (a leased head, looked at later).
  void requeue(Node* n) {
    List& list = n->queue == QueueId::Main ? used_ : fresh_;
    list.splice(list.end(), list, n->queue_pos);
  }
  void unlink(Node* n) {
    if (n->queue == QueueId::None) return;
    if (n->queue == QueueId::Small) {
      fresh_.erase(n->queue_pos);
      fresh_bytes_ -= n->mem_block;
    } else {
      used_.erase(n->queue_pos);
      used_bytes_ -= n->mem_block;
    }
    n->queue = QueueId::None;
  }

  // The colder head and its weighted age, or nullptr when both lists are empty.
  Node* coldest(double fresh_weight, uint64_t now, double* weighted_age) const {
    Node* best = nullptr;
    double best_age = -1;
    if (!fresh_.empty()) {
      best = fresh_.front();
      best_age = fresh_weight * double(now - std::min(now, best->last_use) + 1);
    }
    if (!used_.empty()) {
      double age = double(now - std::min(now, used_.front()->last_use) + 1);
      if (age > best_age) {
        best = used_.front();
        best_age = age;
      }
    }
    *weighted_age = best_age;
    return best;
  }

  const List& fresh() const { return fresh_; }
  const List& used() const { return used_; }
  uint64_t fresh_bytes() const { return fresh_bytes_; }
  uint64_t used_bytes() const { return used_bytes_; }
  size_t size() const { return fresh_.size() + used_.size(); }
  bool empty() const { return fresh_.empty() && used_.empty(); }

  // Throws std::logic_error unless every node sits in the list its queue names
  // and the byte counts add up. O(values).
  void check(const char* who) const {
    auto walk = [who](const List& list, QueueId queue, uint64_t want) {
      uint64_t bytes = 0;
      for (auto it = list.begin(); it != list.end(); ++it) {
        if ((*it)->queue != queue || (*it)->queue_pos != it)
          throw std::logic_error(std::string(who) + ": node out of its queue");
        bytes += (*it)->mem_block;
      }
      if (bytes != want) throw std::logic_error(std::string(who) + ": queue byte count drifted");
    };
    walk(fresh_, QueueId::Small, fresh_bytes_);
    walk(used_, QueueId::Main, used_bytes_);
  }

 private:
  void push(Node* n, QueueId queue, typename List::iterator before) {
    if (n->queue != QueueId::None) throw std::logic_error("chain queues: node already queued");
    List& list = queue == QueueId::Small ? fresh_ : used_;
    (queue == QueueId::Small ? fresh_bytes_ : used_bytes_) += n->mem_block;
    n->queue = queue;
    n->queue_pos = list.insert(before, n);
  }

  List fresh_, used_;
  uint64_t fresh_bytes_ = 0, used_bytes_ = 0;
};

}  // namespace gcache
