// A minimal, strict msgpack reader and writer for frame metadata.
// The reader never reads past its buffer: every malformed, truncated or
// over-deep input is a `false` return with error() set, never UB.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace gcache {

constexpr int kMsgpackDepthMax = 32;

class MsgpackReader {
 public:
  MsgpackReader(const uint8_t* data, size_t size) : p_(data), end_(data + size), begin_(data) {}

  // Each reads one value of the named kind; false (and error()) otherwise.
  bool read_map(uint32_t* count);
  bool read_array(uint32_t* count);
  bool read_bytes(std::string_view* out);  // str or bin
  bool read_uint(uint64_t* out);           // any non-negative integer
  bool read_int(int64_t* out);             // any integer that fits int64
  bool read_bool(bool* out);
  bool read_nil();
  bool skip();  // one value of any kind, depth-bounded

  bool at_end() const { return p_ == end_; }
  int peek() const { return p_ < end_ ? *p_ : -1; }  // the next byte (a value's type), -1 at the end
  size_t remaining() const { return size_t(end_ - p_); }
  const std::string& error() const { return error_; }

 private:
  bool fail(const char* what);
  bool need(size_t n);
  bool take_u8(uint8_t* v);
  bool take_be(size_t n, uint64_t* v);
  bool skip_depth(int depth);

  const uint8_t* p_;
  const uint8_t* end_;
  const uint8_t* begin_;
  std::string error_;
};

class MsgpackWriter {
 public:
  // `reserve_prefix` bytes are left at the front (e.g. for a frame header).
  explicit MsgpackWriter(size_t reserve_prefix = 0) : buf_(reserve_prefix, 0), prefix_(reserve_prefix) {}

  void map(uint32_t count);
  void array(uint32_t count);
  void str(std::string_view s);
  void bin(std::string_view b);
  void uint(uint64_t v);
  void integer(int64_t v);
  void boolean(bool v);
  void nil();

  std::vector<uint8_t>& buffer() { return buf_; }
  size_t body_size() const { return buf_.size() - prefix_; }
  void clear() { buf_.resize(prefix_); }

 private:
  void put_be(uint8_t tag, uint64_t v, size_t n);
  std::vector<uint8_t> buf_;
  size_t prefix_;
};

}  // namespace gcache
