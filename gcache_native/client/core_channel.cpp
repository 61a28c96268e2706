#include "client/core_channel.h"

#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "common/spin_step.h"

namespace gcache::client_core {

namespace {
// One read takes a whole small answer (header, map, a few KiB of inline values).
constexpr size_t kReadBufferBytes = 64 << 10;
constexpr uint32_t kMetaBytesMax = 16 << 20;  // the protocol's limit on a map (META_BYTES_MAX)
// Values left to read at least this large go straight into their targets.
constexpr size_t kDirectReadBytesMin = 16 << 10;
std::atomic<uint64_t> request_ids{uint64_t(1) << 62};  // apart from the Python client's counter

// After a partial sendmsg / recvmsg of `moved` bytes: skip the iovecs it finished, trim the next.
void advance(std::vector<iovec>& iov, size_t* first, size_t moved) {
  while (*first < iov.size() && moved >= iov[*first].iov_len) moved -= iov[(*first)++].iov_len;
  if (*first < iov.size()) {
    iov[*first].iov_base = static_cast<uint8_t*>(iov[*first].iov_base) + moved;
    iov[*first].iov_len -= moved;
  }
}

}  // namespace

uint64_t next_request_id() { return request_ids.fetch_add(1, std::memory_order_relaxed); }

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Channel::Channel(int fd) : fd_(fd) {
  cap_ = kReadBufferBytes;
  buf_ = static_cast<uint8_t*>(std::malloc(cap_));
  if (buf_ == nullptr) throw std::bad_alloc();
}

Channel::~Channel() { std::free(buf_); }

bool Channel::before_wait(CoreError* e) {
  if (deadline_ns_ != 0 && now_ns() >= deadline_ns_) {
    e->kind = ErrorKind::Timeout;
    e->message = "the call's deadline passed";
    return false;
  }
  return true;
}

bool Channel::io_failed(bool sending, CoreError* e) {
  if (errno == EAGAIN || errno == EWOULDBLOCK) {
    e->kind = ErrorKind::Timeout;  // SO_RCVTIMEO / SO_SNDTIMEO ran out without progress
    return false;
  }
  e->kind = ErrorKind::Os;
  e->err = errno;
  e->message = std::string(sending ? "send: " : "receive: ") + std::strerror(errno);
  return false;
}

bool Channel::send(std::vector<iovec>& iov, CoreError* e) {
  spin_armed_ = spin_ns_ > 0 && quick_next_;
  quick_next_ = false;
  size_t first = 0;
  while (first < iov.size() && iov[first].iov_len == 0) ++first;
  while (first < iov.size()) {
    if (!before_wait(e)) return false;
    msghdr msg{};
    msg.msg_iov = &iov[first];
    msg.msg_iovlen = std::min(iov.size() - first, size_t(IOV_MAX));
    const ssize_t r = sendmsg(fd_, &msg, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR) continue;
      return io_failed(true, e);
    }
    advance(iov, &first, size_t(r));
  }
  return true;
}

bool Channel::fill(size_t need, CoreError* e) {
  if (end_ - pos_ >= need) return true;
  if (need > cap_) {  // a large map: grow once for it
    uint8_t* bigger = static_cast<uint8_t*>(std::realloc(buf_, need));
    if (bigger == nullptr) throw std::bad_alloc();
    buf_ = bigger;
    cap_ = need;
  }
  if (pos_ + need > cap_) {
    std::memmove(buf_, buf_ + pos_, end_ - pos_);
    end_ -= pos_;
    pos_ = 0;
  }
  while (end_ - pos_ < need) {
    if (!before_wait(e)) return false;
    const ssize_t r = wait_recv(buf_ + end_, cap_ - end_);
    if (r < 0) {
      if (errno == EINTR) continue;
      return io_failed(false, e);
    }
    if (r == 0) {
      e->kind = ErrorKind::Closed;
      return false;
    }
    end_ += size_t(r);
  }
  return true;
}

// The answer to a small request comes within microseconds; a thread that blocks in recv for
// it pays the kernel's sleep and wake-up, most of a small call's time. So first poll the socket
// without blocking for up to spin_ns_ (a bounded spin), then block as usual. Only for a quick
// answer (expect_quick_answer): a batch's answer takes longer than a spin lasts, and a thread
// spinning for it would take the core the node or the copy threads need.
ssize_t Channel::wait_recv(void* into, size_t n) {
  if (spin_armed_) {
    const int64_t until = now_ns() + spin_ns_;
    do {
      const ssize_t r = recv(fd_, into, n, MSG_DONTWAIT);
      if (r >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return r;
      spin_step();
    } while (now_ns() < until);
    spin_armed_ = false;  // it did not come in time: block for the rest of this answer
  }
  return recv(fd_, into, n, 0);
}

bool Channel::read_reply(uint64_t request_id, Opcode op, FrameHeader* h, ReplyFields* fields, CoreError* e) {
  if (!fill(kFrameHeaderBytes, e)) return false;
  *h = parse_frame_header(buf_ + pos_);
  pos_ += kFrameHeaderBytes;
  if (!frame_magic_ok(*h) || h->version != kProtocolVersion) {
    e->kind = ErrorKind::Protocol;
    e->message = "the server sent a frame with a bad magic or version: is that port a GCache v1 server?";
    return false;
  }
  if (h->meta_len > kMetaBytesMax) {
    e->kind = ErrorKind::Protocol;
    e->message = "the server sent " + std::to_string(h->meta_len) + " B of metadata, over the limit";
    return false;
  }
  if (!fill(h->meta_len, e)) return false;
  const uint8_t* meta = buf_ + pos_;
  pos_ += h->meta_len;
  if (h->status != uint32_t(FrameStatus::Ok)) {
    e->kind = ErrorKind::Status;
    e->status = h->status;
    e->meta.assign(meta, meta + h->meta_len);
    e->in_sync = h->request_id == request_id && h->opcode == uint8_t(op);
    if (h->payload_len != 0 && !skip(h->payload_len, e)) return false;
    e->kind = ErrorKind::Status;
    return false;
  }
  if (h->request_id != request_id || h->opcode != uint8_t(op) || !(h->flags & kFlagResponse)) {
    e->kind = ErrorKind::Protocol;
    e->message = "the server answered request " + std::to_string(h->request_id) + " op " + std::to_string(h->opcode) +
                 ", expected " + std::to_string(request_id) + " op " + std::to_string(int(op)) +
                 ": responses are out of order";
    return false;
  }
  std::string error;
  if (!parse_reply(meta, h->meta_len, fields, &error)) {
    e->kind = ErrorKind::Protocol;
    e->message = "frame metadata is not valid msgpack: " + error;
    return false;
  }
  return true;
}

bool Channel::read_into(std::vector<iovec>& iov, CoreError* e) {
  size_t first = 0;
  size_t left = 0;
  for (const iovec& v : iov) left += v.iov_len;
  // Buffered bytes first.
  while (first < iov.size() && pos_ < end_) {
    const size_t n = std::min(iov[first].iov_len, end_ - pos_);
    std::memcpy(iov[first].iov_base, buf_ + pos_, n);
    pos_ += n;
    left -= n;
    iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + n;
    iov[first].iov_len -= n;
    if (iov[first].iov_len == 0) ++first;
  }
  if (left == 0) return true;
  if (left < kDirectReadBytesMin) {  // a little left: through the buffer (one recv may bring the next answer too)
    if (!fill(left, e)) return false;
    for (; first < iov.size(); ++first) {
      std::memcpy(iov[first].iov_base, buf_ + pos_, iov[first].iov_len);
      pos_ += iov[first].iov_len;
    }
    return true;
  }
  pos_ = end_ = 0;
  while (first < iov.size()) {
    if (iov[first].iov_len == 0) {
      ++first;
      continue;
    }
    if (!before_wait(e)) return false;
    msghdr msg{};
    msg.msg_iov = &iov[first];
    msg.msg_iovlen = std::min(iov.size() - first, size_t(IOV_MAX));
    const ssize_t r = recvmsg(fd_, &msg, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return io_failed(false, e);
    }
    if (r == 0) {
      e->kind = ErrorKind::Closed;
      return false;
    }
    advance(iov, &first, size_t(r));
  }
  return true;
}

bool Channel::skip(uint64_t n, CoreError* e) {
  while (n > 0) {
    if (pos_ == end_) {
      pos_ = end_ = 0;
      if (!fill(1, e)) return false;
    }
    const size_t step = size_t(std::min<uint64_t>(n, end_ - pos_));
    pos_ += step;
    n -= step;
  }
  return true;
}

}  // namespace gcache::client_core
