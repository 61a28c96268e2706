#include "common/checksum.h"

#include <xxh_x86dispatch.h>  // XXH3 through the library's runtime dispatch (SSE2 / AVX2 / AVX-512)

#include <pybind11/pybind11.h>

#include "common/assert.h"

namespace gcache {

const char* checksum_kind_name(ChecksumKind k) {
  switch (k) {
    case ChecksumKind::Xxh64: return "xxh64";
    case ChecksumKind::Xxh3: return "xxh3";
  }
  return "unknown";
}

uint64_t xxh64(const void* data, size_t length, uint64_t seed) { return XXH64(data, length, seed); }

uint64_t xxh3(const void* data, size_t length) { return XXH3_64bits_dispatch(data, length); }

uint64_t checksum_of(ChecksumKind kind, const void* data, size_t length) {
  GCACHE_ASSERT(checksum_kind_valid(uint8_t(kind)));
  return kind == ChecksumKind::Xxh3 ? xxh3(data, length) : xxh64(data, length);
}

ChecksumStream::ChecksumStream(ChecksumKind kind) : kind_(kind) {
  GCACHE_ASSERT(checksum_kind_valid(uint8_t(kind)));
  if (kind_ == ChecksumKind::Xxh3) XXH3_64bits_reset(&xxh3_);
  else XXH64_reset(&xxh64_, 0);
}

void ChecksumStream::update(const void* data, size_t length) {
  if (kind_ == ChecksumKind::Xxh3) XXH3_64bits_update_dispatch(&xxh3_, data, length);
  else XXH64_update(&xxh64_, data, length);
}

uint64_t ChecksumStream::digest() const {
  return kind_ == ChecksumKind::Xxh3 ? XXH3_64bits_digest(&xxh3_) : XXH64_digest(&xxh64_);
}

}  // namespace gcache

namespace py = pybind11;

namespace {
template <class F>
uint64_t hash_buffer(const py::buffer& data, const char* name, F f) {
  py::buffer_info info = data.request();
  if (!PyBuffer_IsContiguous(info.view(), 'A')) throw py::value_error(std::string(name) + " needs a contiguous buffer");
  const size_t n = size_t(info.size) * size_t(info.itemsize);
  py::gil_scoped_release release;
  return f(info.ptr, n);
}
}  // namespace

void bind_checksum(py::module_& m) {
  m.def(
      "xxh64",
      [](py::buffer data, uint64_t seed) {
        return hash_buffer(data, "xxh64", [seed](const void* p, size_t n) { return gcache::xxh64(p, n, seed); });
      },
      py::arg("data"), py::arg("seed") = 0,
      "XXH64 (libxxhash) of any contiguous buffer (bytes, bytearray, memoryview, numpy array).");
  m.def(
      "xxh3", [](py::buffer data) { return hash_buffer(data, "xxh3", gcache::xxh3); }, py::arg("data"),
      "XXH3-64 (libxxhash, no seed) of any contiguous buffer.");
  m.def(
      "checksum",
      [](py::buffer data, int kind) {
        if (!gcache::checksum_kind_valid(uint64_t(kind))) throw py::value_error("unknown checksum kind");
        const auto k = gcache::ChecksumKind(kind);
        return hash_buffer(data, "checksum", [k](const void* p, size_t n) { return gcache::checksum_of(k, p, n); });
      },
      py::arg("data"), py::arg("kind"), "The checksum of the given kind (0 xxh64, 1 xxh3) of a contiguous buffer.");
  m.attr("CHECKSUM_XXH64") = int(gcache::ChecksumKind::Xxh64);
  m.attr("CHECKSUM_XXH3") = int(gcache::ChecksumKind::Xxh3);
}
