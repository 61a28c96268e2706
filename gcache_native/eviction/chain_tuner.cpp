#include "eviction/chain_tuner.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace gcache {

namespace {
constexpr uint64_t kPage = 4096;

uint64_t pages_of(uint64_t bytes) { return std::max<uint64_t>(1, bytes / kPage); }

// Independent of the bits std::hash puts in the low end (ghosts, buckets).
uint32_t sampling_hash(uint64_t key_hash) { return uint32_t((key_hash * 0x9E3779B97F4A7C15ull) >> 40); }
}  // namespace

ChainTuner::ChainTuner(uint64_t memory_bytes, double ghost_factor, bool tail_hint, std::vector<double> weights,
                       double initial_weight)
    : ghost_factor_(ghost_factor), tail_hint_(tail_hint), weight_(initial_weight) {
  if (weights.empty()) throw std::invalid_argument("chain tuner: no candidate weights");
  double rate = std::clamp(double(kShadowBytesTarget) / double(std::max<uint64_t>(memory_bytes, 1)), kRateMin, 1.0);
  threshold_ = uint32_t(std::min(rate * double(1u << 24), double(1u << 24)));
  capacity_bytes_ = std::max<uint64_t>(kPage, uint64_t(double(memory_bytes) * rate));
  ghosts_min_ = std::max<size_t>(1, size_t(double(kGhostsMin) * rate));  // the live policy's floor, scaled
  shadows_.reserve(weights.size() + 1);  // never reallocated: shadows hold pointers into themselves
  for (double w : weights) {
    shadows_.emplace_back();
    shadows_.back().weight = w;
  }
  shadows_.emplace_back();  // plain LRU
  shadows_.back().lru = true;
}

bool ChainTuner::sampled(uint64_t key_hash) const { return sampling_hash(key_hash) < threshold_; }

size_t ChainTuner::shadow_values() const {
  size_t n = 0;
  for (const Shadow& s : shadows_) n += s.nodes.size();
  return n;
}

void ChainTuner::on_put(uint64_t key_hash, uint64_t bytes, const PutHint& hint) {
  if (!sampled(key_hash)) return;
  // Each shadow value costs at least kShadowValueBytesMin: empty and tiny
  // values (no or a small block) would otherwise let the shadows, and so the
  // heap, grow without bound. Tuning for tiny values is coarser; KV pages are large.
  bytes = std::max<uint64_t>(bytes, kShadowValueBytesMin);
  for (Shadow& s : shadows_) insert(s, key_hash, bytes, hint);
  epoch_pages_ += pages_of(bytes);
  if (epoch_pages_ * kDecisionsPerEpoch >= capacity_bytes_ / kPage) end_epoch();
}

void ChainTuner::insert(Shadow& s, uint64_t key_hash, uint64_t bytes, const PutHint& hint) {
  auto [slot, added] = s.nodes.try_emplace(key_hash);  // one lookup
  if (!added) return;                                  // present here: the put is EXISTS
  Node& n = slot->second;
  n.key_hash = key_hash;
  n.mem_block = bytes;
  bool same_batch = hint.batch != 0 && hint.batch == s.batch;
  if (!same_batch) {
    s.batch = hint.batch;
    s.batch_when = s.tick;
    s.batch_last = nullptr;
  }
  if (s.lru) {
    s.queues.put_used(&n, s.tick);  // LRU: each put to the hot end, in key order
  } else if (s.ghosts.take(key_hash)) {
    s.queues.put_used(&n, s.batch_when);
  } else {
    s.queues.put_fresh(&n, s.batch_when, s.batch_last, tail_hint_ && hint.chain_tail);
  }
  s.batch_last = &n;
  s.bytes += bytes;
  s.tick += pages_of(bytes);
  while (s.bytes > capacity_bytes_ && !s.queues.empty()) evict_one(s);
}

void ChainTuner::evict_one(Shadow& s) {
  double age;
  Node* victim = s.queues.coldest(s.weight, s.tick, &age);
  s.queues.unlink(victim);
  s.bytes -= victim->mem_block;
  uint64_t key_hash = victim->key_hash;
  if (s.batch_last == victim) s.batch_last = nullptr;
  s.nodes.erase(key_hash);
  if (!s.lru) s.ghosts.remember(key_hash, std::max(ghosts_min_, size_t(ghost_factor_ * double(s.nodes.size()))));
}

void ChainTuner::on_read(uint64_t key_hash) {
  if (!sampled(key_hash)) return;
  for (Shadow& s : shadows_) {
    auto it = s.nodes.find(key_hash);
    if (it == s.nodes.end()) continue;
    const bool probed = it->second.last_use == s.tick;  // probed just now: one use, one point
    if (!probed) s.score += 1;
    if (!probed || s.lru) s.queues.use(&it->second, s.tick);  // LRU: every read is a use
  }
}

void ChainTuner::on_exists(const uint64_t* key_hashes, size_t n) {
  std::vector<uint64_t> picked;
  for (size_t i = 0; i < n; ++i)
    if (sampled(key_hashes[i])) picked.push_back(key_hashes[i]);
  if (picked.empty()) return;
  for (Shadow& s : shadows_) {
    size_t prefix = 0;
    while (prefix < picked.size() && s.nodes.count(picked[prefix])) ++prefix;
    s.score += double(prefix);  // what a client could read: the sampled keys' prefix
    if (s.lru) {                // as LruPolicy: every present key, in key order
      for (uint64_t h : picked)
        if (auto it = s.nodes.find(h); it != s.nodes.end()) s.queues.use(&it->second, s.tick);
      continue;
    }
    for (size_t i = picked.size(); i-- > 0;) {  // as the live policy: deepest first, all present
      auto it = s.nodes.find(picked[i]);
      if (it != s.nodes.end() && it->second.last_use != s.tick) s.queues.use(&it->second, s.tick);
    }
  }
}

void ChainTuner::end_epoch() {
  epoch_pages_ = 0;
  ++epochs_;
  const Shadow* best = nullptr;
  const Shadow* current = nullptr;
  for (const Shadow& s : shadows_) {
    if (!best || s.score > best->score) best = &s;
    if (s.lru == lru_ && (lru_ || s.weight == weight_)) current = &s;
  }
  // A clear winner only: near-ties (sampling noise) keep the candidate in use. LRU,
  // the baseline the policy must never fall below, wins by any margin.
  const double margin = best->lru ? 0.0 : kSwitchMargin;
  if (best->score > 0 && best != current && (!current || best->score > current->score * (1 + margin))) {
    lru_ = best->lru;
    if (!best->lru) weight_ = best->weight;
  }
  static const double decay = std::pow(kScoreDecay, 1.0 / kDecisionsPerEpoch);
  for (Shadow& s : shadows_) s.score *= decay;
}

void ChainTuner::check() const {
  for (const Shadow& s : shadows_) {
    s.queues.check("chain tuner");
    if (s.queues.size() != s.nodes.size()) throw std::logic_error("chain tuner: queued and indexed nodes differ");
    uint64_t bytes = 0;
    for (auto& [hash, node] : s.nodes) {
      if (node.key_hash != hash || node.queue == QueueId::None) throw std::logic_error("chain tuner: bad node");
      bytes += node.mem_block;
    }
    if (bytes != s.bytes || s.bytes > capacity_bytes_) throw std::logic_error("chain tuner: shadow bytes drifted");
    s.ghosts.check();
  }
}

}  // namespace gcache
