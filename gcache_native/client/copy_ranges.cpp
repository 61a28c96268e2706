// copy_ranges: a batch of memcpys between raw addresses in one call, the GIL released.
// The host-memory stand-in for a device's batched DMA (vLLM's swap_blocks_batch): the
// vLLM connector gathers a page's layers into a staging slot, and scatters them back, with
// one call per batch instead of one Python call per run of bytes.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>

namespace py = pybind11;

namespace {

using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

void copy_ranges(const U64Array& dsts, const U64Array& srcs, const U64Array& sizes) {
  if (dsts.ndim() != 1 || srcs.ndim() != 1 || sizes.ndim() != 1 || dsts.size() != srcs.size() ||
      dsts.size() != sizes.size()) {
    throw std::invalid_argument("copy_ranges: dsts, srcs and sizes must be 1-D arrays of one length");
  }
  const uint64_t* dst = dsts.data();
  const uint64_t* src = srcs.data();
  const uint64_t* len = sizes.data();
  const py::ssize_t n = dsts.size();
  for (py::ssize_t i = 0; i < n; ++i) {
    if (len[i] != 0 && (dst[i] == 0 || src[i] == 0)) {
      throw std::invalid_argument("copy_ranges: a null address");
    }
  }
  py::gil_scoped_release release;
  for (py::ssize_t i = 0; i < n; ++i) {
    if (len[i] != 0) {
      std::memmove(reinterpret_cast<void*>(dst[i]), reinterpret_cast<const void*>(src[i]), len[i]);
    }
  }
}

}  // namespace

void bind_copy_ranges(py::module_& m) {
  m.def("copy_ranges", &copy_ranges, py::arg("dsts"), py::arg("srcs"), py::arg("sizes"),
        "memmove(dsts[i], srcs[i], sizes[i]) for each i, in order, with the GIL released. The caller "
        "vouches for the addresses (they come from tensors it holds).");
}
