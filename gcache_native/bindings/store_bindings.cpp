// gcache._native.Store: the storage engine for tests and tools (the data
// server calls the C++ API directly). Every store call releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>

#include "common/checksum.h"
#include "store/store.h"

namespace py = pybind11;
using namespace gcache;

namespace {

// Owns the Store and its Metrics. Lease objects share it, so the arena stays
// mapped while any of them (or a memoryview of one) is alive.
struct StoreHandle {
  Metrics metrics;
  std::unique_ptr<Store> store;
  std::atomic<int64_t> lease_objects{0};  // alive PyLease objects (they may export views)
  std::atomic<int64_t> leases_held{0};    // of those, not yet released
  bool closing = false;                   // close() ran; destroy when the last PyLease dies

  Store& get() {
    if (!store || closing) throw std::runtime_error("Store is closed");
    return *store;
  }
};

struct PyLease {
  std::shared_ptr<StoreHandle> handle;
  Lease lease;
  bool held = true;

  PyLease(std::shared_ptr<StoreHandle> h, const Lease& l) : handle(std::move(h)), lease(l) {
    ++handle->lease_objects;
    ++handle->leases_held;
  }
  ~PyLease() {
    release();
    if (--handle->lease_objects == 0 && handle->closing) {
      py::gil_scoped_release nogil;
      handle->store.reset();  // deferred close: no view into the arena is left
    }
  }
  void release() {
    if (!held) return;
    held = false;
    --handle->leases_held;
    py::gil_scoped_release nogil;
    handle->store->release(lease);
  }
};

struct PyStore {
  std::shared_ptr<StoreHandle> handle = std::make_shared<StoreHandle>();

  PyStore(uint64_t memory_bytes, uint64_t disk_bytes, const std::string& data_dir, uint64_t segment_bytes,
          uint64_t value_bytes_max, double small_queue_fraction, uint32_t eviction_attempts_max, bool warm_restart,
          const std::string& eviction_policy, double eviction_ghost_factor, double eviction_fresh_weight,
          bool eviction_tail_hint, bool disk_exclusive, uint64_t index_bytes_max) {
    StoreConfig config;
    config.memory_bytes = memory_bytes;
    config.disk_bytes = disk_bytes;
    config.data_dir = data_dir;
    config.segment_bytes = segment_bytes;
    config.value_bytes_max = value_bytes_max;
    config.eviction.kind = policy_kind_from_name(eviction_policy);  // invalid_argument -> ValueError
    config.eviction.small_queue_fraction = small_queue_fraction;
    config.eviction.ghost_factor = eviction_ghost_factor;
    config.eviction.fresh_weight = eviction_fresh_weight;
    config.eviction.chain_tail_hint = eviction_tail_hint;
    config.eviction_attempts_max = eviction_attempts_max;
    config.warm_restart = warm_restart;
    config.index_bytes_max = index_bytes_max;
    config.disk_exclusive = disk_exclusive;
    validate_eviction_config(config.eviction);
    py::gil_scoped_release nogil;
    handle->store = std::make_unique<Store>(config, &handle->metrics);
  }

  // begin_put + copy + commit_put of one value, GIL released by the caller.
  static int put_one(Store& store, const std::string& k, const uint8_t* data, uint64_t length, const PutHint& hint) {
    Reservation r;
    PutStatus status = store.begin_put(k, length, &r, hint.owner);
    if (status != PutStatus::Stored) return static_cast<int>(status);
    if (length > 0) memcpy(r.data, data, length);
    const ValueChecksum sum{checksum_of(kChecksumKindNew, data, length), kChecksumKindNew};
    return static_cast<int>(store.commit_put(k, r, sum, hint));
  }

  static py::buffer_info contiguous(const py::buffer& value, const char* what) {
    py::buffer_info info = value.request();
    if (!PyBuffer_IsContiguous(info.view(), 'C'))
      throw std::invalid_argument(std::string(what) + ": value must be a contiguous buffer");
    return info;
  }

  // An explicit checksum is of kind checksum_kind (0 xxh64, 1 xxh3); without one, XXH3 of the value.
  int put(const py::bytes& key, const py::buffer& value, py::object checksum, OwnerId owner, int checksum_kind) {
    if (!checksum_kind_valid(uint64_t(checksum_kind))) throw std::invalid_argument("put: unknown checksum_kind");
    std::string k = key;
    py::buffer_info info = contiguous(value, "put");
    const uint8_t* data = static_cast<const uint8_t*>(info.ptr);
    uint64_t length = static_cast<uint64_t>(info.size * info.itemsize);
    bool explicit_checksum = !checksum.is_none();
    ValueChecksum sum{explicit_checksum ? checksum.cast<uint64_t>() : 0,
                      explicit_checksum ? ChecksumKind(checksum_kind) : kChecksumKindNew};
    Store& store = handle->get();
    py::gil_scoped_release nogil;
    if (!explicit_checksum) sum.sum = checksum_of(sum.kind, data, length);
    Reservation r;
    PutStatus status = store.begin_put(k, length, &r, owner);
    if (status != PutStatus::Stored) return static_cast<int>(status);
    if (length > 0) memcpy(r.data, data, length);
    return static_cast<int>(store.commit_put(k, r, sum, PutHint{0, false, owner}));
  }

  // What the data server does for one PUT_BATCH: the values are one chain, in order.
  // `worth`: per key (ValueKind, recompute cost), as a PUT's "worth" field.
  std::vector<int> put_batch(const std::vector<py::bytes>& keys, const std::vector<py::buffer>& values, OwnerId owner,
                             const std::optional<std::vector<std::pair<uint64_t, uint64_t>>>& worth) {
    if (keys.size() != values.size()) throw std::invalid_argument("put_batch: as many values as keys, please");
    if (worth && worth->size() != keys.size())
      throw std::invalid_argument("put_batch: worth needs one (kind, cost) per key");
    if (worth)
      for (const auto& [kind, cost] : *worth)
        if (kind > kValueKindMax) throw std::invalid_argument("put_batch: unknown value kind " + std::to_string(kind));
    std::vector<std::string> ks(keys.begin(), keys.end());
    std::vector<py::buffer_info> infos;
    for (const py::buffer& v : values) infos.push_back(contiguous(v, "put_batch"));
    Store& store = handle->get();
    std::vector<int> statuses(ks.size());
    py::gil_scoped_release nogil;
    const uint64_t chain = store.new_put_batch();
    for (size_t i = 0; i < ks.size(); ++i) {
      PutHint hint{chain, ks.size() >= 2 && i + 1 == ks.size(), owner};
      if (worth) {
        hint.kind = ValueKind((*worth)[i].first);
        hint.worth_cost = (*worth)[i].second;
      }
      statuses[i] = put_one(store, ks[i], static_cast<const uint8_t*>(infos[i].ptr),
                            static_cast<uint64_t>(infos[i].size * infos[i].itemsize), hint);
    }
    return statuses;
  }

  // What the data server does for one EXISTS_BATCH: (present per key, leading keys present).
  py::tuple exists(const std::vector<py::bytes>& keys) {
    std::vector<std::string> ks(keys.begin(), keys.end());
    std::vector<std::string_view> views(ks.begin(), ks.end());
    std::vector<uint8_t> present;
    size_t prefix;
    Store& store = handle->get();
    {
      py::gil_scoped_release nogil;
      prefix = store.exists(views, &present);
    }
    py::list flags;
    for (uint8_t p : present) flags.append(p != 0);
    return py::make_tuple(flags, prefix);
  }

  uint64_t evict_owned(OwnerId owner, uint64_t bytes) {
    Store& store = handle->get();
    py::gil_scoped_release nogil;
    return store.evict_owned(owner, bytes);  // invalid_argument -> ValueError
  }

  // Store::acquire with the GIL released; false on a miss.
  bool acquire_nogil(const py::bytes& key, Lease* lease) {
    std::string k = key;
    Store& store = handle->get();
    py::gil_scoped_release nogil;
    return store.acquire(k, lease);
  }

  py::object acquire(const py::bytes& key) {
    Lease lease;
    if (!acquire_nogil(key, &lease)) return py::none();
    return py::cast(new PyLease(handle, lease), py::return_value_policy::take_ownership);
  }

  py::object get(const py::bytes& key) {
    Store& store = handle->get();
    Lease lease;
    if (!acquire_nogil(key, &lease)) return py::none();
    py::bytes out(reinterpret_cast<const char*>(lease.data), lease.length);
    py::gil_scoped_release nogil;
    store.release(lease);
    return std::move(out);
  }

  bool contains(const py::bytes& key) {
    std::string k = key;
    Store& store = handle->get();
    py::gil_scoped_release nogil;
    return store.contains(k);
  }

  bool remove(const py::bytes& key) {
    std::string k = key;
    Store& store = handle->get();
    py::gil_scoped_release nogil;
    return store.remove(k);
  }

  void flush(py::object progress) {
    Store& store = handle->get();
    std::function<void(uint64_t, uint64_t)> report;
    if (!progress.is_none()) {
      report = [&progress](uint64_t done, uint64_t total) {
        py::gil_scoped_acquire gil;
        progress(done, total);  // an exception here propagates out of flush()
      };
    }
    py::gil_scoped_release nogil;
    store.flush(report);
  }

  void check_integrity() {
    Store& store = handle->get();
    py::gil_scoped_release nogil;
    store.check_integrity();
  }

  // Unmaps the arena, closes segments and releases the data-dir lock. Refused
  // while a lease is held; deferred until the last Lease object (and so the
  // last memoryview of the arena) is gone.
  void close() {
    if (!handle->store || handle->closing) return;
    if (handle->leases_held > 0)
      throw std::runtime_error("close: " + std::to_string(handle->leases_held.load()) +
                               " leases are still held; release() them first");
    handle->closing = true;
    if (handle->lease_objects > 0) return;
    py::gil_scoped_release nogil;
    handle->store.reset();
  }

  py::dict stats() {
    Store& store = handle->get();
    std::vector<std::pair<std::string, int64_t>> gauges;
    {
      py::gil_scoped_release nogil;
      store.fill_gauges(&gauges);
    }
    py::dict out;
    for (auto& [name, value] : handle->metrics.counters()) out[py::str(name)] = value;
    for (auto& [name, value] : gauges) out[py::str(name)] = value;
    return out;
  }
};

}  // namespace

void bind_store(py::module_& m) {
  py::class_<PyLease>(m, "Lease", py::buffer_protocol(),
                      "A value pinned in the arena; read it via .data, then release() (or use `with`).")
      .def_buffer([](PyLease& self) -> py::buffer_info {
        if (!self.held) throw std::runtime_error("Lease was released; acquire the key again to read it");
        return py::buffer_info(const_cast<uint8_t*>(self.lease.data), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(self.lease.length)}, {1}, true);
      })
      .def_property_readonly(
          "data", [](py::object self) { return py::memoryview(self); },
          "read-only memoryview into the arena, valid until release()")
      .def_property_readonly("length", [](PyLease& self) { return self.lease.length; })
      .def_property_readonly("checksum", [](PyLease& self) { return self.lease.checksum; })
      .def_property_readonly("checksum_kind", [](PyLease& self) { return int(self.lease.checksum_kind); })
      .def_property_readonly("held", [](PyLease& self) { return self.held; })
      .def("release", &PyLease::release)
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyLease& self, py::args) { self.release(); });

  py::class_<PyStore>(m, "Store", "The node's storage engine: memory arena + disk segments (see docs/storage.md).")
      .def(py::init<uint64_t, uint64_t, const std::string&, uint64_t, uint64_t, double, uint32_t, bool,
                    const std::string&, double, double, bool, bool, uint64_t>(),
           py::arg("memory_bytes"), py::arg("disk_bytes"), py::arg("data_dir"), py::arg("segment_bytes") = 64ull << 20,
           py::arg("value_bytes_max") = 64ull << 20, py::arg("small_queue_fraction") = 0.10,
           py::arg("eviction_attempts_max") = 4096, py::arg("warm_restart") = true,
           py::arg("eviction_policy") = "chain", py::arg("eviction_ghost_factor") = 2.0,
           py::arg("eviction_fresh_weight") = 0.0, py::arg("eviction_tail_hint") = true,
           py::arg("disk_exclusive") = true, py::arg("index_bytes_max") = 0)
      .def("put", &PyStore::put, py::arg("key"), py::arg("value"), py::arg("checksum") = py::none(),
           py::arg("owner") = 0, py::arg("checksum_kind") = 0,
           "Stores value under key; returns a PutStatus code (Store.STORED, EXISTS, ...). An explicit checksum "
           "is of checksum_kind (0 xxh64, 1 xxh3); none: the store takes the value's XXH3.")
      .def("put_batch", &PyStore::put_batch, py::arg("keys"), py::arg("values"), py::arg("owner") = 0,
           py::arg("worth") = py::none(),
           "Stores the values as one put batch (one prefix chain, in order), as PUT_BATCH does; "
           "a PutStatus code per key. worth: per key (kind, cost) as PUT_BATCH's \"worth\" field.")
      .def("exists", &PyStore::exists, py::arg("keys"),
           "([present per key], leading keys present), as EXISTS_BATCH does (a use of that prefix).")
      .def(
          "keys",
          [](PyStore& self, size_t limit) {
            Store& store = self.handle->get();
            std::vector<std::string> keys;
            {
              py::gil_scoped_release nogil;
              keys = store.keys(limit);
            }
            py::list out;
            for (const std::string& k : keys) out.append(py::bytes(k));
            return out;
          },
          py::arg("limit") = 1 << 20, "Up to `limit` keys stored (either tier), in no order; no recency effect.")
      .def("evict_owned", &PyStore::evict_owned, py::arg("owner"), py::arg("bytes"),
           "Evicts values of `owner` from memory, coldest first, until `bytes` are freed; returns bytes freed.")
      .def("get", &PyStore::get, py::arg("key"), "Copy of the value, or None on a miss.")
      .def("acquire", &PyStore::acquire, py::arg("key"), "A Lease on the value, or None on a miss.")
      .def("contains", &PyStore::contains, py::arg("key"))
      .def("remove", &PyStore::remove, py::arg("key"))
      .def("flush", &PyStore::flush, py::arg("progress") = py::none(),
           "Warm shutdown write; progress(done, total) is called after each value (no store lock held).")
      .def("check_integrity", &PyStore::check_integrity)
      .def("close", &PyStore::close)
      .def("stats", &PyStore::stats)
      .def_property_readonly("arena_bytes", [](PyStore& self) { return self.handle->get().arena_bytes(); })
      .def_property_readonly("arena_fd", [](PyStore& self) { return self.handle->get().arena_fd(); })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyStore& self, py::args) { self.close(); })
      .def_property_readonly_static("STORED", [](py::object) { return static_cast<int>(PutStatus::Stored); })
      .def_property_readonly_static("EXISTS", [](py::object) { return static_cast<int>(PutStatus::Exists); })
      .def_property_readonly_static("NO_SPACE", [](py::object) { return static_cast<int>(PutStatus::NoSpace); })
      .def_property_readonly_static("CHECKSUM_MISMATCH",
                                    [](py::object) { return static_cast<int>(PutStatus::ChecksumMismatch); })
      .def_property_readonly_static("TOO_LARGE", [](py::object) { return static_cast<int>(PutStatus::TooLarge); })
      .def_property_readonly_static("KEY_INVALID", [](py::object) { return static_cast<int>(PutStatus::KeyInvalid); });
}
