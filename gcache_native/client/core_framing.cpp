#include "client/core_framing.h"

#include <cstring>

namespace gcache::client_core {

void RequestFrame::keys(const std::vector<std::string_view>& keys) {
  writer_.str("keys");
  writer_.array(uint32_t(keys.size()));
  for (std::string_view k : keys) writer_.bin(k);
}

void RequestFrame::epoch(int64_t e) {
  if (e == kNoEpoch) return;
  writer_.str("epoch");
  writer_.uint(uint64_t(e));
}

const std::vector<uint8_t>& RequestFrame::finish(Opcode op, uint64_t request_id, uint64_t payload_len, uint16_t flags) {
  std::vector<uint8_t>& buf = writer_.buffer();
  build_frame_header(buf.data(), uint8_t(op), flags, request_id, uint32_t(writer_.body_size()), FrameStatus::Ok,
                     payload_len);
  return buf;
}

void append_extra(MsgpackWriter& w, const ExtraEntries& extra) {
  std::vector<uint8_t>& buf = w.buffer();
  buf.insert(buf.end(), extra.bytes.begin(), extra.bytes.end());
}

bool ReplyFields::list_of(Field f, size_t n) const {
  if (!present(f)) return false;
  switch (f) {
    case kLens: return lens.size() == n;
    case kSums: return sums.size() == n;
    case kCks: return cks.size() == n;
    case kSt: return st.size() == n;
    case kOffs: return offs.size() == n;
    case kInl: return inl.size() == n;
    case kVf: return vf.size() == n;
    case kEx: return ex.size() == n;
    default: return false;
  }
}

namespace {

bool read_flag(MsgpackReader& r, uint8_t* out) {  // a bool, or an int (0 / non-zero)
  const int t = r.peek();
  if (t == 0xc2 || t == 0xc3) {
    bool b;
    if (!r.read_bool(&b)) return false;
    *out = b;
    return true;
  }
  int64_t v;
  if (!r.read_int(&v)) return false;
  *out = v != 0 ? (v > 255 ? 255 : uint8_t(v < 0 ? 255 : v)) : 0;
  return true;
}

template <class T, class Read>
bool read_list(MsgpackReader& r, std::vector<T>* out, Read read_one) {
  uint32_t n;
  if (!r.read_array(&n)) return false;
  out->resize(n);
  for (uint32_t i = 0; i < n; ++i)
    if (!read_one(&(*out)[i])) return false;
  return true;
}

}  // namespace

bool parse_reply(const uint8_t* data, size_t size, ReplyFields* out, std::string* error) {
  MsgpackReader r(data, size);
  uint32_t entries;
  auto failed = [&] {
    *error = r.error().empty() ? "malformed response map" : r.error();
    return false;
  };
  if (!r.read_map(&entries)) return failed();
  auto ints = [&r](std::vector<int64_t>* v) { return read_list(r, v, [&r](int64_t* x) { return r.read_int(x); }); };
  auto flags = [&r](std::vector<uint8_t>* v) { return read_list(r, v, [&r](uint8_t* x) { return read_flag(r, x); }); };
  for (uint32_t i = 0; i < entries; ++i) {
    std::string_view key;
    if (r.peek() < 0xa0 || (r.peek() > 0xbf && r.peek() != 0xd9)) {  // a non-string key: not one of ours
      if (!r.skip() || !r.skip()) return failed();
      continue;
    }
    if (!r.read_bytes(&key)) return failed();
    bool ok = true;
    uint32_t field = 0;
    if (key == "lens") ok = ints(&out->lens), field = ReplyFields::kLens;
    else if (key == "st") ok = ints(&out->st), field = ReplyFields::kSt;
    else if (key == "offs") ok = ints(&out->offs), field = ReplyFields::kOffs;
    else if (key == "sums")
      ok = read_list(r, &out->sums, [&r](uint64_t* x) { return r.read_uint(x); }), field = ReplyFields::kSums;
    else if (key == "cks") ok = flags(&out->cks), field = ReplyFields::kCks;
    else if (key == "inl") ok = flags(&out->inl), field = ReplyFields::kInl;
    else if (key == "vf") ok = flags(&out->vf), field = ReplyFields::kVf;
    else if (key == "ex") ok = flags(&out->ex), field = ReplyFields::kEx;
    else if (key == "lease" || key == "res" || key == "prefix") {
      // A scalar the operation checks: anything but an int is left out (the caller refuses it).
      int64_t* dst = key == "lease" ? &out->lease : key == "res" ? &out->res : &out->prefix;
      const int t = r.peek();
      if (t <= 0x7f || t >= 0xe0 || (t >= 0xcc && t <= 0xd3)) {
        ok = r.read_int(dst);
        field = key == "lease" ? ReplyFields::kLease : key == "res" ? ReplyFields::kRes : ReplyFields::kPrefix;
      } else {
        ok = r.skip();
      }
    } else if (key == "ck") {
      ok = r.skip(), field = ReplyFields::kCk;
    } else {
      ok = r.skip();
    }
    if (!ok) return failed();
    out->has |= field;
  }
  return true;
}

}  // namespace gcache::client_core
