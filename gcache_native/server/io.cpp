#include "server/io.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstring>
#include <fstream>

#include "common/checksum.h"
#include "common/spin_step.h"

namespace gcache {
namespace {

long read_proc_long(const char* path) {
  std::ifstream in(path);
  long v = -1;
  in >> v;
  return in ? v : -1;
}

}  // namespace

// A frame (or a response) must move at least this fast on average. SO_RCVTIMEO
// alone only catches a peer that goes fully silent: one trickling a byte per
// (stall timeout - epsilon) would hold its PUT reservations or GET leases for
// ever. 1 MiB/s is far below any real link, so only such peers are cut off.
constexpr double kMinBytesPerSecond = double(1 << 20);

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int clamp_ms(double seconds) {
  const double ms = std::ceil(seconds * 1000.0);  // never wake before the time is up
  if (ms <= 0) return 0;
  if (ms >= double(INT_MAX)) return INT_MAX;
  return int(ms);
}

// When a transfer of `bytes` begun at start_us must be over: the stall
// timeout plus the time at kMinBytesPerSecond; 0 (no deadline) where the
// stall timeout is off.
int64_t transfer_deadline_us(int64_t start_us, double stall_timeout_s, uint64_t bytes) {
  if (stall_timeout_s <= 0) return 0;
  const double budget_s = stall_timeout_s + double(bytes) / kMinBytesPerSecond;
  return start_us + int64_t(std::min(budget_s, 1e9) * 1e6);
}

// Checked after every partial read or write.
void check_deadline(int64_t deadline_us) {
  if (deadline_us > 0 && now_us() > deadline_us) throw ConnectionLost{true};
}

// Sets SO_SNDBUF/SO_RCVBUF only where the kernel grants the full size:
// a smaller explicit size would switch off TCP autotuning and be slower.
void set_socket_buffers(int fd, int bytes) {
  if (bytes <= 0) return;
  static const long rmem_max = read_proc_long("/proc/sys/net/core/rmem_max");
  static const long wmem_max = read_proc_long("/proc/sys/net/core/wmem_max");
  if (rmem_max >= bytes) setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
  if (wmem_max >= bytes) setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
}

void set_timeout(int fd, int option, double seconds) {
  timeval tv{};
  if (seconds > 0) {
    tv.tv_sec = time_t(seconds);
    tv.tv_usec = suseconds_t((seconds - double(tv.tv_sec)) * 1e6);
    if (tv.tv_sec == 0 && tv.tv_usec == 0) tv.tv_usec = 1000;
  }
  setsockopt(fd, SOL_SOCKET, option, &tv, sizeof tv);
}

// A connection's socket and the kernel timeouts set on it. A blocking
// recv/send waits in slices of at most stall_s / kStallSlices (SO_RCVTIMEO /
// SO_SNDTIMEO). A call that returns early with everything moved was making
// progress until then; one cut short by its timeout is taken to have moved
// its bytes at its start (the kernel does not say when). So a connection is
// cut after between (1 - 1/kStallSlices) and 1 stall timeout without a byte,
// and never past the transfer's deadline: a frame or response that stops, or
// trickles, ends when its deadline says, not one stall timeout later.
constexpr double kStallSlices = 8;

SocketTimer SocketTimer::for_socket(int fd, double stall_s) {
  const double slice = stall_s / kStallSlices;
  set_timeout(fd, SO_RCVTIMEO, slice);
  set_timeout(fd, SO_SNDTIMEO, slice);
  return SocketTimer{fd, stall_s, slice, slice};
}

// Before a blocking call: throws a timeout if nothing is left of the wait,
// else makes the kernel timeout the next slice (shorter near the deadline or
// the end of the allowed silence); the common case makes no system call.
static void arm(SocketTimer& t, int option, double* current, int64_t deadline_us, int64_t last_progress_us) {
  if (t.stall_s <= 0) return;
  const int64_t now = now_us();
  double left = t.stall_s - double(now - last_progress_us) / 1e6;
  if (deadline_us > 0) left = std::min(left, double(deadline_us - now) / 1e6);
  if (left <= 0) throw ConnectionLost{true};
  const double slice = std::min(left, t.stall_s / kStallSlices);
  const double tolerance = std::max(0.002, 0.02 * slice);
  if (*current > slice + tolerance || *current < slice - tolerance) {
    set_timeout(t.fd, option, slice);
    *current = slice;
  }
}

// Reads exactly n bytes; a peer silent for the stall timeout, past
// deadline_us (0 = none), or closing mid-way throws.
void recv_exact(SocketTimer& t, void* buf, size_t n, int64_t deadline_us, ChecksumStream* landed, void* tail,
                size_t tail_n) {
  auto* p = static_cast<uint8_t*>(buf);
  auto* q = static_cast<uint8_t*>(tail);
  int64_t last_progress = now_us();
  while (n > 0 || tail_n > 0) {
    arm(t, SO_RCVTIMEO, &t.rcv_s, deadline_us, last_progress);
    const int64_t call_start = now_us();
    // The value's next piece, and the tail with it once the piece is the value's
    // last: one recvmsg brings a value and the sum that follows it.
    const size_t want = landed != nullptr ? std::min(n, kLandedChunkBytes) : n;
    iovec iov[2];
    size_t count = 0;
    if (want > 0) iov[count++] = iovec{p, want};
    if (want == n && tail_n > 0) iov[count++] = iovec{q, tail_n};
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = count;
    const ssize_t r = recvmsg(t.fd, &msg, MSG_WAITALL);
    if (r > 0) {
      const size_t into_value = std::min(size_t(r), want);
      if (landed != nullptr && into_value > 0) landed->update(p, into_value);  // just landed: still in cache
      p += into_value;
      n -= into_value;
      const size_t into_tail = size_t(r) - into_value;
      q += into_tail;
      tail_n -= into_tail;
      const bool more = n > 0 || tail_n > 0;
      last_progress = more ? call_start : now_us();  // short: the slice ran out (see SocketTimer)
      if (more) check_deadline(deadline_us);
    } else if (r == 0) {
      throw ConnectionLost{false};
    } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      throw ConnectionLost{false};
    }  // EAGAIN: a slice passed without a byte; arm() decides whether any wait is left
  }
}

// Writes every byte of iov[0..count) before deadline_us (0 = none); the
// iovecs are consumed in place.
void send_all(SocketTimer& t, iovec* iov, size_t count, int64_t deadline_us) {
  int64_t last_progress = now_us();
  while (count > 0) {
    arm(t, SO_SNDTIMEO, &t.snd_s, deadline_us, last_progress);
    const int64_t call_start = now_us();
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = count < size_t(IOV_MAX) ? count : size_t(IOV_MAX);
    ssize_t r = sendmsg(t.fd, &msg, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;  // arm() decides
      throw ConnectionLost{false};
    }
    size_t sent = size_t(r);
    size_t total = 0;
    for (size_t i = 0; i < msg.msg_iovlen; ++i) total += iov[i].iov_len;
    if (r > 0) last_progress = sent < total ? call_start : now_us();  // short: the slice ran out
    while (count > 0 && sent >= iov->iov_len) {
      sent -= iov->iov_len;
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + sent;
      iov->iov_len -= sent;
      check_deadline(deadline_us);  // a timed-out send returns its partial count
    }
  }
}

ssize_t ReadAhead::fill(int fd) {
  if (buf_.empty()) buf_.resize(kBytes);
  pos_ = end_ = 0;
  ssize_t got;
  do got = recv(fd, buf_.data(), buf_.size(), MSG_DONTWAIT);
  while (got < 0 && errno == EINTR);
  if (got > 0) end_ = size_t(got);
  return got;
}

bool ReadAhead::spin_fill(int fd, int64_t until_us) {
  do {
    const ssize_t got = fill(fd);
    if (got > 0) return true;
    if (got == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) return false;
    spin_step();
  } while (now_us() < until_us);
  return false;
}

size_t ReadAhead::take(void* out, size_t n) {
  const size_t k = std::min(n, buffered());
  if (k > 0) std::memcpy(out, buf_.data() + pos_, k);
  pos_ += k;
  return k;
}

// One recv of at least one byte and at most n, under recv_exact's stall and
// deadline rules: it returns as soon as anything has arrived.
static size_t recv_some(SocketTimer& t, void* buf, size_t n, int64_t deadline_us) {
  const int64_t started = now_us();
  for (;;) {
    arm(t, SO_RCVTIMEO, &t.rcv_s, deadline_us, started);
    const ssize_t r = recv(t.fd, buf, n, 0);
    if (r > 0) return size_t(r);
    if (r == 0) throw ConnectionLost{false};
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) throw ConnectionLost{false};
  }
}

void ReadAhead::read(SocketTimer& t, void* buf, size_t n, int64_t deadline_us, ChecksumStream* landed, void* tail,
                     size_t tail_n) {
  auto* p = static_cast<uint8_t*>(buf);
  auto* q = static_cast<uint8_t*>(tail);
  for (;;) {
    const size_t from_buffer = take(p, n);
    if (landed != nullptr && from_buffer > 0) landed->update(p, from_buffer);
    p += from_buffer;
    n -= from_buffer;
    if (n == 0) {
      const size_t k = take(q, tail_n);
      q += k;
      tail_n -= k;
    }
    if (n == 0 && tail_n == 0) return;
    // What is left is small (a small value of a batch, the rest of a header):
    // one recv into the buffer may bring it and the next ones. A large rest
    // goes straight from the socket to its place (the arena), no copy.
    if (n + tail_n >= kBytes / 2) break;
    if (buf_.empty()) buf_.resize(kBytes);
    pos_ = 0;
    end_ = recv_some(t, buf_.data(), buf_.size(), deadline_us);  // the buffer was empty: take() drained it
  }
  recv_exact(t, p, n, deadline_us, landed, q, tail_n);
}

}  // namespace gcache
