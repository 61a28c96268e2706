#include "eviction/worth.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace gcache {

namespace {
constexpr double kMeanGain = 1.0 / 64;  // the running mean follows the last ~64 worth values
constexpr size_t kOwnerScanMax = 64;    // values looked at per class for one owner's victim
// A weight doubles per 4 doublings of cost per byte and stays within [1/4, 4]:
// on the hybrid traces a steeper or wider weight loses to recency (a shallow,
// cheap state is the one reused most; docs/hybrid-models.md).
constexpr double kClassesPerDoubling = 4;
constexpr double kLog2WeightMax = 2;

uint64_t pages_of(uint64_t bytes) { return std::max<uint64_t>(1, bytes / 4096); }
}  // namespace

uint8_t WorthPolicy::class_of(uint64_t cost, uint64_t bytes) {
  const double per_kib = std::log2(double(cost)) - std::log2(double(std::max<uint64_t>(1, bytes)) / 1024);
  return uint8_t(std::clamp(std::lround(per_kib) + kMiddle, 1L, long(kClasses)));
}

double WorthPolicy::score(const Entry* e) const {
  const double age = double(tick_ - std::min(tick_, e->touched) + 1);
  if (e->worth_class == 0) return age;
  const double exponent =
      std::clamp((double(e->worth_class) - mean_class_) / kClassesPerDoubling, -kLog2WeightMax, kLog2WeightMax);
  return age * std::exp2(-exponent);
}

void WorthPolicy::insert(Entry* e, const PutHint& hint) {
  tick_ += pages_of(e->mem_block);
  e->touched = tick_;
  if (hint.worth_cost > 0) {
    e->worth_class = class_of(hint.worth_cost, e->mem_block);
    e->value_kind = uint8_t(hint.kind);
    const double c = e->worth_class;
    mean_class_ = has_mean_ ? mean_class_ + kMeanGain * (c - mean_class_) : c;
    has_mean_ = true;
  }
  if (!weighed(e)) {  // a reload from disk keeps the class it was put with
    base_->insert(e, hint);
    return;
  }
  if (e->queue != QueueId::None) throw std::logic_error("worth: entry already queued");
  list_of(e).put_used(e, tick_);
  counted(e, +1);
}

void WorthPolicy::counted(const Entry* e, int sign) {
  count_ += size_t(sign);
  uint64_t& bytes = bytes_by_kind_[std::min<uint64_t>(e->value_kind, kValueKindMax)];
  bytes = sign > 0 ? bytes + e->mem_block : bytes - e->mem_block;
}

void WorthPolicy::insert_cold(Entry* e, QueueId queue, uint8_t freq) {
  if (!weighed(e)) return base_->insert_cold(e, queue, freq);
  if (e->queue != QueueId::None) throw std::logic_error("worth: entry already queued");
  list_of(e).put_cold(e, QueueId::Main);
  counted(e, +1);
}

void WorthPolicy::remove(Entry* e) {
  if (!weighed(e)) return base_->remove(e);
  if (e->queue == QueueId::None) return;
  list_of(e).unlink(e);
  counted(e, -1);
}

void WorthPolicy::on_read(Entry* e) {
  e->touched = tick_;
  if (!weighed(e)) return base_->on_read(e);
  if (e->queue != QueueId::None) list_of(e).use(e, tick_);
}

void WorthPolicy::on_exists(Entry* const* in_memory, const uint64_t* key_hashes, size_t n, size_t prefix) {
  if (count_ == 0) {  // nothing weighed: exactly the wrapped policy's order
    for (size_t i = 0; i < n; ++i)
      if (in_memory[i]) in_memory[i]->touched = tick_;
    return base_->on_exists(in_memory, key_hashes, n, prefix);
  }
  scratch_.assign(in_memory, in_memory + n);
  for (size_t i = n; i-- > 0;) {  // deepest first, as the chain policy: the head ends hottest
    Entry* e = scratch_[i];
    if (!e) continue;
    e->touched = tick_;
    if (!weighed(e)) continue;
    if (e->queue != QueueId::None) list_of(e).use(e, tick_);
    scratch_[i] = nullptr;  // the wrapped policy sees only its own values
  }
  base_->on_exists(scratch_.data(), key_hashes, n, prefix);
}

Entry* WorthPolicy::coldest_weighed(OwnerId owner, double* best) const {
  Entry* found = nullptr;
  *best = -1;
  for (int c = 1; c <= kClasses; ++c) {
    const auto& used = classes_[size_t(c)].used();
    size_t looked = 0;
    for (Entry* e : used) {  // the head, or one owner's coldest among the first few
      if (owner == kAnyOwner || e->owner == owner) {
        if (double s = score(e); s > *best) {
          *best = s;
          found = e;
        }
        break;
      }
      if (++looked >= kOwnerScanMax) break;
    }
  }
  return found;
}

Entry* WorthPolicy::peek(OwnerId owner) const {
  double mine_score;
  Entry* mine = count_ ? coldest_weighed(owner, &mine_score) : nullptr;
  Entry* theirs = base_->peek(owner);
  if (!mine) return theirs;
  return theirs && score(theirs) >= mine_score ? theirs : mine;
}

EvictionPolicy::Step WorthPolicy::next(Entry** victim, OwnerId owner) {
  if (count_ == 0) return base_->next(victim, owner);
  double mine_score;
  Entry* mine = coldest_weighed(owner, &mine_score);
  Entry* theirs = base_->peek(owner);
  if (!mine || (theirs && score(theirs) >= mine_score)) {
    const Step step = base_->next(victim, owner);
    if (step != Step::Empty || !mine) return step;
  }
  if (mine->leases > 0 || mine->pins > 0) {  // being read or written: look at it again later
    list_of(mine).requeue(mine);
    return Step::Skipped;
  }
  list_of(mine).unlink(mine);
  counted(mine, -1);
  *victim = mine;
  return Step::Victim;
}

void WorthPolicy::coldest_first(std::vector<Entry*>* out) const {
  base_->coldest_first(out);
  for (int c = 1; c <= kClasses; ++c) {
    const auto& used = classes_[size_t(c)].used();
    out->insert(out->end(), used.begin(), used.end());
  }
}

void WorthPolicy::fill_gauges(const GaugeSink& add) const {
  base_->fill_gauges(add);
  add("memory_worth_values", count_);
  add("memory_worth_page_bytes", bytes_by_kind_[uint8_t(ValueKind::AttentionPage)]);
  add("memory_worth_state_bytes", bytes_by_kind_[uint8_t(ValueKind::StateCheckpoint)]);
  add("memory_worth_other_bytes", bytes_by_kind_[uint8_t(ValueKind::Other)]);
  add("worth_mean_class", uint64_t(mean_class_ + 0.5));
}

void WorthPolicy::check() const {
  base_->check();
  size_t queued = 0;
  uint64_t bytes[kValueKindMax + 1] = {};
  for (int c = 1; c <= kClasses; ++c) {
    const ChainQueues<Entry>& list = classes_[size_t(c)];
    list.check("worth");
    if (!list.fresh().empty()) throw std::logic_error("worth: a value in a fresh list");
    for (Entry* e : list.used())
      if (e->worth_class != c || !e->in_memory || e->doomed()) throw std::logic_error("worth: bad entry in a class");
    for (Entry* e : list.used()) bytes[std::min<uint64_t>(e->value_kind, kValueKindMax)] += e->mem_block;
    queued += list.size();
  }
  if (queued != count_) throw std::logic_error("worth: value count drifted");
  for (uint64_t k = 0; k <= kValueKindMax; ++k)
    if (bytes[k] != bytes_by_kind_[k]) throw std::logic_error("worth: byte count drifted");
}

}  // namespace gcache
