// Client-side socket helpers: scatter/gather send and receive over Python
// buffer objects with the GIL released, so payload bytes never become
// Python bytes objects. Work on blocking and non-blocking fds alike.
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <vector>

#include "common/checksum.h"

namespace py = pybind11;

namespace {

enum class IoResult { Done, Timeout, Closed, Error };

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Waits for `events` until the deadline (deadline < 0: forever).
IoResult wait_fd(int fd, short events, int64_t deadline_ms) {
  for (;;) {
    int timeout = -1;
    if (deadline_ms >= 0) {
      const int64_t left = deadline_ms - now_ms();
      if (left <= 0) return IoResult::Timeout;
      timeout = left > INT_MAX ? INT_MAX : int(left);
    }
    pollfd p{fd, events, 0};
    const int r = poll(&p, 1, timeout);
    if (r > 0) return IoResult::Done;
    if (r == 0) return IoResult::Timeout;
    if (errno != EINTR) return IoResult::Error;
  }
}

// Moves every byte of iov through the socket; the iovecs are consumed in place.
IoResult transfer(int fd, std::vector<iovec>& iov, bool sending, int64_t timeout_ms, int* err) {
  const int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
  size_t first = 0;
  while (first < iov.size() && iov[first].iov_len == 0) ++first;
  while (first < iov.size()) {
    msghdr msg{};
    msg.msg_iov = &iov[first];
    const size_t left = iov.size() - first;
    msg.msg_iovlen = left < size_t(IOV_MAX) ? left : size_t(IOV_MAX);
    const ssize_t r = sending ? sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT) : recvmsg(fd, &msg, MSG_DONTWAIT);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        const IoResult w = wait_fd(fd, sending ? POLLOUT : POLLIN, deadline);
        if (w == IoResult::Done) continue;
        if (w == IoResult::Error) *err = errno;
        return w;
      }
      *err = errno;
      return IoResult::Error;
    }
    if (r == 0 && !sending) return IoResult::Closed;
    size_t moved = size_t(r);
    while (first < iov.size() && moved >= iov[first].iov_len) {
      moved -= iov[first].iov_len;
      ++first;
    }
    if (first < iov.size()) {
      iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + moved;
      iov[first].iov_len -= moved;
    }
  }
  return IoResult::Done;
}

size_t collect(const py::list& buffers, bool writable, std::vector<py::buffer_info>* infos, std::vector<iovec>* iov) {
  size_t total = 0;
  infos->reserve(buffers.size());
  iov->reserve(buffers.size());
  for (py::handle h : buffers) {
    py::buffer b = py::reinterpret_borrow<py::buffer>(h);
    infos->push_back(b.request(writable));
    py::buffer_info& info = infos->back();
    if (!PyBuffer_IsContiguous(info.view(), 'A'))
      throw py::value_error("every buffer must be contiguous (pass a memoryview slice of one)");
    const size_t n = size_t(info.size) * size_t(info.itemsize);
    iov->push_back(iovec{info.ptr, n});
    total += n;
  }
  return total;
}

void raise_unless_done(IoResult r, int err, bool sending, int64_t timeout_ms);

size_t run(int fd, const py::list& buffers, int64_t timeout_ms, bool sending) {
  std::vector<py::buffer_info> infos;  // keeps each buffer's export alive
  std::vector<iovec> iov;
  const size_t total = collect(buffers, !sending, &infos, &iov);
  int err = 0;
  IoResult r;
  // Not gil_scoped_release: its noexcept destructor turns the forced unwind
  // that ends a daemon thread at interpreter exit into std::terminate.
  PyThreadState* saved = PyEval_SaveThread();
  r = transfer(fd, iov, sending, timeout_ms, &err);  // never throws
  PyEval_RestoreThread(saved);
  raise_unless_done(r, err, sending, timeout_ms);
  return total;
}

void raise_unless_done(IoResult r, int err, bool sending, int64_t timeout_ms) {
  const char* what = sending ? "send" : "receive";
  switch (r) {
    case IoResult::Done: return;
    case IoResult::Timeout:
      PyErr_SetString(PyExc_TimeoutError, (std::string(what) + " timed out after " + std::to_string(timeout_ms) +
                                           " ms; the peer is stalled or the timeout is too short")
                                              .c_str());
      throw py::error_already_set();
    case IoResult::Closed:
      PyErr_SetString(PyExc_ConnectionError, "the peer closed the connection mid-frame; reconnect and retry");
      throw py::error_already_set();
    case IoResult::Error: break;
  }
  errno = err;
  PyErr_SetFromErrno(err == ECONNRESET || err == EPIPE ? PyExc_ConnectionError : PyExc_OSError);
  throw py::error_already_set();
}

// A PUT_BATCH payload with "trail": each value, then its checksum (8 bytes,
// little-endian). Values are hashed group by group just before the group is
// sent, so the kernel's copy reads bytes the hash has just brought into
// cache: one pass over memory per byte, not a hashing pass and a sending pass.
constexpr size_t kHashedGroupBytes = 1 << 20;  // inside L2 (2 MiB a core here)

IoResult send_hashed(int fd, const iovec& head, std::vector<py::buffer_info>& infos, gcache::ChecksumKind kind,
                     int64_t timeout_ms, int* err) {
  const int64_t start = now_ms();
  auto left_ms = [&] { return timeout_ms < 0 ? int64_t(-1) : std::max<int64_t>(0, start + timeout_ms - now_ms()); };
  std::vector<uint64_t> sums(infos.size());  // addresses stay put: the iovecs point at them
  std::vector<iovec> iov{head};
  size_t group_bytes = head.iov_len;
  for (size_t i = 0; i < infos.size(); ++i) {
    const size_t n = size_t(infos[i].size) * size_t(infos[i].itemsize);
    sums[i] = gcache::checksum_of(kind, infos[i].ptr, n);  // little-endian host: the wire's byte order
    iov.push_back(iovec{infos[i].ptr, n});
    iov.push_back(iovec{&sums[i], 8});
    group_bytes += n + 8;
    if (group_bytes >= kHashedGroupBytes || i + 1 == infos.size()) {
      const IoResult r = transfer(fd, iov, true, left_ms(), err);
      if (r != IoResult::Done) return r;
      iov.clear();
      group_bytes = 0;
    }
  }
  if (!iov.empty()) return transfer(fd, iov, true, left_ms(), err);
  return IoResult::Done;
}

}  // namespace

void bind_io(py::module_& m) {
  m.def(
      "send_put_hashed",
      [](int fd, py::buffer head, py::list values, int kind, int64_t timeout_ms) {
        if (!gcache::checksum_kind_valid(uint64_t(kind))) throw py::value_error("unknown checksum kind");
        py::buffer_info head_info = head.request();
        std::vector<py::buffer_info> infos;
        std::vector<iovec> unused;
        const size_t total = collect(values, false, &infos, &unused);
        int err = 0;
        PyThreadState* saved = PyEval_SaveThread();  // see run(): not gil_scoped_release
        const IoResult r = send_hashed(fd, iovec{head_info.ptr, size_t(head_info.size)}, infos,
                                       gcache::ChecksumKind(kind), timeout_ms, &err);
        PyEval_RestoreThread(saved);
        raise_unless_done(r, err, true, timeout_ms);
        return size_t(head_info.size) + total + 8 * infos.size();
      },
      py::arg("fd"), py::arg("head"), py::arg("values"), py::arg("kind"), py::arg("timeout_ms") = -1,
      R"doc(Sends `head` (frame header + metadata), then each value followed by its checksum of `kind`
(8 bytes little-endian: a PUT_BATCH with "trail"), hashing each group of values just before
sending it (GIL released). Returns the bytes sent; raises as send_buffers.)doc");
  m.def(
      "send_buffers", [](int fd, py::list buffers, int64_t timeout_ms) { return run(fd, buffers, timeout_ms, true); },
      py::arg("fd"), py::arg("buffers"), py::arg("timeout_ms") = -1,
      R"doc(Sends every byte of every buffer, in order, on socket `fd` (sendmsg, GIL released).

buffers: list of contiguous buffer-protocol objects (bytes, memoryview, numpy).
timeout_ms: overall deadline; negative = none. Returns the bytes sent.
Raises TimeoutError, ConnectionError (peer reset) or OSError. On error a
prefix of the data may have been sent: the connection is unusable.)doc");
  m.def(
      "recv_into_buffers",
      [](int fd, py::list buffers, int64_t timeout_ms) { return run(fd, buffers, timeout_ms, false); }, py::arg("fd"),
      py::arg("buffers"), py::arg("timeout_ms") = -1,
      R"doc(Fills every writable buffer exactly, in order, from socket `fd` (recvmsg, GIL released).

buffers: list of contiguous writable buffers (bytearray, memoryview, numpy).
timeout_ms: overall deadline; negative = none. Returns the bytes received.
Raises TimeoutError, ConnectionError (peer closed mid-way) or OSError; then
the buffers hold partial data and the connection is unusable.)doc");
}
