// Blocking socket I/O of the data server's connection threads: exact reads
// and gathered writes under a stall timeout and a per-transfer deadline.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gcache {

class ChecksumStream;  // common/checksum.h

int64_t now_us();              // steady clock
int clamp_ms(double seconds);  // for poll(): rounded up, clamped to [0, INT_MAX]

// Thrown by the socket helpers when the connection cannot be used any more.
struct ConnectionLost {
  bool timeout;
};

// When a transfer of `bytes` begun at start_us must be over (0 = no deadline).
int64_t transfer_deadline_us(int64_t start_us, double stall_timeout_s, uint64_t bytes);
void check_deadline(int64_t deadline_us);  // throws ConnectionLost{true} once it has passed
void set_socket_buffers(int fd, int bytes);
void set_timeout(int fd, int option, double seconds);

// A connection's socket and the kernel timeouts set on it (see server/io.cpp).
struct SocketTimer {
  int fd = -1;
  double stall_s = 0;           // 0: no timeouts
  double rcv_s = 0, snd_s = 0;  // what SO_RCVTIMEO / SO_SNDTIMEO are set to now

  static SocketTimer for_socket(int fd, double stall_s);
};

// Reads exactly n bytes; a peer silent for the stall timeout, past
// deadline_us (0 = none), or closing mid-way throws ConnectionLost.
// With `landed`, every piece is hashed into it right after it arrives, while
// it is still in cache (pieces of at most kLandedChunkBytes): the bytes are
// verified as they land, with no second pass over the value. `tail` (tail_n
// bytes, not hashed) is filled after buf, in the same recvmsg as buf's last
// piece: a value and the checksum that trails it cost one system call.
void recv_exact(SocketTimer& t, void* buf, size_t n, int64_t deadline_us, ChecksumStream* landed = nullptr,
                void* tail = nullptr, size_t tail_n = 0);
constexpr size_t kLandedChunkBytes = 256 << 10;
// Writes every byte of iov[0..count) before deadline_us (0 = none); the
// iovecs are consumed in place.
void send_all(SocketTimer& t, iovec* iov, size_t count, int64_t deadline_us);

// Bytes read from a connection ahead of what its frame has consumed: one
// recv brings a frame's header and metadata together (and a small payload,
// and frames the client sent behind it), where reading them apart cost a
// system call each. Every read of a frame takes buffered bytes first.
class ReadAhead {
 public:
  static constexpr size_t kBytes = 16 << 10;  // a few frames' metadata; payloads beyond go socket -> arena

  size_t buffered() const { return end_ - pos_; }
  // With nothing buffered: one non-blocking recv of up to kBytes. Returns
  // what recv returns (0: the peer closed; -1: errno says why).
  ssize_t fill(int fd);
  // With nothing buffered: fill() again and again (a bounded spin) until bytes arrive or
  // until_us (steady clock) passes. True: bytes are buffered. False: none came in time, or
  // the peer closed or failed (the caller's poll() then reports it).
  bool spin_fill(int fd, int64_t until_us);
  // Exactly n bytes into buf (hashed into `landed` as they are copied or
  // land), then tail_n bytes into tail: buffered bytes first; a small rest
  // (under kBytes / 2) through the buffer, refilled by a blocking recv that
  // may bring the next values too (several small values per system call);
  // a large rest straight into buf with recv_exact (same deadline and stall
  // rules throughout).
  void read(SocketTimer& t, void* buf, size_t n, int64_t deadline_us, ChecksumStream* landed = nullptr,
            void* tail = nullptr, size_t tail_n = 0);

 private:
  size_t take(void* out, size_t n);  // up to n buffered bytes; returns how many
  std::vector<uint8_t> buf_;         // allocated by the first fill
  size_t pos_ = 0, end_ = 0;
};

}  // namespace gcache
