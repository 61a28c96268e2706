// The native client core's Python face (gcache.client.native_core uses it):
// CoreConnection (one per pooled connection; the socket stays Python's) and
// CoreArena (a server's arena, mapped once per server instance). Each call
// runs one request frame with the GIL released from the first byte sent to
// the last byte copied; failures raise CoreError(kind, message, errno, status,
// meta, in_sync), which gcache.client.native_core maps onto gcache.errors.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <memory>

#include "client/core_channel.h"
#include "client/core_ops.h"

namespace py = pybind11;
using namespace gcache::client_core;

namespace {

PyObject* core_error_type = nullptr;

const char* kind_name(ErrorKind k) {
  switch (k) {
    case ErrorKind::Timeout: return "timeout";
    case ErrorKind::Closed: return "closed";
    case ErrorKind::Os: return "os";
    case ErrorKind::Protocol: return "protocol";
    case ErrorKind::Status: return "status";
    case ErrorKind::ArenaClosed: return "arena_closed";
  }
  return "protocol";
}

[[noreturn]] void raise_core_error(const CoreError& e) {
  py::tuple args = py::make_tuple(kind_name(e.kind), e.message, e.err, e.status,
                                  py::bytes(reinterpret_cast<const char*>(e.meta.data()), e.meta.size()), e.in_sync);
  PyErr_SetObject(core_error_type, args.ptr());
  throw py::error_already_set();
}

// Runs f without the GIL (PyEval_SaveThread, not gil_scoped_release: see client/io_bindings.cpp).
template <class F>
bool without_gil(F&& f) {
  PyThreadState* saved = PyEval_SaveThread();
  bool ok;
  try {
    ok = f();
  } catch (...) {
    PyEval_RestoreThread(saved);
    throw;
  }
  PyEval_RestoreThread(saved);
  return ok;
}

Keys key_views(const py::list& keys) {
  Keys out;
  out.reserve(keys.size());
  for (py::handle k : keys) {
    if (!PyBytes_Check(k.ptr())) throw py::type_error("keys must be bytes (normalized)");
    out.emplace_back(PyBytes_AS_STRING(k.ptr()), size_t(PyBytes_GET_SIZE(k.ptr())));
  }
  return out;
}

// Buffers as iovecs; `views` keeps each export alive until the call ends.
struct Buffers {
  std::vector<Py_buffer> views;
  std::vector<iovec> iov;
  Buffers(const py::list& objects, bool writable) {
    views.reserve(objects.size());
    iov.reserve(objects.size());
    for (py::handle h : objects) {
      Py_buffer b;
      if (PyObject_GetBuffer(h.ptr(), &b, writable ? PyBUF_WRITABLE | PyBUF_ANY_CONTIGUOUS : PyBUF_ANY_CONTIGUOUS) != 0)
        throw py::error_already_set();
      views.push_back(b);
      iov.push_back(iovec{b.buf, size_t(b.len)});
    }
  }
  ~Buffers() {
    for (Py_buffer& b : views) PyBuffer_Release(&b);
  }
};

int64_t deadline_from(double left_s) {
  if (!(left_s >= 0) || std::isinf(left_s)) return 0;  // none
  return now_ns() + int64_t(left_s * 1e9) + 1;
}

class CoreConnection {
 public:
  explicit CoreConnection(int fd) : ch_(fd) {}

  // (values, too_small [(index, size)], bad [index]): values are int sizes (into targets) or
  // bytes (targets None), None for a miss; a too-small or bad one is None too.
  py::tuple get(const py::list& keys, const py::object& targets, bool verify, int64_t epoch, double deadline_left_s,
                const std::shared_ptr<CoreArena>& arena, double trusted_s, int threads) {
    const Keys k = key_views(keys);
    const size_t n = k.size();
    std::unique_ptr<Buffers> into;
    ValueSink sink;
    std::vector<PyObject*> made(n, nullptr);  // new bytes objects (owned) in bytes mode
    bool out_of_memory = false;
    if (!targets.is_none()) {
      into = std::make_unique<Buffers>(py::reinterpret_borrow<py::list>(targets), true);
      if (into->iov.size() != n) throw py::value_error("one target per key");
      sink.targets = into->iov;
    }
    GetAnswer answer;
    CoreError error;
    ch_.set_deadline(deadline_from(deadline_left_s));
    PyThreadState* saved = nullptr;
    if (targets.is_none()) {
      // Bytes mode: the GIL is taken back just to make the bytes objects once the sizes are known.
      sink.allocate = [&made, &out_of_memory, &saved](const std::vector<int64_t>& sizes, std::vector<uint8_t*>* dests) {
        PyEval_RestoreThread(saved);
        for (size_t j = 0; j < sizes.size(); ++j) {
          if (sizes[j] < 0) continue;
          // Filled before anyone else can see it (the C API allows this for a new object).
          PyObject* raw = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(sizes[j]));
          if (raw == nullptr) {
            PyErr_Clear();
            out_of_memory = true;
            continue;
          }
          made[j] = raw;
          (*dests)[j] = reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(raw));
        }
        saved = PyEval_SaveThread();
      };
    }
    saved = PyEval_SaveThread();
    bool ok;
    try {
      ok = arena ? shm_get(ch_, *arena, ShmOptions{trusted_s, threads}, k, sink, verify, epoch, &answer, &error)
                 : tcp_get(ch_, k, sink, verify, epoch, &answer, &error);
    } catch (...) {
      PyEval_RestoreThread(saved);
      for (PyObject* o : made) Py_XDECREF(o);
      throw;
    }
    PyEval_RestoreThread(saved);
    if (!ok || out_of_memory) {
      for (PyObject* o : made) Py_XDECREF(o);
      if (!ok) raise_core_error(error);
      throw std::bad_alloc();
    }
    py::list values(n), too_small, bad;
    for (size_t j = 0; j < n; ++j) {
      PyObject* value = Py_None;
      switch (answer.outcome[j]) {
        case Outcome::Hit:
          value = made[j] != nullptr ? made[j] : PyLong_FromLongLong(answer.sizes[j]);
          made[j] = nullptr;
          break;
        case Outcome::TooSmall: too_small.append(py::make_tuple(j, answer.sizes[j])); break;
        case Outcome::BadChecksum: bad.append(j); break;
        case Outcome::Miss: break;
      }
      if (value == Py_None) Py_INCREF(Py_None);
      PyList_SET_ITEM(values.ptr(), Py_ssize_t(j), value);  // steals the reference
    }
    for (PyObject* o : made) Py_XDECREF(o);  // found, then refused (bad checksum)
    return py::make_tuple(values, too_small, bad);
  }

  // The one-key calls (get_one, exists_one) read through this arena: bound once per
  // connection, so a call passes only what changes per call.
  void bind_arena(const std::shared_ptr<CoreArena>& arena, double trusted_s, int threads) {
    arena_ = arena;
    shm_ = ShmOptions{trusted_s, threads};
  }

  // One key's value as bytes, None on a miss, False when its bytes failed their checksum:
  // get() of one key with no lists built or taken apart on either side.
  py::object get_one(const py::bytes& key, bool verify, int64_t epoch, double deadline_left_s) {
    const Keys k{std::string_view(PyBytes_AS_STRING(key.ptr()), size_t(PyBytes_GET_SIZE(key.ptr())))};
    PyObject* made = nullptr;
    bool out_of_memory = false;
    PyThreadState* saved = nullptr;
    ValueSink sink;
    sink.allocate = [&made, &out_of_memory, &saved](const std::vector<int64_t>& sizes, std::vector<uint8_t*>* dests) {
      if (sizes[0] < 0) return;
      PyEval_RestoreThread(saved);  // the GIL just to make the bytes object
      made = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(sizes[0]));
      if (made == nullptr) {
        PyErr_Clear();
        out_of_memory = true;
      } else {
        (*dests)[0] = reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(made));
      }
      saved = PyEval_SaveThread();
    };
    GetAnswer answer;
    CoreError error;
    ch_.set_deadline(deadline_from(deadline_left_s));
    saved = PyEval_SaveThread();
    bool ok;
    try {
      ok = arena_ ? shm_get(ch_, *arena_, shm_, k, sink, verify, epoch, &answer, &error)
                  : tcp_get(ch_, k, sink, verify, epoch, &answer, &error);
    } catch (...) {
      PyEval_RestoreThread(saved);
      Py_XDECREF(made);
      throw;
    }
    PyEval_RestoreThread(saved);
    py::object value = py::reinterpret_steal<py::object>(made);  // owned from here
    if (!ok) raise_core_error(error);
    if (out_of_memory) throw std::bad_alloc();
    switch (answer.outcome[0]) {
      case Outcome::Hit: return value;
      case Outcome::BadChecksum: return py::bool_(false);
      default: return py::none();
    }
  }

  bool exists_one(const py::bytes& key, int64_t epoch, double deadline_left_s) {
    const Keys k{std::string_view(PyBytes_AS_STRING(key.ptr()), size_t(PyBytes_GET_SIZE(key.ptr())))};
    std::vector<uint8_t> present;
    int64_t prefix = 0;
    CoreError error;
    ch_.set_deadline(deadline_from(deadline_left_s));
    if (!without_gil([&] { return tcp_exists(ch_, k, epoch, &present, &prefix, &error); })) raise_core_error(error);
    return present[0] != 0;
  }

  // (per-key put statuses, the answer named its checksum kind)
  py::tuple put(const py::list& keys, const py::list& values, int kind, int64_t epoch, const py::bytes& extra,
                uint32_t extra_count, double deadline_left_s, const std::shared_ptr<CoreArena>& arena, bool first,
                bool last, int threads) {
    if (!gcache::checksum_kind_valid(uint64_t(kind))) throw py::value_error("unknown checksum kind");
    const Keys k = key_views(keys);
    Buffers from(values, false);
    if (from.iov.size() != k.size()) throw py::value_error("one value per key");
    const std::string_view extra_bytes(PyBytes_AS_STRING(extra.ptr()), size_t(PyBytes_GET_SIZE(extra.ptr())));
    const ExtraEntries extras{extra_bytes, extra_count};
    PutAnswer answer;
    CoreError error;
    ch_.set_deadline(deadline_from(deadline_left_s));
    const bool ok = without_gil([&] {
      return arena ? shm_put(ch_, *arena, ShmOptions{0, threads}, k, from.iov, gcache::ChecksumKind(kind), epoch,
                             extras, first, last, &answer, &error)
                   : tcp_put(ch_, k, from.iov, gcache::ChecksumKind(kind), epoch, extras, &answer, &error);
    });
    if (!ok) raise_core_error(error);
    return py::make_tuple(py::cast(answer.st), answer.ck);
  }

  // (per-key bools, leading keys present)
  py::tuple exists(const py::list& keys, int64_t epoch, double deadline_left_s) {
    const Keys k = key_views(keys);
    std::vector<uint8_t> present;
    int64_t prefix = 0;
    CoreError error;
    ch_.set_deadline(deadline_from(deadline_left_s));
    if (!without_gil([&] { return tcp_exists(ch_, k, epoch, &present, &prefix, &error); })) raise_core_error(error);
    py::list flags(present.size());
    for (size_t j = 0; j < present.size(); ++j) flags[j] = py::bool_(present[j] != 0);
    return py::make_tuple(flags, prefix);
  }

  std::vector<int64_t> remove(const py::list& keys, int64_t epoch, double deadline_left_s) {
    const Keys k = key_views(keys);
    std::vector<int64_t> st;
    CoreError error;
    ch_.set_deadline(deadline_from(deadline_left_s));
    if (!without_gil([&] { return tcp_remove(ch_, k, epoch, &st, &error); })) raise_core_error(error);
    return st;
  }

  size_t buffered() const { return ch_.buffered(); }
  double spin_us() const { return double(ch_.spin_ns()) / 1e3; }
  void set_spin_us(double us) {
    if (!(us >= 0 && us <= 10000)) throw py::value_error("spin_us must be in [0, 10000]");
    ch_.set_spin_ns(int64_t(us * 1e3));
  }

 private:
  Channel ch_;
  std::shared_ptr<CoreArena> arena_;  // bind_arena (shm); null: tcp
  ShmOptions shm_;
};

}  // namespace

void bind_client_core(py::module_& m) {
  static py::exception<void> error_type(m, "CoreError", PyExc_Exception);
  core_error_type = error_type.ptr();
  py::class_<CoreArena, std::shared_ptr<CoreArena>>(m, "CoreArena",
                                                    "A server's arena mapped read-write from its memfd (native core).")
      .def(py::init<int, uint64_t>(), py::arg("fd"), py::arg("size"))
      .def("close", &CoreArena::close, "Refuses later copies; unmapped once no holder is left.")
      .def_property_readonly("closed", &CoreArena::closing)
      .def_property_readonly("size", &CoreArena::size);
  const std::shared_ptr<CoreArena> none;
  py::class_<CoreConnection>(m, "CoreConnection", "The native client core on one connection's socket fd.")
      .def(py::init<int>(), py::arg("fd"))
      .def("get", &CoreConnection::get, py::arg("keys"), py::arg("targets"), py::arg("verify"), py::arg("epoch"),
           py::arg("deadline_left_s"), py::arg("arena") = none, py::arg("trusted_s") = 0.0, py::arg("threads") = 0)
      .def("put", &CoreConnection::put, py::arg("keys"), py::arg("values"), py::arg("kind"), py::arg("epoch"),
           py::arg("extra") = py::bytes(), py::arg("extra_count") = 0, py::arg("deadline_left_s") = -1.0,
           py::arg("arena") = none, py::arg("first") = true, py::arg("last") = true, py::arg("threads") = 0)
      .def("bind_arena", &CoreConnection::bind_arena, py::arg("arena"), py::arg("trusted_s"), py::arg("threads"),
           "The arena get_one reads through (shm connections), bound once.")
      .def("get_one", &CoreConnection::get_one, "key, verify, epoch, deadline_left_s -> bytes | None | False (bad sum)")
      .def("exists_one", &CoreConnection::exists_one, "key, epoch, deadline_left_s -> bool")
      .def("exists", &CoreConnection::exists, py::arg("keys"), py::arg("epoch"), py::arg("deadline_left_s"))
      .def("remove", &CoreConnection::remove, py::arg("keys"), py::arg("epoch"), py::arg("deadline_left_s"))
      .def_property_readonly("buffered", &CoreConnection::buffered,
                             "Bytes read past the last answer (0 between calls).")
      .def_property("spin_us", &CoreConnection::spin_us, &CoreConnection::set_spin_us,
                    "How long the wait for a small request's answer polls before it blocks (0: never).");
}
