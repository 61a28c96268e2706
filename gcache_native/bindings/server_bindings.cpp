// gcache._native.Server: one node (metrics + store + data server) for the
// gcache-server daemon. Python only configures, starts, stops and reads stats.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "common/metrics.h"
#include "common/sha256.h"
#include "server/auth.h"
#include "server/server.h"
#include "store/store.h"

namespace py = pybind11;

namespace {

using gcache::Metrics;
using gcache::Server;
using gcache::ServerConfig;
using gcache::Store;
using gcache::StoreConfig;

// The store could not open its data dir (locked, unreadable, full...).
class StoreOpenError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Node {
  // Declaration order = reverse destruction order: server, then store.
  std::unique_ptr<Metrics> metrics;
  std::unique_ptr<Store> store;
  std::unique_ptr<Server> server;
  ~Node() {
    // Python drops a Node holding the GIL; a connection thread that ends
    // while the server stops may be waiting for it (the RDMA handler's closed()).
    if (server != nullptr && PyGILState_Check()) {
      PyThreadState* saved = PyEval_SaveThread();
      server.reset();
      PyEval_RestoreThread(saved);
    }
  }
};

// The RDMA_CONNECT hook over a Python object: handler(conn_id, meta bytes) ->
// answer bytes (ValueError: the request is wrong, answered BAD_FRAME with its
// message), handler.closed(conn_id). The GIL is taken only for these calls.
std::shared_ptr<const gcache::RdmaConnectHandler> python_rdma_handler(py::object handler) {
  if (!PyCallable_Check(handler.ptr()) || !py::hasattr(handler, "closed"))
    throw py::type_error("set_rdma_connect_handler needs a callable with a closed(conn_id) method, or None");
  // The last copy may be dropped on a connection thread: take the GIL for it.
  std::shared_ptr<py::object> held(new py::object(std::move(handler)), [](py::object* o) {
    py::gil_scoped_acquire gil;
    delete o;
  });
  auto out = std::make_shared<gcache::RdmaConnectHandler>();
  out->connect = [held](uint64_t conn_id, std::string_view meta, std::string* answer) {
    py::gil_scoped_acquire gil;
    std::string failure;
    try {
      py::object result = (*held)(conn_id, py::bytes(meta.data(), meta.size()));
      if (!py::isinstance<py::bytes>(result)) {
        failure = "the RDMA handler returned " + std::string(py::str(py::type::of(result))) + ", not bytes";
      } else {
        *answer = result.cast<std::string>();
        return true;
      }
    } catch (py::error_already_set& e) {
      if (e.matches(PyExc_ValueError)) {
        *answer = py::str(e.value());
        return false;
      }
      failure = std::string("the RDMA handler failed: ") + e.what();
    }
    throw std::runtime_error(failure);  // answered INTERNAL
  };
  out->closed = [held](uint64_t conn_id) {
    py::gil_scoped_acquire gil;
    try {
      held->attr("closed")(conn_id);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("gcache RDMA handler closed()");
    }
  };
  return out;
}

// [{"name", "token", "roles": [str], "memory": int, "disk": int | None}] ->
// the tenant table; ValueError naming what is wrong.
std::shared_ptr<const gcache::TenantTable> read_tenants(const py::list& items) {
  std::vector<std::unique_ptr<gcache::Tenant>> tenants;
  for (py::handle item : items) {
    py::dict d = py::cast<py::dict>(item);
    auto t = std::make_unique<gcache::Tenant>();
    t->name = py::cast<std::string>(d["name"]);
    t->token = py::cast<std::string>(d["token"]);
    for (py::handle role : py::cast<py::list>(d["roles"])) {
      const std::string r = py::cast<std::string>(role);
      if (r == "read") t->roles |= gcache::kRoleRead;
      else if (r == "write") t->roles |= gcache::kRoleWrite;
      else if (r == "admin") t->roles |= gcache::kRoleAdmin;
      else if (r == "cluster") t->roles |= gcache::kRoleCluster;
      else throw py::value_error("tenant '" + t->name + "': unknown role '" + r + "'");
    }
    if (d.contains("memory") && !d["memory"].is_none()) t->memory_quota = py::cast<uint64_t>(d["memory"]);
    if (d.contains("disk") && !d["disk"].is_none()) {
      t->disk_quota = py::cast<uint64_t>(d["disk"]);
      t->disk_off = t->disk_quota == 0;
    }
    tenants.push_back(std::move(t));
  }
  try {
    return std::make_shared<const gcache::TenantTable>(std::move(tenants));
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
}

gcache::PolicyKind policy_kind_or_value_error(const std::string& name) {
  try {
    return gcache::policy_kind_from_name(name);
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
}

void read_config(const py::dict& config, StoreConfig* sc, ServerConfig* vc) {
  // Not reformatted: a list of names, packed.
  // clang-format off
  static const std::set<std::string> known = {
      "host", "port", "connections_max", "idle_timeout_s", "stall_timeout_s", "meta_bytes_max",
      "frame_payload_bytes_max", "batch_keys_max", "socket_buffer_bytes", "epoch", "version",
      "memory_bytes", "disk_bytes", "data_dir", "segment_bytes", "value_bytes_max",
      "small_queue_fraction", "eviction_attempts_max", "warm_restart", "tenants", "auth_timeout_s",
      "connections_per_address_max", "connections_per_tenant_max", "meta_buffer_bytes_max",
      "put_reserve_bytes_max", "index_bytes_max", "eviction_policy",
      "eviction_ghost_factor", "eviction_fresh_weight", "eviction_tail_hint", "disk_exclusive",
      "unix_socket_path", "shm_lease_s", "shm_scrub", "instance_id", "preauth_connections_max",
      "preauth_connections_per_address_max", "spin_us"};
  // clang-format on
  for (auto item : config) {
    const std::string key = py::cast<std::string>(item.first);
    if (!known.count(key)) throw py::value_error("unknown server config key '" + key + "'");
    py::handle v = item.second;
    if (key == "host") vc->host = py::cast<std::string>(v);
    else if (key == "port") vc->port = py::cast<uint16_t>(v);
    else if (key == "connections_max") vc->connections_max = py::cast<uint32_t>(v);
    else if (key == "idle_timeout_s") vc->idle_timeout_s = py::cast<double>(v);
    else if (key == "stall_timeout_s") vc->stall_timeout_s = py::cast<double>(v);
    else if (key == "meta_bytes_max") vc->meta_bytes_max = py::cast<uint32_t>(v);
    else if (key == "frame_payload_bytes_max") vc->frame_payload_bytes_max = py::cast<uint64_t>(v);
    else if (key == "batch_keys_max") vc->batch_keys_max = py::cast<uint32_t>(v);
    else if (key == "socket_buffer_bytes") vc->socket_buffer_bytes = py::cast<int>(v);
    else if (key == "epoch") vc->epoch = py::cast<int64_t>(v);
    else if (key == "version") vc->version = py::cast<std::string>(v);
    else if (key == "memory_bytes") sc->memory_bytes = py::cast<uint64_t>(v);
    else if (key == "disk_bytes") sc->disk_bytes = py::cast<uint64_t>(v);
    else if (key == "data_dir") sc->data_dir = py::cast<std::string>(v);
    else if (key == "segment_bytes") sc->segment_bytes = py::cast<uint64_t>(v);
    else if (key == "value_bytes_max") sc->value_bytes_max = py::cast<uint64_t>(v);
    else if (key == "small_queue_fraction") sc->eviction.small_queue_fraction = py::cast<double>(v);
    else if (key == "eviction_attempts_max") sc->eviction_attempts_max = py::cast<uint32_t>(v);
    else if (key == "warm_restart") sc->warm_restart = py::cast<bool>(v);
    else if (key == "index_bytes_max") sc->index_bytes_max = py::cast<uint64_t>(v);
    else if (key == "auth_timeout_s") vc->auth_timeout_s = py::cast<double>(v);
    else if (key == "preauth_connections_max") vc->preauth_connections_max = py::cast<uint32_t>(v);
    else if (key == "preauth_connections_per_address_max")
      vc->preauth_connections_per_address_max = py::cast<uint32_t>(v);
    else if (key == "connections_per_address_max") vc->connections_per_address_max = py::cast<uint32_t>(v);
    else if (key == "connections_per_tenant_max") vc->connections_per_tenant_max = py::cast<uint32_t>(v);
    else if (key == "meta_buffer_bytes_max") vc->meta_buffer_bytes_max = py::cast<uint64_t>(v);
    else if (key == "put_reserve_bytes_max") vc->put_reserve_bytes_max = py::cast<uint64_t>(v);
    else if (key == "tenants" && !v.is_none()) vc->tenants = read_tenants(py::cast<py::list>(v));
    else if (key == "eviction_policy") sc->eviction.kind = policy_kind_or_value_error(py::cast<std::string>(v));
    else if (key == "eviction_ghost_factor") sc->eviction.ghost_factor = py::cast<double>(v);
    else if (key == "eviction_fresh_weight") sc->eviction.fresh_weight = py::cast<double>(v);
    else if (key == "eviction_tail_hint") sc->eviction.chain_tail_hint = py::cast<bool>(v);
    else if (key == "disk_exclusive") sc->disk_exclusive = py::cast<bool>(v);
    else if (key == "unix_socket_path") vc->unix_socket_path = py::cast<std::string>(v);
    else if (key == "shm_lease_s") vc->shm_lease_s = py::cast<double>(v);
    else if (key == "shm_scrub") vc->shm_scrub = py::cast<bool>(v);
    else if (key == "spin_us") vc->spin_us = py::cast<uint32_t>(v);
    else if (key == "instance_id") vc->instance_id = py::cast<std::string>(v);
  }
  if (!(vc->shm_lease_s > 0 && vc->shm_lease_s <= 3600)) throw py::value_error("shm_lease_s must be in (0, 3600]");
  if (vc->spin_us > 10000) throw py::value_error("spin_us must be in [0, 10000]");
  if (vc->preauth_connections_max == 0 || vc->preauth_connections_per_address_max == 0)
    throw py::value_error("preauth_connections_max and preauth_connections_per_address_max must be at least 1");
  if (vc->tenants) {
    for (const auto& t : vc->tenants->all()) {
      if (t->key_prefix.empty()) continue;  // the cluster role stores nothing of its own
      sc->owner_quotas.push_back({t->index, t->name, t->memory_quota, t->disk_quota, t->disk_off});
    }
  }
  try {
    gcache::validate_eviction_config(sc->eviction);
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
}

// Runs f with the GIL released. Not gil_scoped_release: its noexcept
// destructor turns the forced unwind that ends a daemon thread (e.g. an admin
// HTTP request) at interpreter exit into std::terminate.
template <class F>
void without_gil(F&& f) {
  PyThreadState* saved = PyEval_SaveThread();
  try {
    f();
  } catch (...) {
    PyEval_RestoreThread(saved);
    throw;
  }
  PyEval_RestoreThread(saved);
}

py::dict stats_dict(Node& node) {
  py::dict counters, gauges, histograms, histogram_sums_us;
  for (const auto& [name, value] : node.metrics->counters()) counters[py::str(name)] = value;
  std::vector<std::pair<std::string, int64_t>> g;
  node.store->fill_gauges(&g);
  node.server->fill_gauges(&g);
  for (const auto& [name, value] : g) gauges[py::str(name)] = value;
  for (const auto& [name, buckets] : node.metrics->histograms()) histograms[py::str(name)] = py::cast(buckets);
  for (const auto& [name, sum] : node.metrics->histogram_sums_us()) histogram_sums_us[py::str(name)] = sum;
  py::dict tenants;  // per-tenant usage and quotas (auth on); no key names
  for (const gcache::OwnerUsage& u : node.store->owner_usage()) {
    py::dict t;
    t["memory_bytes"] = u.memory_bytes;
    t["disk_bytes"] = u.disk_bytes;
    t["memory_quota_bytes"] = u.quota.memory_bytes;
    t["disk_quota_bytes"] = u.quota.disk_bytes;
    t["disk_off"] = u.quota.disk_off;
    t["quota_evictions"] = u.quota_evictions;
    t["disk_refusals"] = u.disk_refusals;
    t["puts_over_quota"] = u.puts_over_quota;
    tenants[py::str(u.quota.name)] = t;
  }
  py::dict out;
  out["tenants"] = tenants;
  out["counters"] = counters;
  out["gauges"] = gauges;
  out["histograms"] = histograms;
  out["histogram_sums_us"] = histogram_sums_us;
  return out;
}

}  // namespace

void bind_server(py::module_& m) {
  m.def(
      "hmac_sha256",
      [](py::bytes key, py::bytes message) {
        const auto d = gcache::hmac_sha256(std::string(key), std::string(message));
        return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
      },
      py::arg("key"), py::arg("message"),
      "HMAC-SHA256 as the data server computes it for AUTH (tests compare it with hmac).");
  py::register_exception<gcache::BindError>(m, "BindError", PyExc_OSError);
  py::register_exception<StoreOpenError>(m, "StoreOpenError", PyExc_RuntimeError);

  py::class_<Node>(m, "Server", R"doc(
One GCache node: metrics, the store (memory arena + disk segments) and the
TCP data server of docs/protocol.md.

Server(config: dict) opens the store and binds the port; it serves nothing
until start(). Config keys: host, port (0 = any free port), connections_max,
idle_timeout_s, stall_timeout_s, meta_bytes_max, frame_payload_bytes_max,
batch_keys_max, socket_buffer_bytes, epoch, version, memory_bytes, disk_bytes,
data_dir, segment_bytes, value_bytes_max, small_queue_fraction,
eviction_attempts_max, warm_restart, tenants (None = no authentication, or a
list of {"name", "token", "roles": ["read"|"write"|"admin"|"cluster"], "memory",
"disk"}), auth_timeout_s, preauth_connections_max,
preauth_connections_per_address_max (both at least 1), connections_per_address_max, connections_per_tenant_max,
meta_buffer_bytes_max, put_reserve_bytes_max, index_bytes_max, eviction_policy
("chain", "s3fifo", "lru"), eviction_ghost_factor, eviction_fresh_weight (0 =
tuned online), eviction_tail_hint, disk_exclusive (docs/storage.md), unix_socket_path ("" = none),
shm_lease_s, shm_scrub, instance_id (docs/protocol.md, "Shared memory and RDMA"), spin_us (how long
a connection's thread polls for the next small request before it sleeps; 0 = never). Unknown keys
and out-of-range values raise ValueError.
Raises StoreOpenError (data dir unusable) or BindError (port taken).
)doc")
      .def(py::init([](py::dict config) {
             StoreConfig sc;
             ServerConfig vc;
             read_config(config, &sc, &vc);
             auto node = std::make_unique<Node>();
             py::gil_scoped_release release;
             node->metrics = std::make_unique<Metrics>();
             try {
               node->store = std::make_unique<Store>(sc, node->metrics.get());
             } catch (const std::exception& e) {
               throw StoreOpenError(std::string("cannot open the store in '") + sc.data_dir + "': " + e.what());
             }
             node->server = std::make_unique<Server>(vc, node->store.get(), node->metrics.get());
             return node;
           }),
           py::arg("config"))
      .def_property_readonly(
          "port", [](Node& n) { return n.server->port(); }, "The listening port (the real one when 0 was asked).")
      .def(
          "start", [](Node& n) { without_gil([&] { n.server->start(); }); },
          "Starts accepting connections (returns at once).")
      .def(
          "stop", [](Node& n, double grace_s) { without_gil([&] { n.server->stop(grace_s); }); },
          py::arg("grace_s") = 10.0,
          "Stops accepting, finishes requests already received, closes connections; "
          "after grace_s cuts off the rest. Idempotent. Does not flush.")
      .def(
          "flush", [](Node& n) { without_gil([&] { n.store->flush(); }); },
          "Writes the memory tier and the warm list to disk (fsynced).")
      .def(
          "check_integrity", [](Node& n) { without_gil([&] { n.store->check_integrity(); }); },
          "Raises naming the first broken store invariant.")
      .def("stats", &stats_dict,
           "{'counters': {name: int}, 'gauges': {name: int}, 'histograms': {name: [32 bucket counts]}, "
           "'histogram_sums_us': {name: int}}")
      .def(
          "set_cluster_map",
          [](Node& n, int64_t epoch, py::bytes map_bytes) {
            std::string blob = map_bytes;
            n.server->set_cluster_map(epoch, std::move(blob));  // invalid_argument -> ValueError
          },
          py::arg("epoch"), py::arg("map_bytes"),
          "Sets the cluster-map epoch and its msgpack map together. From then on a data request "
          "carrying an older \"epoch\" is answered STALE_EPOCH with this map and not executed. "
          "ValueError if epoch is below Server.epoch (equal replaces the map) or the map is over 4 MiB.")
      .def_property_readonly(
          "epoch", [](Node& n) { return n.server->epoch(); },
          "The current cluster-map epoch (config \"epoch\" until set_cluster_map).")
      .def_property_readonly(
          "cluster_map", [](Node& n) { return py::bytes(*n.server->cluster_map().second); },
          "The current cluster map blob (b\"\" until set_cluster_map).")
      .def(
          "keys",
          [](Node& n, int64_t limit) {
            if (limit < 0) throw py::value_error("keys: limit must be >= 0");
            std::vector<std::string> keys;
            without_gil([&] { keys = n.store->keys(size_t(limit)); });
            py::list out(keys.size());
            for (size_t i = 0; i < keys.size(); ++i) out[i] = py::bytes(keys[i]);
            return out;
          },
          py::arg("limit"),
          "Up to `limit` distinct keys stored now (memory and disk tiers), in no particular order, "
          "read page by page (keys_page): not one snapshot. Keys come back as bytes.")
      .def(
          "keys_page",
          [](Node& n, int64_t cursor, int64_t limit) {
            if (cursor < 0) throw py::value_error("keys_page: cursor must be >= 0 (0 starts a scan)");
            if (limit < 1) throw py::value_error("keys_page: limit must be >= 1");
            Store::KeysPage page;
            without_gil(
                [&] { page = n.store->keys_page(uint64_t(cursor), size_t(limit)); });  // invalid_argument -> ValueError
            py::list keys(page.keys.size());
            for (size_t i = 0; i < page.keys.size(); ++i) keys[i] = py::bytes(page.keys[i]);
            return py::make_tuple(int64_t(page.next_cursor), keys);
          },
          py::arg("cursor"), py::arg("limit"),
          "One page of a key scan: (next_cursor, [key bytes]). Start with cursor 0 and pass "
          "next_cursor back until it is 0. The store lock is held for one page only. A page holds "
          "at most min(limit, 65536) keys (more only when one hash bucket alone holds more) and may "
          "be empty before the end. Every key stored for the whole scan is listed at least once; "
          "after an index rehash the scan starts over, so keys may repeat. ValueError for a cursor "
          "no page returned, a negative cursor, or limit < 1.")
      .def(
          "wait_puts_admitted_before",
          [](Node& n, int64_t epoch, double timeout_s) {
            if (!(timeout_s >= 0)) throw py::value_error("wait_puts_admitted_before: timeout_s must be >= 0");
            bool drained = false;
            without_gil([&] { drained = n.server->wait_puts_admitted_before(epoch, timeout_s); });
            return drained;
          },
          py::arg("epoch"), py::arg("timeout_s"),
          "Waits until no PUT_BATCH frame admitted while the server epoch was below `epoch` is "
          "still storing its values; True when none is, False after timeout_s. Called after "
          "set_cluster_map(epoch), a key listing that follows sees every such frame's keys.")
      .def(
          "remove_keys",
          [](Node& n, const std::vector<std::string>& keys) {
            size_t removed = 0;
            without_gil([&] {
              for (const std::string& k : keys) removed += n.store->remove(k) ? 1 : 0;
            });
            return removed;
          },
          py::arg("keys"), "Removes each key (bytes) from both tiers, as REMOVE_BATCH does; returns how many existed.")
      .def_property_readonly("arena_fd", [](Node& n) { return n.store->arena_fd(); })
      .def_property_readonly("arena_bytes", [](Node& n) { return n.store->arena_bytes(); })
      .def_property_readonly(
          "reserve_bytes_per_connection", [](Node& n) { return n.server->reserve_bytes_per_connection(); },
          "What one one-sided (shm, rdma) connection's RESERVEs may hold at once.")
      .def_property_readonly(
          "arena_address", [](Node& n) { return reinterpret_cast<uintptr_t>(n.store->arena_base()); },
          "The arena's address in this process (to register it with an RDMA device).")
      .def(
          "set_rdma_region", [](Node& n, uint64_t addr, uint32_t rkey) { n.server->set_rdma_region(addr, rkey); },
          py::arg("addr"), py::arg("rkey"),
          "Sends the arena's RDMA address and rkey with every LOOKUP and RESERVE answer; rkey 0 stops it.")
      .def(
          "set_rdma_connect_handler",
          [](Node& n, py::object handler) {
            n.server->set_rdma_connect_handler(handler.is_none() ? nullptr : python_rdma_handler(handler));
          },
          py::arg("handler"),
          "Answers RDMA_CONNECT with handler(conn_id: int, meta: bytes) -> bytes (a msgpack map; "
          "ValueError answers BAD_FRAME with its message, other exceptions INTERNAL), called on the "
          "connection's thread; handler.closed(conn_id) runs when that connection ends. None: refused.");
}
