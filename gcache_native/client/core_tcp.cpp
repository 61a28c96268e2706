// The native client core over TCP: GET_BATCH, PUT_BATCH, EXISTS_BATCH and
// REMOVE_BATCH, one frame each (docs/protocol.md). A PUT of large values
// ("trail": each value followed by its sum) hashes group by group: on a helper
// thread ahead of the send where cores allow, so the socket never waits for
// XXH3, else each group just before it is sent, while it is in cache.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include "client/core_ops.h"

namespace gcache::client_core {

bool protocol_error(CoreError* e, std::string message) {
  e->kind = ErrorKind::Protocol;
  e->message = std::move(message);
  return false;
}

namespace {

// Values at least this large on average carry their sums after them (PutOp.TRAIL_VALUE_BYTES_MIN).
constexpr uint64_t kTrailValueBytesMin = 16 << 10;
// Sent per sendmsg when trailing; hashed ahead of the send while the previous group goes out.
constexpr uint64_t kHashGroupBytes = 1 << 20;
// A PUT this large hashes on a helper thread, when the machine has a core to spare for it; otherwise
// each group is hashed just before it is sent (the kernel's copy then reads it from cache: one memory
// pass; the helper costs a second one, worth it only when the socket would otherwise wait).
constexpr uint64_t kHelperHashBytesMin = 4 << 20;
constexpr unsigned kHelperHashCoresMin = 4;

bool hash_on_helper(uint64_t total) {
  static const unsigned cores = std::thread::hardware_concurrency();  // once: it reads sysfs
  return total >= kHelperHashBytesMin && cores >= kHelperHashCoresMin;
}

bool send_frame(Channel& ch, const std::vector<uint8_t>& head, const std::vector<iovec>* payload, CoreError* e) {
  std::vector<iovec> iov;
  iov.reserve(1 + (payload ? payload->size() : 0));
  iov.push_back(iovec{const_cast<uint8_t*>(head.data()), head.size()});
  if (payload) iov.insert(iov.end(), payload->begin(), payload->end());
  return ch.send(iov, e);
}

// The request map {"keys": keys, "epoch"?: epoch} of EXISTS / REMOVE.
const std::vector<uint8_t>& keys_frame(RequestFrame& f, Opcode op, uint64_t rid, const Keys& keys, int64_t epoch) {
  f.meta().map(epoch == kNoEpoch ? 1 : 2);
  f.keys(keys);
  f.epoch(epoch);
  return f.finish(op, rid, 0);
}

}  // namespace

bool kinds_valid(const ReplyFields& r, size_t n) {
  if (!r.list_of(ReplyFields::kCks, n)) return false;
  for (uint8_t k : r.cks)
    if (!checksum_kind_valid(k)) return false;
  return true;
}

namespace {

ChecksumKind kind_of(const ReplyFields& r, bool has_kinds, size_t j) {
  return has_kinds ? ChecksumKind(r.cks[j]) : ChecksumKind::Xxh64;
}

// Hashes values in order on a helper thread; the sender waits for value i with wait_for(i).
class HashAhead {
 public:
  HashAhead(const std::vector<iovec>& values, ChecksumKind kind, std::vector<uint64_t>* sums)
      : values_(values), kind_(kind), sums_(*sums), thread_([this] { run(); }) {}
  ~HashAhead() {
    stop_.store(true);
    thread_.join();
  }
  void wait_for(size_t i) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_ > i; });
  }

 private:
  void run() {
    uint64_t group = 0;
    for (size_t i = 0; i < values_.size() && !stop_.load(std::memory_order_relaxed); ++i) {
      sums_[i] = checksum_of(kind_, values_[i].iov_base, values_[i].iov_len);
      group += values_[i].iov_len;
      if (group >= kHashGroupBytes || i + 1 == values_.size()) {
        group = 0;
        std::lock_guard<std::mutex> lock(mu_);
        done_ = i + 1;
        cv_.notify_one();
      }
    }
  }
  const std::vector<iovec>& values_;
  ChecksumKind kind_;
  std::vector<uint64_t>& sums_;
  std::mutex mu_;
  std::condition_variable cv_;
  size_t done_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: starts once the rest is set up
};

// The trailed payload: value, sum, value, sum..., sent a group at a time, each
// group's sums computed before it goes (on the helper, ahead, for a large PUT).
bool send_trailed(Channel& ch, const std::vector<uint8_t>& head, const std::vector<iovec>& values, ChecksumKind kind,
                  uint64_t total, CoreError* e) {
  std::vector<uint64_t> sums(values.size());  // little-endian host: the wire's byte order
  std::unique_ptr<HashAhead> ahead;
  if (hash_on_helper(total)) ahead = std::make_unique<HashAhead>(values, kind, &sums);
  std::vector<iovec> iov{iovec{const_cast<uint8_t*>(head.data()), head.size()}};
  uint64_t group = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    group += values[i].iov_len;
    const bool end = group >= kHashGroupBytes || i + 1 == values.size();
    if (!ahead) sums[i] = checksum_of(kind, values[i].iov_base, values[i].iov_len);
    iov.push_back(values[i]);
    iov.push_back(iovec{&sums[i], 8});
    if (end) {
      if (ahead) ahead->wait_for(i);
      if (!ch.send(iov, e)) return false;
      iov.clear();
      group = 0;
    }
  }
  return true;
}

}  // namespace

bool tcp_get(Channel& ch, const Keys& keys, ValueSink& sink, bool verify, int64_t epoch, GetAnswer* out, CoreError* e) {
  const size_t n = keys.size();
  const uint64_t rid = next_request_id();
  RequestFrame f;
  f.meta().map(epoch == kNoEpoch ? 2 : 3);
  f.keys(keys);
  f.epoch(epoch);
  f.meta().str("ck");  // this client reads "cks"
  f.meta().uint(uint64_t(ChecksumKind::Xxh3));
  if (quick_call(n)) ch.expect_quick_answer();
  if (!send_frame(ch, f.finish(Opcode::GetBatch, rid, 0), nullptr, e)) return false;
  FrameHeader h;
  ReplyFields r;
  if (!ch.read_reply(rid, Opcode::GetBatch, &h, &r, e)) return false;
  if (!r.list_of(ReplyFields::kLens, n)) return protocol_error(e, "GET answer: \"lens\" should list one entry per key");
  if (verify && !r.list_of(ReplyFields::kSums, n))
    return protocol_error(e, "GET answer: \"sums\" should list one entry per key");
  const bool has_kinds = verify && r.present(ReplyFields::kCks);
  if (has_kinds && !kinds_valid(r, n)) return protocol_error(e, "GET answer: bad \"cks\"");
  uint64_t found = 0;
  for (int64_t size : r.lens) found += size > 0 ? uint64_t(size) : 0;
  if (found != h.payload_len)
    return protocol_error(e, "GET response payload is " + std::to_string(h.payload_len) +
                                 " bytes but its lengths add up to " + std::to_string(found));
  out->sizes = r.lens;
  out->outcome.assign(n, Outcome::Miss);
  const std::vector<uint8_t*> dests = sink.destinations(r.lens, &out->outcome);
  // The values in key order: runs of ones that fit go in one scatter read; the rest are skipped.
  std::vector<iovec> iov;
  for (size_t j = 0; j < n; ++j) {
    if (r.lens[j] < 0) continue;
    if (dests[j] == nullptr) {
      if (!ch.read_into(iov, e) || !ch.skip(uint64_t(r.lens[j]), e)) return false;
      iov.clear();
      continue;
    }
    out->outcome[j] = Outcome::Hit;
    iov.push_back(iovec{dests[j], size_t(r.lens[j])});
  }
  if (!ch.read_into(iov, e)) return false;
  if (verify) {
    for (size_t j = 0; j < n; ++j)
      if (out->outcome[j] == Outcome::Hit &&
          checksum_of(kind_of(r, has_kinds, j), dests[j], size_t(r.lens[j])) != r.sums[j])
        out->outcome[j] = Outcome::BadChecksum;
  }
  return true;
}

bool tcp_put(Channel& ch, const Keys& keys, const std::vector<iovec>& values, ChecksumKind kind, int64_t epoch,
             const ExtraEntries& extra, PutAnswer* out, CoreError* e) {
  const size_t n = keys.size();
  uint64_t total = 0;
  for (const iovec& v : values) total += v.iov_len;
  const bool trail = kind != ChecksumKind::Xxh64 && n > 0 && total >= kTrailValueBytesMin * n;
  const uint64_t rid = next_request_id();
  RequestFrame f;
  MsgpackWriter& m = f.meta();
  m.map(3 + (kind != ChecksumKind::Xxh64) + (epoch != kNoEpoch) + extra.count);
  f.keys(keys);
  m.str("lens");
  m.array(uint32_t(n));
  for (const iovec& v : values) m.uint(v.iov_len);
  if (kind != ChecksumKind::Xxh64) {
    m.str("ck");
    m.uint(uint64_t(kind));
  }
  if (trail) {
    m.str("trail");
    m.boolean(true);
  } else {  // small values: their sums in the map (hashing a small value first costs nothing)
    m.str("sums");
    m.array(uint32_t(n));
    for (const iovec& v : values) m.uint(checksum_of(kind, v.iov_base, v.iov_len));
  }
  f.epoch(epoch);
  append_extra(m, extra);
  const std::vector<uint8_t>& head = f.finish(Opcode::PutBatch, rid, trail ? total + 8 * n : total);
  if (quick_call(n, total)) ch.expect_quick_answer();
  if (!(trail ? send_trailed(ch, head, values, kind, total, e) : send_frame(ch, head, &values, e))) return false;
  FrameHeader h;
  ReplyFields r;
  if (!ch.read_reply(rid, Opcode::PutBatch, &h, &r, e)) return false;
  if (!r.list_of(ReplyFields::kSt, n)) return protocol_error(e, "PUT answer: \"st\" should list one entry per key");
  if (!ch.skip(h.payload_len, e)) return false;
  out->st = std::move(r.st);
  out->ck = r.present(ReplyFields::kCk);
  return true;
}

bool tcp_exists(Channel& ch, const Keys& keys, int64_t epoch, std::vector<uint8_t>* present, int64_t* prefix,
                CoreError* e) {
  const uint64_t rid = next_request_id();
  RequestFrame f;
  if (quick_call(keys.size())) ch.expect_quick_answer();
  if (!send_frame(ch, keys_frame(f, Opcode::ExistsBatch, rid, keys, epoch), nullptr, e)) return false;
  FrameHeader h;
  ReplyFields r;
  if (!ch.read_reply(rid, Opcode::ExistsBatch, &h, &r, e)) return false;
  if (!r.list_of(ReplyFields::kEx, keys.size()))
    return protocol_error(e, "EXISTS answer: \"ex\" should list one entry per key");
  if (!r.present(ReplyFields::kPrefix) || r.prefix < 0 || uint64_t(r.prefix) > keys.size())
    return protocol_error(e, "EXISTS response has a bad prefix");
  if (!ch.skip(h.payload_len, e)) return false;
  *present = std::move(r.ex);
  *prefix = r.prefix;
  return true;
}

bool tcp_remove(Channel& ch, const Keys& keys, int64_t epoch, std::vector<int64_t>* st, CoreError* e) {
  const uint64_t rid = next_request_id();
  RequestFrame f;
  if (quick_call(keys.size())) ch.expect_quick_answer();
  if (!send_frame(ch, keys_frame(f, Opcode::RemoveBatch, rid, keys, epoch), nullptr, e)) return false;
  FrameHeader h;
  ReplyFields r;
  if (!ch.read_reply(rid, Opcode::RemoveBatch, &h, &r, e)) return false;
  if (!r.list_of(ReplyFields::kSt, keys.size()))
    return protocol_error(e, "REMOVE answer: \"st\" should list one entry per key");
  if (!ch.skip(h.payload_len, e)) return false;
  *st = std::move(r.st);
  return true;
}

}  // namespace gcache::client_core
