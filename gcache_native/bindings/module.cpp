// Python module gcache._native: each part registers its own bindings.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void bind_checksum(py::module_& m);     // common/checksum.cpp
void bind_xxh3_copy(py::module_& m);    // common/xxh3_copy.cpp (copy + XXH3 in one pass)
void bind_store(py::module_& m);        // bindings/store_bindings.cpp
void bind_server(py::module_& m);       // bindings/server_bindings.cpp
void bind_io(py::module_& m);           // client/io_bindings.cpp (client-side socket helpers)
void bind_ketama(py::module_& m);       // client/ketama.cpp (batch placement hashes)
void bind_shm_copy(py::module_& m);     // client/shm_copy.cpp (one-sided copies, client side)
void bind_copy_ranges(py::module_& m);  // client/copy_ranges.cpp (batched memcpys: the host mover)
void bind_shm_scatter(py::module_& m);  // client/shm_scatter.cpp (arena -> KV blocks, checked first)
void bind_cuda_copy(py::module_& m);    // client/cuda_copy.cpp (batched CUDA copies: the GPU mover)
void bind_client_core(py::module_& m);  // client/core_bindings.cpp (the native client core)

PYBIND11_MODULE(_native, m) {
  m.doc() = "GCache native core: arena, index, disk segments, data server";
  // True in the debug build (GCACHE_NATIVE_DEBUG=1: GCACHE_ASSERT on,
  // Store::check_integrity after every store operation; tests/native_debug.sh).
#ifdef GCACHE_DEBUG
  m.attr("DEBUG") = true;
#else
  m.attr("DEBUG") = false;
#endif
  bind_checksum(m);
  bind_xxh3_copy(m);
  bind_store(m);
  bind_server(m);
  bind_io(m);
  bind_ketama(m);
  bind_shm_copy(m);
  bind_copy_ranges(m);
  bind_shm_scatter(m);
  bind_cuda_copy(m);
  bind_client_core(m);
}
