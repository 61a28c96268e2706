// The native client core's operations: one request frame (one slice of a
// batch) each, on one connection, with plain C++ types. The caller (the
// binding) holds no GIL while they run. They answer exactly what the Python
// reference operations (gcache/client/operations.py, transports/shm_ops.py)
// answer; the tests check one against the other on a real server.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "client/core_channel.h"
#include "client/core_framing.h"
#include "common/checksum.h"

namespace gcache::client_core {

using Keys = std::vector<std::string_view>;

enum class Outcome : uint8_t { Miss, Hit, TooSmall, BadChecksum };

// Per-key put statuses (PutStatus on the wire).
constexpr int64_t kPutStored = 0;
constexpr int64_t kPutNoSpace = 2;

struct GetAnswer {
  std::vector<int64_t> sizes;  // the value's length (hits and too-small ones)
  std::vector<Outcome> outcome;
};

// Where read values go: the caller's buffers (`targets`, one per key), or, when
// `allocate` is set, new buffers it makes once the found sizes are known (-1: none).
struct ValueSink {
  std::vector<iovec> targets;
  std::function<void(const std::vector<int64_t>& sizes, std::vector<uint8_t*>* dests)> allocate;

  // Where each found value (lens[j] >= 0) goes; a target too small for its value gets
  // none and is marked TooSmall in `outcome` (never write past a caller's buffer).
  std::vector<uint8_t*> destinations(const std::vector<int64_t>& lens, std::vector<Outcome>* outcome) {
    std::vector<uint8_t*> dests(lens.size(), nullptr);
    if (allocate) {
      allocate(lens, &dests);
      return dests;
    }
    for (size_t j = 0; j < lens.size(); ++j) {
      if (lens[j] < 0) continue;
      if (uint64_t(lens[j]) > targets[j].iov_len) (*outcome)[j] = Outcome::TooSmall;
      else dests[j] = static_cast<uint8_t*>(targets[j].iov_base);
    }
    return dests;
  }
};

struct PutAnswer {
  std::vector<int64_t> st;  // final per-key put status
  bool ck = false;          // the answer named the checksum kind it checked
};

// A call of at most this many keys and this much request payload is answered within
// microseconds: its wait spins before it blocks (Channel::expect_quick_answer).
constexpr size_t kQuickKeysMax = 8;
constexpr uint64_t kQuickPayloadBytesMax = 64 << 10;
inline bool quick_call(size_t keys, uint64_t payload_bytes = 0) {
  return keys <= kQuickKeysMax && payload_bytes <= kQuickPayloadBytesMax;
}

// Over TCP: values travel in the frames.
bool tcp_get(Channel& ch, const Keys& keys, ValueSink& sink, bool verify, int64_t epoch, GetAnswer* out, CoreError* e);
bool tcp_put(Channel& ch, const Keys& keys, const std::vector<iovec>& values, ChecksumKind kind, int64_t epoch,
             const ExtraEntries& extra, PutAnswer* out, CoreError* e);
bool tcp_exists(Channel& ch, const Keys& keys, int64_t epoch, std::vector<uint8_t>* present, int64_t* prefix,
                CoreError* e);
bool tcp_remove(Channel& ch, const Keys& keys, int64_t epoch, std::vector<int64_t>* st, CoreError* e);

// A server's arena, mapped read-write from its memfd. close() only marks it: it
// is unmapped when the last holder (the Python object, a call in flight) lets go.
class CoreArena {
 public:
  CoreArena(int fd, uint64_t size);
  ~CoreArena();
  CoreArena(const CoreArena&) = delete;
  CoreArena& operator=(const CoreArena&) = delete;
  uint8_t* base() const { return base_; }
  uint64_t size() const { return size_; }
  bool holds(uint64_t offset, uint64_t length) const { return offset <= size_ && length <= size_ - offset; }
  void close() { closing_.store(true); }
  bool closing() const { return closing_.load(); }

 private:
  uint8_t* base_;
  uint64_t size_;
  std::atomic<bool> closing_{false};
};

struct ShmOptions {
  double trusted_s = 0;  // how long after sending a LOOKUP its lease surely holds (a share of the lease)
  int threads = 0;       // copy threads (0: by size)
};

// Over shared memory: LOOKUP, copy out (hashed in the same pass when needed), RELEASE.
bool shm_get(Channel& ch, CoreArena& arena, const ShmOptions& opt, const Keys& keys, ValueSink& sink, bool verify,
             int64_t epoch, GetAnswer* out, CoreError* e);
// RESERVE, copy in (hashing the source in the same pass), COMMIT.
bool shm_put(Channel& ch, CoreArena& arena, const ShmOptions& opt, const Keys& keys, const std::vector<iovec>& values,
             ChecksumKind kind, int64_t epoch, const ExtraEntries& extra, bool first, bool last, PutAnswer* out,
             CoreError* e);

// Shared by both: a protocol error with `message`.
bool protocol_error(CoreError* e, std::string message);
// "cks" lists n known checksum kinds.
bool kinds_valid(const ReplyFields& r, size_t n);

}  // namespace gcache::client_core
