// The native client core's framing (docs/protocol.md): request frames built
// from plain C++ values, and the fields of a response map the core reads.
// No Python and no I/O here: client/core_channel.h moves the bytes,
// client/core_bindings.cpp talks to Python.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/frame.h"
#include "common/msgpack_lite.h"

namespace gcache::client_core {

constexpr int64_t kNoEpoch = -1;

// A request frame: header + metadata in one buffer (the payload goes after it, uncopied).
class RequestFrame {
 public:
  RequestFrame() : writer_(kFrameHeaderBytes) {}
  MsgpackWriter& meta() { return writer_; }
  // {"keys": [bin...]} entries: the map count is the caller's.
  void keys(const std::vector<std::string_view>& keys);
  // "epoch": e, when e != kNoEpoch (the caller counted it in the map).
  void epoch(int64_t e);
  // Writes the header; returns header + metadata.
  const std::vector<uint8_t>& finish(Opcode op, uint64_t request_id, uint64_t payload_len, uint16_t flags = 0);

 private:
  MsgpackWriter writer_;
};

// Extra request-map entries a caller passes pre-encoded (msgpack key/value pairs, e.g. a
// PUT's optional value description): appended verbatim, counted in the map.
struct ExtraEntries {
  std::string_view bytes;
  uint32_t count = 0;
};
void append_extra(MsgpackWriter& w, const ExtraEntries& extra);

// The response-map fields the core uses; `has` says which were present.
struct ReplyFields {
  enum Field : uint32_t {
    kLens = 1,
    kSums = 2,
    kCks = 4,
    kSt = 8,
    kOffs = 16,
    kInl = 32,
    kVf = 64,
    kEx = 128,
    kLease = 256,
    kRes = 512,
    kPrefix = 1024,
    kCk = 2048,
  };
  uint32_t has = 0;
  std::vector<int64_t> lens, st, offs;
  std::vector<uint64_t> sums;
  std::vector<uint8_t> cks, inl, vf, ex;  // bools and small ints
  int64_t lease = 0, res = 0, prefix = 0;
  bool present(Field f) const { return (has & f) != 0; }
  // True when `f` is a list of exactly n entries.
  bool list_of(Field f, size_t n) const;
};

// Parses a response map; false (and *error) when it is not a valid map of the expected types.
bool parse_reply(const uint8_t* data, size_t size, ReplyFields* out, std::string* error);

}  // namespace gcache::client_core
