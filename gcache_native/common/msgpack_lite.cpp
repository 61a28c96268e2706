#include "common/msgpack_lite.h"

#include <cstring>
#include <limits>

namespace gcache {

bool MsgpackReader::fail(const char* what) {
  if (error_.empty()) {
    error_ = std::string(what) + " at metadata byte " + std::to_string(p_ - begin_);
  }
  return false;
}

bool MsgpackReader::need(size_t n) {
  if (size_t(end_ - p_) < n) return fail("truncated msgpack");
  return true;
}

bool MsgpackReader::take_u8(uint8_t* v) {
  if (!need(1)) return false;
  *v = *p_++;
  return true;
}

bool MsgpackReader::take_be(size_t n, uint64_t* v) {
  if (!need(n)) return false;
  uint64_t x = 0;
  for (size_t i = 0; i < n; ++i) x = (x << 8) | p_[i];
  p_ += n;
  *v = x;
  return true;
}

bool MsgpackReader::read_map(uint32_t* count) {
  uint8_t t;
  if (!take_u8(&t)) return false;
  uint64_t n;
  if ((t & 0xf0) == 0x80) {
    n = t & 0x0f;
  } else if (t == 0xde) {
    if (!take_be(2, &n)) return false;
  } else if (t == 0xdf) {
    if (!take_be(4, &n)) return false;
  } else {
    --p_;
    return fail("expected a msgpack map");
  }
  // Every entry needs at least 2 bytes: reject impossible counts up front.
  if (n * 2 > remaining()) return fail("msgpack map longer than its metadata");
  *count = uint32_t(n);
  return true;
}

bool MsgpackReader::read_array(uint32_t* count) {
  uint8_t t;
  if (!take_u8(&t)) return false;
  uint64_t n;
  if ((t & 0xf0) == 0x90) {
    n = t & 0x0f;
  } else if (t == 0xdc) {
    if (!take_be(2, &n)) return false;
  } else if (t == 0xdd) {
    if (!take_be(4, &n)) return false;
  } else {
    --p_;
    return fail("expected a msgpack array");
  }
  if (n > remaining()) return fail("msgpack array longer than its metadata");
  *count = uint32_t(n);
  return true;
}

bool MsgpackReader::read_bytes(std::string_view* out) {
  uint8_t t;
  if (!take_u8(&t)) return false;
  uint64_t n;
  if ((t & 0xe0) == 0xa0) {
    n = t & 0x1f;
  } else if (t == 0xd9 || t == 0xc4) {
    if (!take_be(1, &n)) return false;
  } else if (t == 0xda || t == 0xc5) {
    if (!take_be(2, &n)) return false;
  } else if (t == 0xdb || t == 0xc6) {
    if (!take_be(4, &n)) return false;
  } else {
    --p_;
    return fail("expected msgpack bin or str");
  }
  if (!need(size_t(n))) return false;
  *out = std::string_view(reinterpret_cast<const char*>(p_), size_t(n));
  p_ += n;
  return true;
}

bool MsgpackReader::read_uint(uint64_t* out) {
  int64_t signed_value;
  uint8_t t;
  if (!need(1)) return false;
  t = *p_;
  if (t <= 0x7f) {
    ++p_;
    *out = t;
    return true;
  }
  if (t >= 0xcc && t <= 0xcf) {
    ++p_;
    return take_be(size_t(1) << (t - 0xcc), out);
  }
  if ((t >= 0xd0 && t <= 0xd3) || t >= 0xe0) {
    const uint8_t* start = p_;
    if (!read_int(&signed_value)) return false;
    if (signed_value < 0) {
      p_ = start;
      return fail("expected a non-negative integer");
    }
    *out = uint64_t(signed_value);
    return true;
  }
  return fail("expected a msgpack unsigned integer");
}

bool MsgpackReader::read_int(int64_t* out) {
  if (!need(1)) return false;
  const uint8_t t = *p_;
  if (t <= 0x7f) {
    ++p_;
    *out = t;
    return true;
  }
  if (t >= 0xe0) {
    ++p_;
    *out = int8_t(t);
    return true;
  }
  uint64_t v;
  if (t >= 0xcc && t <= 0xcf) {
    ++p_;
    if (!take_be(size_t(1) << (t - 0xcc), &v)) return false;
    if (v > uint64_t(std::numeric_limits<int64_t>::max())) return fail("integer does not fit int64");
    *out = int64_t(v);
    return true;
  }
  if (t >= 0xd0 && t <= 0xd3) {
    ++p_;
    const size_t n = size_t(1) << (t - 0xd0);
    if (!take_be(n, &v)) return false;
    switch (n) {
      case 1: *out = int8_t(v); break;
      case 2: *out = int16_t(v); break;
      case 4: *out = int32_t(v); break;
      default: *out = int64_t(v); break;
    }
    return true;
  }
  return fail("expected a msgpack integer");
}

bool MsgpackReader::read_bool(bool* out) {
  if (!need(1)) return false;
  if (*p_ == 0xc2 || *p_ == 0xc3) {
    *out = *p_ == 0xc3;
    ++p_;
    return true;
  }
  return fail("expected a msgpack bool");
}

bool MsgpackReader::read_nil() {
  if (!need(1)) return false;
  if (*p_ != 0xc0) return fail("expected msgpack nil");
  ++p_;
  return true;
}

bool MsgpackReader::skip() { return skip_depth(0); }

bool MsgpackReader::skip_depth(int depth) {
  if (depth > kMsgpackDepthMax) return fail("msgpack nested too deep");
  if (!need(1)) return false;
  const uint8_t t = *p_;
  uint64_t n = 0;
  if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3) {
    ++p_;
    return true;
  }
  if ((t & 0xf0) == 0x80 || t == 0xde || t == 0xdf) {
    uint32_t count;
    if (!read_map(&count)) return false;
    for (uint32_t i = 0; i < count; ++i)
      if (!skip_depth(depth + 1) || !skip_depth(depth + 1)) return false;
    return true;
  }
  if ((t & 0xf0) == 0x90 || t == 0xdc || t == 0xdd) {
    uint32_t count;
    if (!read_array(&count)) return false;
    for (uint32_t i = 0; i < count; ++i)
      if (!skip_depth(depth + 1)) return false;
    return true;
  }
  if ((t & 0xe0) == 0xa0 || (t >= 0xc4 && t <= 0xc6) || (t >= 0xd9 && t <= 0xdb)) {
    std::string_view ignored;
    return read_bytes(&ignored);
  }
  ++p_;
  // Not reformatted: a table of msgpack type bytes.
  // clang-format off
  switch (t) {
    case 0xc1: --p_; return fail("invalid msgpack byte 0xc1");
    case 0xca: return need(4) && (p_ += 4, true);
    case 0xcb: return need(8) && (p_ += 8, true);
    case 0xcc: case 0xd0: return need(1) && (p_ += 1, true);
    case 0xcd: case 0xd1: return need(2) && (p_ += 2, true);
    case 0xce: case 0xd2: return need(4) && (p_ += 4, true);
    case 0xcf: case 0xd3: return need(8) && (p_ += 8, true);
    case 0xd4: return need(2) && (p_ += 2, true);   // fixext 1: type + 1
    case 0xd5: return need(3) && (p_ += 3, true);
    case 0xd6: return need(5) && (p_ += 5, true);
    case 0xd7: return need(9) && (p_ += 9, true);
    case 0xd8: return need(17) && (p_ += 17, true);
    case 0xc7: if (!take_be(1, &n)) return false; break;  // ext 8/16/32: len, type, data
    case 0xc8: if (!take_be(2, &n)) return false; break;
    case 0xc9: if (!take_be(4, &n)) return false; break;
    default: --p_; return fail("invalid msgpack byte");
  }
  // clang-format on
  if (!need(size_t(n) + 1)) return false;
  p_ += n + 1;
  return true;
}

void MsgpackWriter::put_be(uint8_t tag, uint64_t v, size_t n) {
  uint8_t bytes[9];  // the tag and up to 8 big-endian bytes, appended at once
  bytes[0] = tag;
  for (size_t i = 0; i < n; ++i) bytes[1 + i] = uint8_t(v >> (8 * (n - 1 - i)));
  buf_.insert(buf_.end(), bytes, bytes + 1 + n);
}

void MsgpackWriter::map(uint32_t count) {
  if (count < 16) buf_.push_back(uint8_t(0x80 | count));
  else if (count <= 0xffff) put_be(0xde, count, 2);
  else put_be(0xdf, count, 4);
}

void MsgpackWriter::array(uint32_t count) {
  if (count < 16) buf_.push_back(uint8_t(0x90 | count));
  else if (count <= 0xffff) put_be(0xdc, count, 2);
  else put_be(0xdd, count, 4);
}

void MsgpackWriter::str(std::string_view s) {
  const size_t n = s.size();
  if (n < 32) buf_.push_back(uint8_t(0xa0 | n));
  else if (n <= 0xff) put_be(0xd9, n, 1);
  else if (n <= 0xffff) put_be(0xda, n, 2);
  else put_be(0xdb, n, 4);
  buf_.insert(buf_.end(), s.begin(), s.end());
}

void MsgpackWriter::bin(std::string_view b) {
  const size_t n = b.size();
  if (n <= 0xff) put_be(0xc4, n, 1);
  else if (n <= 0xffff) put_be(0xc5, n, 2);
  else put_be(0xc6, n, 4);
  buf_.insert(buf_.end(), b.begin(), b.end());
}

void MsgpackWriter::uint(uint64_t v) {
  if (v <= 0x7f) buf_.push_back(uint8_t(v));
  else if (v <= 0xff) put_be(0xcc, v, 1);
  else if (v <= 0xffff) put_be(0xcd, v, 2);
  else if (v <= 0xffffffffull) put_be(0xce, v, 4);
  else put_be(0xcf, v, 8);
}

void MsgpackWriter::integer(int64_t v) {
  if (v >= 0) return uint(uint64_t(v));
  if (v >= -32) buf_.push_back(uint8_t(int8_t(v)));
  else if (v >= -128) put_be(0xd0, uint64_t(v), 1);
  else if (v >= -32768) put_be(0xd1, uint64_t(v), 2);
  else if (v >= -2147483648ll) put_be(0xd2, uint64_t(v), 4);
  else put_be(0xd3, uint64_t(v), 8);
}

void MsgpackWriter::boolean(bool v) { buf_.push_back(v ? 0xc3 : 0xc2); }

void MsgpackWriter::nil() { buf_.push_back(0xc0); }

}  // namespace gcache
