// The native client core's connection: one framed stream on a blocking socket
// whose fd Python's socket object owns (and closes). Waits are bounded by the
// socket's SO_RCVTIMEO / SO_SNDTIMEO (the client's timeout_s, lowered by
// Python near a call's deadline) and by the call's deadline, checked before
// every wait. Every failure is a CoreError the binding maps onto gcache.errors.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstdint>
#include <string>
#include <vector>

#include "client/core_framing.h"
#include "common/frame.h"

namespace gcache::client_core {

enum class ErrorKind : uint8_t {
  Timeout,      // no progress within the socket's timeout, or the call's deadline passed
  Closed,       // the peer closed the stream
  Os,           // a socket error (err)
  Protocol,     // an answer that breaks the protocol (message)
  Status,       // a non-OK frame status (status, meta: its raw map); the frame was read whole
  ArenaClosed,  // the shared-memory mapping was closed by the client
};

struct CoreError {
  ErrorKind kind = ErrorKind::Protocol;
  int err = 0;
  std::string message;
  uint32_t status = 0;
  std::vector<uint8_t> meta;
  bool in_sync = false;  // Status: the refused frame was answered whole (the stream may go on)
};

uint64_t next_request_id();
int64_t now_ns();  // steady clock

class Channel {
 public:
  explicit Channel(int fd);
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // The steady-clock time the current call must end by (0: none).
  void set_deadline(int64_t deadline_ns) { deadline_ns_ = deadline_ns; }
  // How long a wait for a quick answer polls the socket before it blocks (0: never; see wait_recv).
  void set_spin_ns(int64_t spin_ns) { spin_ns_ = spin_ns < 0 ? 0 : spin_ns; }
  int64_t spin_ns() const { return spin_ns_; }
  // The next request's answer comes within microseconds (few keys, little payload:
  // quick_call in core_ops.h): waiting for it spins first. Cleared by every send.
  void expect_quick_answer() { quick_next_ = true; }
  int fd() const { return fd_; }

  // Sends every byte of iov (consumed in place).
  bool send(std::vector<iovec>& iov, CoreError* e);
  // Reads the answer to (request_id, op): header, then its map parsed into *fields.
  // A non-OK status is a Status error (payload, if any, skipped so the stream stays in sync).
  bool read_reply(uint64_t request_id, Opcode op, FrameHeader* header, ReplyFields* fields, CoreError* e);
  // Fills every iovec in order: buffered bytes first, then scatter reads straight into them.
  bool read_into(std::vector<iovec>& iov, CoreError* e);
  bool skip(uint64_t n, CoreError* e);
  // Bytes read from the socket past the last answer (must be 0 when a call ends).
  size_t buffered() const { return end_ - pos_; }

 private:
  bool fill(size_t need, CoreError* e);  // at least `need` bytes buffered
  bool before_wait(CoreError* e);
  ssize_t wait_recv(void* into, size_t n);  // recv of at least one byte, spinning first when armed
  bool io_failed(bool sending, CoreError* e);

  int fd_;
  int64_t deadline_ns_ = 0;
  int64_t spin_ns_ = 0;
  bool quick_next_ = false;  // expect_quick_answer(), for the next send
  bool spin_armed_ = false;  // the last request's answer is near: waits for it spin first
  uint8_t* buf_;
  size_t cap_;
  size_t pos_ = 0, end_ = 0;
};

}  // namespace gcache::client_core
