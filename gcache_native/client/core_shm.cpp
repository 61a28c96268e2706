// The native client core over shared memory (docs/protocol.md, "Shared memory
// and RDMA"). A read is one LOOKUP round trip, a copy out of the arena with
// each value's checksum computed in the same pass (when any value is unchecked
// by the node, or the caller verifies), and a RELEASE that needs no answer; a
// value whose bytes do not match is a miss, its offset goes back in the
// RELEASE ("bad"). A write is RESERVE, one pass that reads the source, writes
// the arena and hashes, then COMMIT with the sums.
#include <sys/mman.h>

#include <stdexcept>

#include "client/core_ops.h"
#include "client/shm_copy.h"

namespace gcache::client_core {

namespace {

// Values up to this size come back inside the LOOKUP answer (shm_ops.INLINE_BYTES_MAX).
constexpr uint64_t kInlineBytesMax = 16 << 10;

void send_release(Channel& ch, int64_t lease, const std::vector<uint64_t>& bad) {
  RequestFrame f;
  MsgpackWriter& m = f.meta();
  m.map(bad.empty() ? 1 : 2);
  m.str("leases");
  m.array(1);
  m.uint(uint64_t(lease));
  if (!bad.empty()) {
    m.str("bad");
    m.array(uint32_t(bad.size()));
    for (uint64_t off : bad) m.uint(off);
  }
  const std::vector<uint8_t>& frame = f.finish(Opcode::Release, 0, 0, kFlagNoReply);
  std::vector<iovec> iov{iovec{const_cast<uint8_t*>(frame.data()), frame.size()}};
  CoreError ignored;  // a failed RELEASE: the lease ends with its time or its connection
  ch.send(iov, &ignored);
}

}  // namespace

CoreArena::CoreArena(int fd, uint64_t size) : size_(size) {
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw std::runtime_error("cannot map the server's arena");
  base_ = static_cast<uint8_t*>(p);
}

CoreArena::~CoreArena() { munmap(base_, size_); }

bool shm_get(Channel& ch, CoreArena& arena, const ShmOptions& opt, const Keys& keys, ValueSink& sink, bool verify,
             int64_t epoch, GetAnswer* out, CoreError* e) {
  const size_t n = keys.size();
  const uint64_t rid = next_request_id();
  RequestFrame f;
  MsgpackWriter& m = f.meta();
  m.map(epoch == kNoEpoch ? 4 : 5);
  f.keys(keys);
  f.epoch(epoch);
  m.str("ck");  // this client reads "cks"
  m.uint(uint64_t(ChecksumKind::Xxh3));
  m.str("inline_max");
  m.uint(kInlineBytesMax);
  m.str("vfy");  // it checks every leased value's sum itself
  m.boolean(true);
  const int64_t sent_at = now_ns();  // the server's lease starts after this
  const std::vector<uint8_t>& frame = f.finish(Opcode::Lookup, rid, 0);
  std::vector<iovec> iov{iovec{const_cast<uint8_t*>(frame.data()), frame.size()}};
  if (quick_call(n)) ch.expect_quick_answer();
  if (!ch.send(iov, e)) return false;
  FrameHeader h;
  ReplyFields r;
  if (!ch.read_reply(rid, Opcode::Lookup, &h, &r, e)) return false;
  if (!r.list_of(ReplyFields::kOffs, n) || !r.list_of(ReplyFields::kLens, n) || !r.list_of(ReplyFields::kSums, n))
    return protocol_error(e, "LOOKUP answer: \"offs\", \"lens\" and \"sums\" should list one entry per key");
  const bool has_kinds = r.present(ReplyFields::kCks);
  if (has_kinds && !kinds_valid(r, n)) return protocol_error(e, "LOOKUP answer: bad \"cks\"");
  if (!r.present(ReplyFields::kInl)) r.inl.assign(n, 0);
  if (!r.present(ReplyFields::kLease) || r.inl.size() != n)
    return protocol_error(e, "LOOKUP answer has no lease or " + std::to_string(r.inl.size()) + " inline flags");
  auto kind = [&](size_t j) { return has_kinds ? ChecksumKind(r.cks[j]) : ChecksumKind::Xxh64; };
  uint64_t inline_bytes = 0;
  for (size_t j = 0; j < n; ++j)
    if (r.lens[j] >= 0 && r.inl[j]) inline_bytes += uint64_t(r.lens[j]);
  if (inline_bytes != h.payload_len)
    return protocol_error(
        e, "LOOKUP answer payload is " + std::to_string(h.payload_len) + " bytes, not its inline values");
  const int64_t lease = r.lease;
  out->sizes = r.lens;
  out->outcome.assign(n, Outcome::Miss);
  const std::vector<uint8_t*> dests = sink.destinations(r.lens, &out->outcome);
  // Inline values, in key order (checked by the node before it sent them).
  for (size_t j = 0; j < n; ++j) {
    if (r.lens[j] < 0 || !r.inl[j]) continue;
    const uint64_t size = uint64_t(r.lens[j]);
    if (dests[j] == nullptr) {
      if (!ch.skip(size, e)) return false;  // (a lease, if any, dies with the broken connection)
      continue;
    }
    std::vector<iovec> one{iovec{dests[j], size_t(size)}};
    if (!ch.read_into(one, e)) return false;
    out->outcome[j] = verify && checksum_of(kind(j), dests[j], size) != r.sums[j] ? Outcome::BadChecksum : Outcome::Hit;
  }
  if (lease == 0) return true;
  // Leased values: copied out of the arena, hashed in the same pass when the node has not
  // checked every one of them ("vf") or the caller verifies.
  bool unchecked = false;
  std::vector<shm_copy::CopyItem> items;
  std::vector<size_t> index;
  std::vector<uint64_t> bad_offsets;
  for (size_t j = 0; j < n; ++j) {
    if (r.lens[j] < 0 || r.inl[j]) continue;
    if (r.present(ReplyFields::kVf) && j < r.vf.size() && !r.vf[j]) unchecked = true;
    if (dests[j] == nullptr) continue;
    const uint64_t size = uint64_t(r.lens[j]);
    if (r.offs[j] < 0 || !arena.holds(uint64_t(r.offs[j]), size)) {  // not the value: a miss
      out->outcome[j] = Outcome::BadChecksum;
      bad_offsets.push_back(uint64_t(r.offs[j]));
      continue;
    }
    items.push_back(shm_copy::CopyItem{arena.base() + r.offs[j], dests[j], size, r.sums[j], kind(j)});
    index.push_back(j);
  }
  if (arena.closing()) {
    send_release(ch, lease, bad_offsets);
    e->kind = ErrorKind::ArenaClosed;
    return false;
  }
  const bool hash_now = verify || unchecked;
  shm_copy::run_items(items, opt.threads, hash_now ? shm_copy::Hash::Destination : shm_copy::Hash::None);
  const int64_t trusted_until = sent_at + int64_t(opt.trusted_s * 1e9);
  const bool late = !hash_now && now_ns() > trusted_until;  // the lease may have ended mid-copy
  for (size_t k = 0; k < items.size(); ++k) {
    const size_t j = index[k];
    const uint64_t sum = late ? checksum_of(items[k].kind, items[k].dst, items[k].length) : items[k].sum;
    if ((hash_now || late) && sum != items[k].expected) {
      out->outcome[j] = Outcome::BadChecksum;
      bad_offsets.push_back(uint64_t(r.offs[j]));  // the node checks it itself and removes it
    } else {
      out->outcome[j] = Outcome::Hit;
    }
  }
  send_release(ch, lease, bad_offsets);
  return true;
}

bool shm_put(Channel& ch, CoreArena& arena, const ShmOptions& opt, const Keys& keys, const std::vector<iovec>& values,
             ChecksumKind kind, int64_t epoch, const ExtraEntries& extra, bool first, bool last, PutAnswer* out,
             CoreError* e) {
  const size_t n = keys.size();
  const uint64_t rid = next_request_id();
  RequestFrame f;
  MsgpackWriter& m = f.meta();
  m.map(4 + (epoch != kNoEpoch) + extra.count);
  f.keys(keys);
  m.str("lens");
  m.array(uint32_t(n));
  for (const iovec& v : values) m.uint(v.iov_len);
  m.str("cont");  // a batch in several RESERVEs is one chain for the eviction policy
  m.boolean(!first);
  m.str("last");
  m.boolean(last);
  f.epoch(epoch);
  append_extra(m, extra);
  const std::vector<uint8_t>& frame = f.finish(Opcode::Reserve, rid, 0);
  std::vector<iovec> iov{iovec{const_cast<uint8_t*>(frame.data()), frame.size()}};
  if (quick_call(n)) ch.expect_quick_answer();
  if (!ch.send(iov, e)) return false;
  FrameHeader h;
  ReplyFields r;
  if (!ch.read_reply(rid, Opcode::Reserve, &h, &r, e)) return false;
  if (!r.list_of(ReplyFields::kSt, n) || !r.list_of(ReplyFields::kOffs, n))
    return protocol_error(e, "RESERVE answer: \"st\" and \"offs\" should list one entry per key");
  if (!r.present(ReplyFields::kRes) || h.payload_len != 0)
    return protocol_error(e, "RESERVE answer has no res or a payload of " + std::to_string(h.payload_len));
  out->st = r.st;
  std::vector<shm_copy::CopyItem> items;
  std::vector<size_t> index;
  for (size_t j = 0; j < n; ++j) {
    if (r.st[j] != kPutStored) continue;  // answered by the RESERVE
    out->st[j] = kPutNoSpace;             // reserved: stored once COMMIT says so
    if (r.offs[j] < 0 || !arena.holds(uint64_t(r.offs[j]), values[j].iov_len))
      return protocol_error(e, "a reserved block lies outside the arena");
    items.push_back(shm_copy::CopyItem{static_cast<const uint8_t*>(values[j].iov_base), arena.base() + r.offs[j],
                                       values[j].iov_len, 0, kind});
    index.push_back(j);
  }
  if (r.res == 0) return true;
  if (arena.closing()) {
    e->kind = ErrorKind::ArenaClosed;  // the reservation dies with the connection
    return false;
  }
  shm_copy::run_items(items, opt.threads, shm_copy::Hash::Source);
  std::vector<uint64_t> sums(n, 0);
  for (size_t k = 0; k < items.size(); ++k) sums[index[k]] = items[k].sum;
  const uint64_t commit_id = next_request_id();
  RequestFrame c;
  MsgpackWriter& cm = c.meta();
  cm.map(kind == ChecksumKind::Xxh64 ? 2 : 3);
  cm.str("res");
  cm.uint(uint64_t(r.res));
  cm.str("sums");
  cm.array(uint32_t(n));
  for (uint64_t s : sums) cm.uint(s);
  if (kind != ChecksumKind::Xxh64) {
    cm.str("ck");
    cm.uint(uint64_t(kind));
  }
  const std::vector<uint8_t>& commit = c.finish(Opcode::Commit, commit_id, 0);
  std::vector<iovec> civ{iovec{const_cast<uint8_t*>(commit.data()), commit.size()}};
  if (quick_call(n)) ch.expect_quick_answer();
  if (!ch.send(civ, e)) return false;
  ReplyFields cr;
  if (!ch.read_reply(commit_id, Opcode::Commit, &h, &cr, e)) return false;
  if (!cr.list_of(ReplyFields::kSt, n)) return protocol_error(e, "COMMIT answer: \"st\" should list one entry per key");
  if (!ch.skip(h.payload_len, e)) return false;
  for (size_t j : index) out->st[j] = cr.st[j];
  out->ck = true;  // the node that answered RESERVE speaks the kind this client chose at attach
  return true;
}

}  // namespace gcache::client_core
